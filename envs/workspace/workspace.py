"""One episode's private directory and its sandbox.

Layout of a workspace (``tempfile.mkdtemp(prefix="agentenv-ws-")``)::

    agentenv-ws-XXXXXXXX/   mode 0711, owned by the host user
        work/               the workspace: the agent's files, cwd of its code
                            (owned by the sandbox's private uid when the host is root)
        bin/                python / python3 links put first on the sandbox PATH

:class:`Workspace` serialises every file operation with the sandbox's runs (one lock),
so host-side path checks never race sandboxed code. :meth:`Workspace.close` kills
everything still running and deletes the directory; a ``weakref.finalize`` does the
same at garbage collection and at interpreter exit.
"""

from __future__ import annotations

import os
import tempfile
import threading
import weakref
from collections.abc import Mapping

from agentenv.errors import ToolArgumentError, ToolError
from envs.workspace import paths
from envs.workspace.backend import Backend, allocate_uid
from envs.workspace.errors import SandboxError, WorkspaceLimitError
from envs.workspace.paths import FileLimits
from envs.workspace.sandbox import ProcessTracker, RunResult, Sandbox, SandboxLimits, detect_backend

PREFIX = "agentenv-ws-"
_SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


class Workspace:
    """A fresh private directory holding ``files``, with a :class:`Sandbox` bound to it.

    Args:
        files: Initial files, ``{relative path: text}``.
        backend: Sandbox backend (default: ``detect_backend("auto")``).
        limits: Limits of each sandboxed run.
        file_limits: Caps on file sizes and counts.
        site_packages: Let sandboxed code import the interpreter's site-packages.
    """

    def __init__(
        self,
        files: Mapping[str, str] | None = None,
        *,
        backend: Backend | None = None,
        limits: SandboxLimits | None = None,
        file_limits: FileLimits | None = None,
        site_packages: bool = False,
    ):
        backend = backend or detect_backend("auto")
        self.file_limits = file_limits or FileLimits()
        self.uid = allocate_uid() if backend.drop_privileges else None
        self.path = tempfile.mkdtemp(prefix=PREFIX)
        tracker = ProcessTracker(backend.python, self.uid)
        scratch_uid = self.uid if backend.mode == "rlimit" else None  # bwrap: no shared /tmp
        # The finalizer holds what it needs, never ``self``: it runs at close(), at garbage
        # collection and at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _cleanup, tracker, self.path, scratch_uid)
        self.root = os.path.join(os.path.realpath(self.path), "work")
        bin_dir = os.path.join(self.path, "bin")
        try:
            self._populate(backend, bin_dir, files or {})
        except BaseException:
            self._finalizer()
            raise
        self.sandbox = Sandbox(
            self.root,
            limits=limits,
            backend=backend,
            uid=self.uid,
            quota=(self.file_limits.max_files, self.file_limits.max_workspace_bytes),
            site_packages=site_packages,
            bin_dir=bin_dir,
            tracker=tracker,
        )

    def _populate(self, backend: Backend, bin_dir: str, files: Mapping[str, str]) -> None:
        os.mkdir(self.root, 0o700)
        os.mkdir(bin_dir, 0o755)
        for name in ("python", "python3"):
            os.symlink(backend.python, os.path.join(bin_dir, name))
        os.chmod(self.path, 0o711)  # the sandbox uid may pass through, not list
        if self.uid is not None:
            os.chown(self.root, self.uid, self.uid)
        owner = (self.uid, self.uid) if self.uid is not None else None
        for rel, text in files.items():
            paths.write_text(self.root, rel, text, self.file_limits, owner)

    @property
    def mode(self) -> str:
        """The sandbox mode: ``"bwrap"`` or ``"rlimit"``."""
        return self.sandbox.mode

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` (or the finalizer) has run."""
        return not self._finalizer.alive

    # ---- the agent's tools --------------------------------------------------------------
    def list_files(self, path: str = ".") -> str:
        """Recursive listing of ``path`` (see :func:`~envs.workspace.paths.list_tree`)."""
        with self._open():
            return paths.list_tree(self.root, path, self.file_limits)

    def read_file(
        self, path: str, start_line: int | None = None, end_line: int | None = None
    ) -> str:
        """Text of a file, optionally a 1-based inclusive line range."""
        with self._open():
            return paths.read_text(self.root, path, self.file_limits, start_line, end_line)

    def write_file(self, path: str, content: str) -> str:
        """Create or overwrite a file; returns a one-line confirmation."""
        owner = (self.uid, self.uid) if self.uid is not None else None
        with self._open():
            return paths.write_text(self.root, path, content, self.file_limits, owner)

    def run_python(self, code: str, timeout_s: float | None = None) -> RunResult:
        """Run Python ``code`` in the sandbox (cwd = the workspace)."""
        self._check_open()
        _check_program(code, "code", "write it to a file and run it with run('python file.py')")
        return self.sandbox.run_python(code, timeout_s=timeout_s)

    def run_shell(self, command: str, timeout_s: float | None = None) -> RunResult:
        """Run ``sh -c command`` in the sandbox (cwd = the workspace)."""
        self._check_open()
        _check_program(command, "command", "write a script file and run that")
        return self.sandbox.run_command(["sh", "-c", command], timeout_s=timeout_s)

    # ---- for checkers ---------------------------------------------------------------------
    def text(self, path: str) -> str | None:
        """Full text of a regular file, or ``None`` if it is missing, refused or too big."""
        try:
            with self._open():
                data, size = paths.read_bytes(self.root, path, self.file_limits)
        except (ToolError, OSError):
            return None
        return data.decode("utf-8", errors="replace") if size == len(data) else None

    def file_names(self) -> list[str]:
        """Relative paths of every regular file (links not followed), sorted."""
        found = []
        with self._open():
            stack = [self.root]
            while stack:  # iterative: a deep tree made by the agent cannot recurse us out
                try:
                    entries = list(os.scandir(stack.pop()))
                except OSError:
                    continue
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        found.append(os.path.relpath(entry.path, self.root))
        return sorted(found)

    def close(self) -> None:
        """Kill everything still running in the workspace and delete it. Idempotent."""
        self._finalizer()

    # ---- internals ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError("this workspace is closed; call reset() to start a new episode")

    def _open(self) -> threading.RLock:
        """The workspace lock (file operations never overlap a run), once it is open."""
        self._check_open()
        return self.sandbox.lock


MAX_PROGRAM_BYTES = 100_000  # below Linux's 128 KiB limit on one command-line argument


def _check_program(text: str, what: str, fix: str) -> None:
    if "\x00" in text:
        raise ToolArgumentError(f"the {what} contains a NUL byte; remove it")
    try:
        size = len(os.fsencode(text))  # what the command line of the sandbox gets
    except UnicodeEncodeError as exc:  # a lone surrogate from a JSON escape such as "\ud800"
        msg = f"the {what} is not valid text ({exc.reason}); send UTF-8"
        raise ToolArgumentError(msg) from None
    if size > MAX_PROGRAM_BYTES:
        raise WorkspaceLimitError(
            f"the {what} is {size} bytes; the limit is {MAX_PROGRAM_BYTES}; {fix}"
        )


def _cleanup(tracker: ProcessTracker, path: str, scratch_uid: int | None) -> None:
    """Kill the workspace's processes, then delete its directory and stray files."""
    with tracker.lock:
        tracker.closed = True
    tracker.kill_all()
    paths.remove_tree(path)
    if scratch_uid is not None:
        _remove_files_of_uid(scratch_uid)


def _remove_files_of_uid(uid: int) -> None:
    """Delete what the sandbox uid left in world-writable scratch folders (rlimit mode)."""
    for folder in _SCRATCH_DIRS:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    if entry.is_dir(follow_symlinks=False):
                        paths.remove_tree(entry.path)
                    else:
                        os.unlink(entry.path)
            except OSError:
                continue
