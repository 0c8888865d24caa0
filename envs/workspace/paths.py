"""Safe file access inside a workspace directory, done by the host process.

Every path the agent gives is resolved against the workspace root and must stay
inside it: absolute paths, ``..`` and symbolic links that resolve outside are
refused with a :class:`~envs.workspace.errors.PathError` that names the path and
the fix. Files are opened with ``O_NOFOLLOW`` (after resolution) and must be
regular files with a single hard link, so a link planted by sandboxed code can
never make the host read or overwrite a file outside the workspace. Sizes and
counts are capped by :class:`FileLimits`.

The host never runs these functions while sandboxed code is running in the same
workspace (the :class:`~envs.workspace.workspace.Workspace` serialises them), so
there is no window for a check-then-use race.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from dataclasses import dataclass

from agentenv.errors import InvalidOptionError, ToolArgumentError
from envs.workspace.errors import PathError, WorkspaceLimitError

MAX_PATH_CHARS = 1024
_BINARY_SNIFF = 8192


@dataclass(frozen=True)
class FileLimits:
    """Caps on the files of one workspace.

    Attributes:
        max_file_bytes: Largest file ``write_file`` writes and ``read_file`` reads.
        max_files: Most entries (files, directories, links) the workspace may hold.
        max_workspace_bytes: Most bytes of regular files in the workspace, in total.
        max_list_entries: Most entries ``list_files`` shows.
    """

    max_file_bytes: int = 1 << 20
    max_files: int = 1000
    max_workspace_bytes: int = 64 << 20
    max_list_entries: int = 200

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_files", "max_workspace_bytes", "max_list_entries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidOptionError(f"FileLimits.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class Usage:
    """Size of a workspace: entries, bytes of regular files, and whether a cap was passed."""

    entries: int
    bytes: int
    over: bool = False


def resolve_path(root: str, path: str) -> str:
    """The real absolute path of ``path`` (relative to ``root``), refusing anything outside.

    Args:
        root: The workspace root; must already be a real path (``os.path.realpath``).
        path: What the agent wrote, e.g. ``"data/sales.csv"``; ``""`` means the root.

    Raises:
        PathError: for absolute paths, ``~``, ``..``, NUL bytes, lone surrogates, over-long
            paths and paths (through symbolic links) that resolve outside ``root``.
    """
    if not isinstance(path, str):
        raise PathError(f"path must be a string, got {type(path).__name__}")
    hint = "use a path relative to the workspace root, e.g. 'notes.txt' or 'src/app.py'"
    if "\x00" in path:
        raise PathError(f"path {path[:80]!r} contains a NUL byte; {hint}")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape such as "\ud800"
        raise PathError(f"path {path[:80]!r} is not valid text; {hint}") from None
    if len(path) > MAX_PATH_CHARS:
        raise PathError(f"path is {len(path)} characters long (limit {MAX_PATH_CHARS}); {hint}")
    if os.path.isabs(path):
        raise PathError(f"absolute paths are not allowed: {path!r}; {hint}")
    if path.startswith("~"):
        raise PathError(f"'~' is not expanded in {path!r}; {hint}")
    if ".." in path.split("/"):
        raise PathError(
            f"'..' is not allowed in paths: {path!r}; the workspace root is the top level, {hint}"
        )
    real = os.path.realpath(os.path.join(root, path))
    if real != root and os.path.commonpath([root, real]) != root:
        raise PathError(
            f"{path!r} resolves outside the workspace (a symbolic link points to {real!r}); "
            "only files inside the workspace can be used"
        )
    return real


def _rel(root: str, real: str) -> str:
    return "." if real == root else os.path.relpath(real, root)


def _lstat_or_none(real: str, path: str) -> os.stat_result | None:
    try:
        return os.lstat(real)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise PathError(f"cannot use {path!r}: part of it is a file, not a folder") from None
    except OSError as exc:  # ELOOP, ENAMETOOLONG
        raise PathError(f"cannot use {path!r}: {exc.strerror}") from None


def _check_regular(path: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise PathError(f"{path!r} is a directory, not a file; use list_files to see inside it")
    if not stat.S_ISREG(st.st_mode):
        raise PathError(f"{path!r} is not a regular file (a fifo, socket or device); refused")
    if st.st_nlink > 1:
        raise PathError(
            f"{path!r} has {st.st_nlink} hard links; hard-linked files are refused because a "
            "link can point at a file outside the workspace; copy the file instead"
        )


def read_text(
    root: str,
    path: str,
    limits: FileLimits,
    start_line: int | None = None,
    end_line: int | None = None,
) -> str:
    """Text of a workspace file, optionally only lines ``start_line..end_line`` (1-based).

    Binary files are described rather than shown; files over ``max_file_bytes`` are
    read up to the cap with a note.

    Raises:
        PathError: the path is refused, missing, a directory or not a regular file.
        ToolArgumentError: the line range is invalid.
    """
    for name, value in (("start_line", start_line), ("end_line", end_line)):
        if value is not None and value < 1:
            raise ToolArgumentError(f"{name} must be >= 1 (lines are numbered from 1), got {value}")
    if start_line is not None and end_line is not None and end_line < start_line:
        raise ToolArgumentError(f"end_line ({end_line}) is before start_line ({start_line})")
    data, size = read_bytes(root, path, limits)
    if b"\x00" in data[:_BINARY_SNIFF]:
        return f"(binary file, {size} bytes; not shown)"
    note = ""
    if size > len(data):
        note = f"\n[file is {size} bytes; only the first {len(data)} were read]"
    text = data.decode("utf-8", errors="replace")
    if start_line is not None or end_line is not None:
        lines = text.splitlines(keepends=True)
        first = (start_line or 1) - 1
        if first >= len(lines) and lines:
            raise ToolArgumentError(
                f"start_line {start_line} is past the end of {path!r} ({len(lines)} lines)"
            )
        text = "".join(lines[first : end_line if end_line is not None else None])
    return (text + note) if text else "(empty file)"


def read_bytes(root: str, path: str, limits: FileLimits) -> tuple[bytes, int]:
    """The first ``limits.max_file_bytes`` bytes of a regular file, and its full size.

    Raises:
        PathError: the path is refused, missing, a directory, not a regular file, or
            hard-linked.
    """
    real = resolve_path(root, path)
    st = _lstat_or_none(real, path)
    if st is None:
        raise PathError(f"no such file: {path!r}; use list_files to see what exists")
    _check_regular(path, st)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        _check_regular(path, st)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limits.max_file_bytes)
    finally:
        os.close(fd)
    return data, st.st_size


def write_text(
    root: str,
    path: str,
    content: str,
    limits: FileLimits,
    owner: tuple[int, int] | None = None,
) -> str:
    """Create or overwrite a workspace file with ``content`` (UTF-8); parents are created.

    Args:
        root: The workspace root (a real path).
        path: Relative file path.
        content: The new text of the file.
        limits: Size and count caps.
        owner: ``(uid, gid)`` to give new files and directories (the sandbox user).

    Returns:
        A one-line confirmation.

    Raises:
        PathError: the path is refused, names a directory or goes through a file.
        WorkspaceLimitError: the content or the workspace would exceed its caps.
        ToolArgumentError: the content is not encodable text.
    """
    try:
        data = content.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ToolArgumentError(f"content is not valid text ({exc.reason}); send UTF-8") from None
    if len(data) > limits.max_file_bytes:
        raise WorkspaceLimitError(
            f"content is {len(data)} bytes; the limit is {limits.max_file_bytes} bytes per "
            "file; write smaller files"
        )
    real = resolve_path(root, path)
    if real == root or path.endswith("/"):
        raise PathError(f"path must name a file, got {path!r}")
    st = _lstat_or_none(real, path)
    if st is not None:
        _check_regular(path, st)
    used = usage(root)
    if st is None and used.entries >= limits.max_files:
        raise WorkspaceLimitError(
            f"the workspace already holds {used.entries} entries (limit {limits.max_files}); "
            "delete files before creating new ones"
        )
    new_total = used.bytes - (st.st_size if st else 0) + len(data)
    if new_total > limits.max_workspace_bytes:
        raise WorkspaceLimitError(
            f"writing {len(data)} bytes would bring the workspace to {new_total} bytes "
            f"(limit {limits.max_workspace_bytes}); delete files first"
        )
    _make_parents(root, os.path.dirname(real), path, owner)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(real, flags, 0o644)
    try:
        _check_regular(path, os.fstat(fd))
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if owner is not None:
            os.fchown(fd, *owner)
    finally:
        os.close(fd)
    return f"wrote {len(data)} bytes to {_rel(root, real)}"


def _make_parents(root: str, parent: str, path: str, owner: tuple[int, int] | None) -> None:
    missing: list[str] = []
    while parent != root and not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise PathError(f"cannot create {path!r}: {_rel(root, parent)!r} is a file, not a folder")
    for d in reversed(missing):
        os.mkdir(d, 0o755)
        if owner is not None:
            os.chown(d, *owner, follow_symlinks=False)


def list_tree(root: str, path: str, limits: FileLimits) -> str:
    """A recursive listing of ``path``: ``dir/``, ``file (N bytes)``, ``link -> target``."""
    real = resolve_path(root, path)
    st = _lstat_or_none(real, path)
    if st is None:
        raise PathError(f"no such file or folder: {path!r}; try list_files with path '.'")
    if not stat.S_ISDIR(st.st_mode):
        return f"{_rel(root, real)} ({st.st_size} bytes)"
    lines: list[str] = []
    hidden = 0
    stack = [real]
    while stack:  # each folder's entries first, then its sub-folders, in name order
        current = stack.pop()
        try:
            entries = sorted(os.scandir(current), key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for entry in entries:
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_dir:
                subdirs.append(entry.path)
            if len(lines) >= limits.max_list_entries:
                hidden += 1
                continue
            rel = os.path.relpath(entry.path, real)
            if entry.is_symlink():
                lines.append(f"{rel} -> {os.readlink(entry.path)}")
            elif is_dir:
                lines.append(f"{rel}/")
            else:
                lines.append(f"{rel} ({entry.stat(follow_symlinks=False).st_size} bytes)")
        stack.extend(reversed(subdirs))
    if not lines:
        return "(empty folder)"
    lines.sort()
    if hidden:
        lines.append(f"[... {hidden} more entries not shown; list a sub-folder]")
    return "\n".join(lines)


def usage(root: str, max_entries: int | None = None, max_bytes: int | None = None) -> Usage:
    """Entries and bytes under ``root`` (links not followed); stops early past a cap."""
    entries = total = 0
    stack = [root]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for entry in it:
                entries += 1
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
                if (max_entries is not None and entries > max_entries) or (
                    max_bytes is not None and total > max_bytes
                ):
                    return Usage(entries, total, over=True)
    return Usage(entries, total)


def remove_tree(path: str) -> None:
    """Delete ``path`` and everything under it, whatever the sandboxed code did to it.

    Handles folders made unwritable (``chmod 000``) and trees too deep for
    :func:`shutil.rmtree`'s recursion, falling back to ``rm -rf``. Never raises for a
    missing path.
    """
    if not os.path.lexists(path):
        return
    try:
        shutil.rmtree(path)
        return
    except (OSError, RecursionError):
        pass
    try:
        os.chmod(path, 0o700, follow_symlinks=False)
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o700, follow_symlinks=False)
        shutil.rmtree(path)
    except (OSError, RecursionError):
        subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", path],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
