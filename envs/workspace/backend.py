"""Which sandbox this machine can run: ``bwrap`` (bubblewrap) or plain ``rlimit``.

:func:`detect_backend` probes once per process by really running a tiny program in a
throwaway sandbox, so a machine where ``bwrap`` is installed but not permitted (no user
namespaces, a locked-down container) falls back cleanly instead of failing mid-episode.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import InvalidOptionError
from envs.workspace import _procs
from envs.workspace.errors import SandboxUnavailableError

MODES = ("auto", "bwrap", "rlimit")
BWRAP_INSTALL = "apt-get install -y bubblewrap"
SANDBOX_HOME = "/workspace"  # where the workspace is mounted in bwrap mode
SANDBOX_BIN = "/opt/agentenv/bin"  # python/python3 links inside the bwrap sandbox
UID_BASE, UID_SPAN = 1_500_000_000, 1 << 26  # private uids (never in /etc/passwd)


@dataclass(frozen=True)
class Backend:
    """How this machine runs sandboxes.

    Attributes:
        mode: ``"bwrap"`` or ``"rlimit"``.
        python: Interpreter used inside the sandbox (a real path).
        drop_privileges: Children switch to a private unprivileged uid (the host is root).
        bwrap: Path of the ``bwrap`` executable (bwrap mode only).
        note: Why this backend was chosen, e.g. why bwrap was not used.
    """

    mode: str
    python: str
    drop_privileges: bool
    bwrap: str | None = None
    note: str = ""


def allocate_uid() -> int:
    """A random private uid for one workspace (used only when the host is root)."""
    rng = random.SystemRandom()
    while True:
        uid = UID_BASE + rng.randrange(UID_SPAN)
        if not _procs.live_pids_of_uid(uid):
            return uid


def bwrap_args(backend: Backend, workdir: str) -> list[str]:
    """The ``bwrap`` command line, up to the sandboxed command, for ``workdir``.

    New ipc, pid, net, uts (and cgroup) namespaces; ``--die-with-parent``; a new
    session (no terminal injection); read-only ``/usr``, the interpreter's install and
    ``/opt/agentenv/bin``; the workspace read-write at ``/workspace``; everything else
    absent, and the root read-only. As real root no user namespace is made: the
    process keeps only CAP_SETUID/CAP_SETGID, which ``_boot`` uses to drop to the uid.
    """
    args = [backend.bwrap or "bwrap", "--die-with-parent", "--new-session"]
    args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    args += ["--unshare-cgroup-try"]
    if backend.drop_privileges:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    args += _bwrap_mounts(backend.python)
    return [*args, "--bind", workdir, SANDBOX_HOME, "--chdir", SANDBOX_HOME, "--remount-ro", "/"]


@functools.lru_cache(maxsize=8)
def _bwrap_mounts(python: str) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    made = {"/"}
    installs = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}
    installs.add(os.path.dirname(os.path.dirname(python)))
    for folder in sorted(installs):
        if folder == "/usr" or folder.startswith("/usr/"):
            continue
        for parent in reversed(Path(folder).parents):  # bwrap would create them mode 0700
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", folder, folder]
    args += ["--proc", "/proc", "--dev", "/dev"]
    for folder in ("/opt", "/opt/agentenv", SANDBOX_BIN):
        args += ["--perms", "0755", "--dir", folder]
    args += ["--symlink", python, f"{SANDBOX_BIN}/python"]
    args += ["--symlink", python, f"{SANDBOX_BIN}/python3"]
    return args


@functools.lru_cache(maxsize=4)
def detect_backend(mode: str = "auto") -> Backend:
    """Choose how to sandbox on this machine; probes once per process and mode.

    Args:
        mode: ``"auto"`` (bwrap when it works, else rlimit with a ``RuntimeWarning``),
            ``"bwrap"`` (fail if unusable) or ``"rlimit"``.

    Raises:
        InvalidOptionError: unknown mode.
        SandboxUnavailableError: ``"bwrap"`` was asked for but cannot run here, or (as
            root) no Python interpreter is usable by an unprivileged uid.
    """
    if mode not in MODES:
        raise InvalidOptionError(f"sandbox must be one of {MODES}, got {mode!r}")
    root = os.geteuid() == 0
    python = os.path.realpath(sys.executable)
    note = ""
    if mode in ("auto", "bwrap"):
        exe = shutil.which("bwrap")
        if exe is None:
            note = f"bwrap (bubblewrap) is not installed; install it with `{BWRAP_INSTALL}`"
        else:
            backend = Backend("bwrap", python, root, exe)
            problem = _probe(backend)
            if not problem:
                return backend
            note = f"bwrap is installed but cannot create a sandbox here ({problem})"
        if mode == "bwrap":
            raise SandboxUnavailableError(f"{note}; or pass sandbox='rlimit'")
        warnings.warn(
            f"Workspace sandbox: {note}. Falling back to the rlimit sandbox, which does NOT "
            "block network access or hide the rest of the filesystem.",
            RuntimeWarning,
            stacklevel=2,
        )
    if not root:
        return Backend("rlimit", python, False, note=note)
    failures = []
    for candidate in _python_candidates(python):
        backend = Backend("rlimit", candidate, True, note=note)
        problem = _probe(backend)
        if not problem:
            return backend
        failures.append(f"{candidate}: {problem}")
    raise SandboxUnavailableError(
        "running as root, the rlimit sandbox runs code as an unprivileged uid, but no Python "
        f"interpreter is usable by one ({'; '.join(failures)}); install a system-wide python3 "
        f"(apt-get install -y python3) or bubblewrap (`{BWRAP_INSTALL}`)"
    )


def _python_candidates(python: str) -> list[str]:
    """The host interpreter first, then system ones (a root-only pyenv fails the probe)."""
    found = [python]
    for name in ("python3", "python"):
        exe = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
        if exe and os.path.realpath(exe) not in found:
            found.append(os.path.realpath(exe))
    return found


def _probe(backend: Backend) -> str:
    """Run a tiny program in a throwaway sandbox: ``""`` if it worked, else the problem."""
    from envs.workspace.sandbox import Sandbox, SandboxLimits

    root = tempfile.mkdtemp(prefix="agentenv-ws-probe-")
    box = None
    try:
        uid = allocate_uid() if backend.drop_privileges else None
        if uid is not None:
            os.chown(root, uid, uid)
        box = Sandbox(root, limits=SandboxLimits(timeout_s=30), backend=backend, uid=uid)
        code = "import csv, json, unittest\nopen('probe.txt', 'w').write('ok')\nprint('ok')"
        result = box.run_python(code)
        written = os.path.isfile(os.path.join(root, "probe.txt"))
        if result.ok and result.output.strip() == "ok" and written:
            return ""
        lines = result.output.strip().splitlines() or [result.detail or "no output"]
        return lines[-1][:300]
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if box is not None:
            box.close()
        shutil.rmtree(root, ignore_errors=True)
