"""Run untrusted code in a child process with hard limits, in one of two modes.

``rlimit`` mode (works everywhere on Linux): the child gets its own session and process
group, the workspace as cwd, a minimal environment (no inherited variables), ``python
-I -S``, and ``setrlimit`` limits (CPU seconds, address space, file size, processes,
open files, no core dumps) set by :mod:`envs.workspace._boot` before the code runs.
When the host runs as root the child drops to a random unprivileged uid of its own, so
``RLIMIT_NPROC`` bounds fork bombs (root ignores it), root-only files stay unreadable,
and every process the code started can be killed at once with ``kill(-1)`` from that uid.

``bwrap`` mode (when bubblewrap is installed and permitted): the same, inside new
network, pid, ipc and uts namespaces with a read-only view of only ``/usr``, the Python
install and the workspace (mounted read-write at ``/workspace``): no network, the rest
of the filesystem hidden, and the whole pid namespace dies with its first process.

Every run ends with the process group (and, with a uid, every process of that uid)
SIGKILLed: nothing started by a call outlives it. Output (stdout and stderr merged) is
read incrementally; only its head and tail are kept. See ``docs/envs/workspace.md``
("The sandbox, and what it does *not* protect") for what each mode does and does not
protect against.
"""

from __future__ import annotations

import functools
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

from agentenv.errors import InvalidOptionError
from envs.workspace import _procs
from envs.workspace.backend import (
    BWRAP_INSTALL,
    MODES,
    SANDBOX_BIN,
    SANDBOX_HOME,
    Backend,
    allocate_uid,
    bwrap_args,
)
from envs.workspace.errors import SandboxUnavailableError
from envs.workspace.paths import usage

_SIGNAL_HINTS = {
    "SIGXCPU": "the CPU time limit was reached",
    "SIGXFSZ": "the file size limit was reached",
    "SIGKILL": "killed (out of memory, or by the code itself)",
    "SIGSEGV": "the process crashed",
}


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Attributes:
        timeout_s: Wall-clock seconds before every process of the run is killed.
        cpu_s: CPU seconds per process (``RLIMIT_CPU``); default ``ceil(timeout_s) + 1``.
        memory_bytes: Address space per process (``RLIMIT_AS``).
        file_size_bytes: Largest file a process may write (``RLIMIT_FSIZE``).
        max_processes: Processes and threads of the run (``RLIMIT_NPROC``).
        max_open_files: Open file descriptors per process (``RLIMIT_NOFILE``).
        max_output_bytes: Output kept (head and tail); the rest is counted and dropped.
        poll_interval_s: How often the workspace quota is checked during a run.
    """

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    max_processes: int = 32
    max_open_files: int = 128
    max_output_bytes: int = 64 << 10
    poll_interval_s: float = 0.2

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise InvalidOptionError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        for name in ("memory_bytes", "file_size_bytes", "max_processes", "max_open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidOptionError(f"SandboxLimits.{name} must be an int >= 1, got {value!r}")
        if self.memory_bytes < 64 << 20:
            raise InvalidOptionError(
                f"memory_bytes={self.memory_bytes} is too small for Python to start; use >= 64 MiB"
            )
        if self.max_output_bytes < 256:
            raise InvalidOptionError(
                f"max_output_bytes must be >= 256, got {self.max_output_bytes}"
            )
        if self.cpu_s is not None and self.cpu_s < 1:
            raise InvalidOptionError(f"cpu_s must be >= 1, got {self.cpu_s}")
        if not self.poll_interval_s > 0:
            raise InvalidOptionError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")

    def rlimits(self, nproc_base: int = 0) -> str:
        """The limits as ``_boot`` reads them: ``"cpu:soft:hard,as:soft:hard,..."``."""
        cpu = self.cpu_s or math.ceil(self.timeout_s) + 1
        nproc = nproc_base + self.max_processes
        pairs = {
            "cpu": (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
            "as": (self.memory_bytes,) * 2,
            "fsize": (self.file_size_bytes,) * 2,
            "nproc": (nproc, nproc),
            "nofile": (self.max_open_files,) * 2,
            "core": (0, 0),
        }
        return ",".join(f"{name}:{soft}:{hard}" for name, (soft, hard) in pairs.items())


@dataclass
class RunResult:
    """What one sandboxed run did.

    Attributes:
        output: Merged stdout/stderr (head and tail kept around a marker when long).
        exit_code: The exit status, or ``None`` when a signal or the sandbox ended the run.
        signal: Name of the signal that ended it (``"SIGXCPU"``), if any.
        stopped: Why the sandbox stopped it: ``"timeout"``, ``"quota"``, ``"closed"`` or ``None``.
        detail: A sentence explaining ``stopped`` or ``signal``.
        output_bytes: Total bytes of output produced (kept or not).
        elapsed_s: Wall-clock seconds.
    """

    output: str
    exit_code: int | None
    signal: str | None = None
    stopped: str | None = None
    detail: str = ""
    output_bytes: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the code ran to completion with exit status 0."""
        return self.exit_code == 0 and self.stopped is None


class _Capture:
    """Keeps the first and last ``cap / 2`` bytes of a stream and counts the rest."""

    def __init__(self, cap: int):
        self.half = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > self.half:
                del self.tail[: len(self.tail) - self.half]

    def text(self) -> str:
        dropped = self.total - len(self.head) - len(self.tail)
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        body = head + (f"\n[... {dropped} bytes of output truncated ...]\n" if dropped else "")
        return (body + tail).replace("\x00", "\\0")


@dataclass
class ProcessTracker:
    """Live runs of one sandbox. Holds no reference to the sandbox, so a
    ``weakref.finalize`` can keep it and still kill everything at garbage collection."""

    python: str
    uid: int | None
    procs: set[subprocess.Popen] = field(default_factory=set)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def kill_all(self) -> None:
        """SIGKILL every tracked process group and every process of the uid."""
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            _procs.kill_group(proc.pid)
        if self.uid is not None:
            _procs.kill_uid(self.python, self.uid)


class Sandbox:
    """Runs code for one workspace directory; runs are serialised by :attr:`lock`.

    Args:
        workdir: The workspace directory (cwd of the code); must exist and, when the
            backend drops privileges, belong to ``uid``.
        limits: Limits of every run.
        backend: From :func:`detect_backend` (default ``"auto"``).
        uid: Private unprivileged uid (and gid) for the code; required when the backend
            drops privileges (see :func:`~envs.workspace.backend.allocate_uid`).
        quota: ``(max_entries, max_bytes)`` of the workspace, checked every
            ``poll_interval_s`` during a run; passing it stops the run.
        site_packages: Let the code import the interpreter's site-packages.
        bin_dir: Host folder with ``python``/``python3`` links, first on ``PATH`` (rlimit).
        tracker: Share this process tracker (e.g. one a finalizer already holds).
    """

    def __init__(
        self,
        workdir: str,
        *,
        limits: SandboxLimits | None = None,
        backend: Backend | None = None,
        uid: int | None = None,
        quota: tuple[int, int] | None = None,
        site_packages: bool = False,
        bin_dir: str | None = None,
        tracker: ProcessTracker | None = None,
    ):
        self.workdir = os.path.realpath(workdir)
        self.limits = limits or SandboxLimits()
        self.backend = backend or detect_backend("auto")
        if self.backend.drop_privileges and uid is None:
            raise InvalidOptionError(
                "this sandbox backend drops privileges (the host is root): pass uid=allocate_uid()"
            )
        self.uid = uid if self.backend.drop_privileges else None
        self.quota = quota
        self.site_packages = site_packages
        self.bin_dir = bin_dir
        self.lock = threading.RLock()
        self.tracker = tracker or ProcessTracker(self.backend.python, self.uid)

    @property
    def mode(self) -> str:
        """``"bwrap"`` or ``"rlimit"``."""
        return self.backend.mode

    def run_python(self, code: str, *, timeout_s: float | None = None) -> RunResult:
        """Run Python source ``code`` as ``__main__`` with the workspace as cwd."""
        return self._run("python", [code], timeout_s)

    def run_command(self, argv: list[str], *, timeout_s: float | None = None) -> RunResult:
        """Run ``argv`` (looked up on the sandbox ``PATH``), e.g. ``["sh", "-c", "ls"]``."""
        if not argv:
            raise InvalidOptionError("run_command needs a non-empty argv")
        return self._run("exec", list(argv), timeout_s)

    def close(self) -> None:
        """Kill everything still running and refuse further runs. Idempotent."""
        with self.tracker.lock:
            self.tracker.closed = True
        self.tracker.kill_all()

    # ---- internals ----------------------------------------------------------------------
    @property
    def _guarded(self) -> bool:  # rlimit mode: _boot forks a guard parent (see _boot._guard)
        return self.mode == "rlimit"

    def _argv(self, action: str, payload: list[str]) -> list[str]:
        shared_uid = self.mode == "rlimit" and self.uid is None  # NPROC counts all our tasks
        nproc_base = _procs.count_tasks_of_uid(os.getuid()) if shared_uid else 0
        cfg = {
            "action": action,
            "uid": "" if self.uid is None else str(self.uid),
            "limits": self.limits.rlimits(nproc_base),
            "parent": str(os.getpid()) if self.mode == "rlimit" else "",
            "guard": "1" if self._guarded else "0",
            "site": "1" if self.site_packages else "0",
        }
        boot = [self.backend.python, "-I", "-S", "-c", _procs.boot_source()]
        boot += [f"{k}={v}" for k, v in cfg.items()] + ["--", *payload]
        return [*bwrap_args(self.backend, self.workdir), *boot] if self.mode == "bwrap" else boot

    def _env(self) -> dict[str, str]:
        bwrap = self.mode == "bwrap"
        home = SANDBOX_HOME if bwrap else self.workdir
        bin_dir = SANDBOX_BIN if bwrap else self.bin_dir
        return {
            "PATH": ":".join(p for p in (bin_dir, "/usr/local/bin", "/usr/bin", "/bin") if p),
            "HOME": home,
            "TMPDIR": home,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }

    def _run(self, action: str, payload: list[str], timeout_s: float | None) -> RunResult:
        timeout = float(timeout_s or self.limits.timeout_s)
        closed = RunResult("", None, stopped="closed", detail="the workspace is closed")
        with self.lock:
            start = time.monotonic()
            with self.tracker.lock:
                if self.tracker.closed:
                    return closed
                proc = subprocess.Popen(
                    self._argv(action, payload),
                    cwd=self.workdir,
                    env=self._env(),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
                self.tracker.procs.add(proc)
            capture = _Capture(self.limits.max_output_bytes)
            try:
                stopped, detail = self._pump(proc, capture, start + timeout, timeout)
            finally:
                self._reap(proc)
            return self._result(proc.returncode, capture, stopped, detail, start)

    def _pump(
        self, proc: subprocess.Popen, capture: _Capture, deadline: float, timeout: float
    ) -> tuple[str | None, str]:
        """Read output until EOF, the deadline, a quota breach or :meth:`close`."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        poller = select.poll()  # not select.select: fds above 1024 are fine
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        interval = self.limits.poll_interval_s
        next_check = time.monotonic() + interval
        exited_at: float | None = None
        while True:
            now = time.monotonic()
            if now >= deadline:
                return "timeout", (
                    f"stopped after the {timeout:g} s wall-clock limit; "
                    "all its processes were killed"
                )
            if poller.poll(max(0.0, min(deadline - now, 0.05)) * 1000):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None, ""
                capture.add(chunk)
            # The code finished but a background process still holds the pipe: keep what
            # is already written (a short grace) and let _reap kill the rest.
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.1:
                return None, ""
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + interval
                if self.tracker.closed:
                    return "closed", "stopped because the workspace was closed"
                breach = self._quota_breach()
                if breach:
                    return "quota", breach

    def _quota_breach(self) -> str:
        if self.quota is None:
            return ""
        max_entries, max_bytes = self.quota
        used = usage(self.workdir, max_entries, max_bytes)
        if not used.over:
            return ""
        return (
            f"stopped because the workspace went over its quota (at least {used.entries} "
            f"entries / {used.bytes} bytes; limits {max_entries} entries, {max_bytes} bytes); "
            "delete files to get back under it"
        )

    def _reap(self, proc: subprocess.Popen) -> None:
        """Kill whatever the run left running, then wait for it to be gone."""
        if proc.poll() is None and self.uid is not None and self.mode == "rlimit":
            proc.send_signal(signal.SIGTERM)  # the guard sweeps and reaps the uid's processes
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        if self.uid is not None:
            _procs.kill_uid(self.backend.python, self.uid)
        elif self.mode == "rlimit":
            _procs.kill_session(proc.pid)
        _procs.kill_group(proc.pid)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            proc.kill()
            proc.wait()
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
            with self.tracker.lock:
                self.tracker.procs.discard(proc)
        if self.mode == "bwrap":  # the pid namespace dies with its init; wait until it has
            _procs.wait_gone(proc.pid)

    def _result(
        self,
        code: int | None,
        capture: _Capture,
        stopped: str | None,
        detail: str,
        start: float,
    ) -> RunResult:
        sig: str | None = None
        if stopped is None and code is not None:
            if code < 0:
                sig = _signal_name(-code)
            elif code > 128 and (self.mode == "bwrap" or self._guarded):
                sig = _signal_name(code - 128)  # bwrap and the guard report 128 + signal
            if sig is not None:
                detail = f"ended by {sig}: {_SIGNAL_HINTS.get(sig, 'killed by a signal')}"
        return RunResult(
            output=capture.text(),
            exit_code=None if (sig or stopped) else code,
            signal=sig,
            stopped=stopped,
            detail=detail,
            output_bytes=capture.total,
            elapsed_s=time.monotonic() - start,
        )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# ---- which backend this machine can run ---------------------------------------------
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
