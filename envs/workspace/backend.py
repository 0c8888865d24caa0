"""How a sandbox runs on this machine (:class:`Backend`: ``bwrap`` or plain ``rlimit``),
and the pieces both modes share (private uids, the ``bwrap`` command line).

Which backend this machine can run is :func:`envs.workspace.sandbox.detect_backend`: it
probes by really running a tiny program in a throwaway :class:`~envs.workspace.sandbox.
Sandbox`, so it lives with the sandbox (this module imports nothing of it).
"""

from __future__ import annotations

import functools
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from envs.workspace import _procs

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
