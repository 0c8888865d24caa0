import os

import pytest

from agentenv.errors import InvalidOptionError, ToolArgumentError
from envs.workspace import FileLimits, PathError, WorkspaceLimitError, paths, resolve_path

LIMITS = FileLimits(max_file_bytes=1000, max_files=10, max_workspace_bytes=3000)


@pytest.fixture
def root(tmp_path):
    ws = tmp_path / "work"
    ws.mkdir()
    (ws / "a.txt").write_text("one\ntwo\nthree\n")
    (ws / "sub").mkdir()
    (ws / "sub" / "b.txt").write_text("bee")
    return os.path.realpath(ws)


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("../../etc/passwd", "'..' is not allowed"),
        ("sub/../../x", "'..' is not allowed"),
        ("/etc/passwd", "absolute paths are not allowed"),
        ("~/.ssh/id_rsa", "'~' is not expanded"),
        ("a\x00b", "NUL byte"),
        ("x" * 2000, "characters long"),
    ],
)
def test_bad_paths_are_refused_with_the_fix(root, path, match):
    with pytest.raises(PathError, match=match) as info:
        resolve_path(root, path)
    assert "relative to the workspace" in str(info.value) or "limit" in str(info.value)
    assert info.value.kind == "path"


def test_symlinks_pointing_outside_are_refused(root):
    os.symlink("/", os.path.join(root, "slash"))
    os.symlink("/etc/passwd", os.path.join(root, "pw"))
    os.symlink("a.txt", os.path.join(root, "inside"))
    for path in ("slash", "slash/etc/passwd", "pw"):
        with pytest.raises(PathError, match="resolves outside the workspace"):
            resolve_path(root, path)
    assert resolve_path(root, "inside") == os.path.join(root, "a.txt")
    assert paths.read_text(root, "inside", LIMITS) == "one\ntwo\nthree\n"
    with pytest.raises(PathError, match="outside"):
        paths.write_text(root, "pw", "pwned", LIMITS)
    with pytest.raises(PathError, match="outside"):
        paths.list_tree(root, "slash", LIMITS)
    assert "slash -> /" in paths.list_tree(root, ".", LIMITS)


def test_read_text_lines_and_errors(root):
    assert paths.read_text(root, "a.txt", LIMITS, start_line=2) == "two\nthree\n"
    assert paths.read_text(root, "a.txt", LIMITS, 2, 2) == "two\n"
    with pytest.raises(ToolArgumentError, match="past the end"):
        paths.read_text(root, "a.txt", LIMITS, start_line=9)
    with pytest.raises(ToolArgumentError, match=">= 1"):
        paths.read_text(root, "a.txt", LIMITS, start_line=0)
    with pytest.raises(ToolArgumentError, match="before start_line"):
        paths.read_text(root, "a.txt", LIMITS, 3, 1)
    with pytest.raises(PathError, match="no such file"):
        paths.read_text(root, "missing.txt", LIMITS)
    with pytest.raises(PathError, match="is a directory"):
        paths.read_text(root, "sub", LIMITS)
    with pytest.raises(PathError, match="is a file, not a folder"):
        paths.read_text(root, "a.txt/x", LIMITS)


def test_special_files_and_hard_links_are_refused(root):
    os.mkfifo(os.path.join(root, "fifo"))
    with pytest.raises(PathError, match="not a regular file"):
        paths.read_text(root, "fifo", LIMITS)  # would block forever if opened
    os.link(os.path.join(root, "a.txt"), os.path.join(root, "hard"))
    with pytest.raises(PathError, match="hard links"):
        paths.read_text(root, "hard", LIMITS)
    with pytest.raises(PathError, match="hard links"):
        paths.write_text(root, "hard", "x", LIMITS)


def test_binary_and_oversized_files(root):
    with open(os.path.join(root, "bin.dat"), "wb") as f:
        f.write(b"\x00\x01" * 10)
    assert paths.read_text(root, "bin.dat", LIMITS) == "(binary file, 20 bytes; not shown)"
    with open(os.path.join(root, "big.txt"), "w") as f:
        f.write("y" * 1500)
    text = paths.read_text(root, "big.txt", LIMITS)
    assert text.startswith("y" * 1000) and "only the first 1000 were read" in text


def test_write_text_creates_parents_and_enforces_caps(root):
    assert (
        paths.write_text(root, "new/deep/c.txt", "hi", LIMITS) == "wrote 2 bytes to new/deep/c.txt"
    )
    assert open(os.path.join(root, "new/deep/c.txt")).read() == "hi"
    with pytest.raises(WorkspaceLimitError, match="limit is 1000 bytes per file"):
        paths.write_text(root, "big.txt", "z" * 1001, LIMITS)
    with pytest.raises(PathError, match="is a file, not a folder"):
        paths.write_text(root, "a.txt/inner.txt", "x", LIMITS)
    with pytest.raises(PathError, match="is a file, not a folder"):
        paths.write_text(root, "a.txt/more/inner.txt", "x", LIMITS)
    with pytest.raises(PathError, match="must name a file"):
        paths.write_text(root, ".", "x", LIMITS)
    with pytest.raises(PathError, match="is a directory"):
        paths.write_text(root, "sub", "x", LIMITS)
    for i in range(3):
        paths.write_text(root, f"f{i}.txt", "x" * 900, LIMITS)
    with pytest.raises(WorkspaceLimitError, match="limit 3000"):
        paths.write_text(root, "f3.txt", "x" * 900, LIMITS)
    while paths.usage(root).entries < LIMITS.max_files:
        paths.write_text(root, f"n{paths.usage(root).entries}.txt", "", LIMITS)
    with pytest.raises(WorkspaceLimitError, match="already holds 10 entries"):
        paths.write_text(root, "one-too-many.txt", "", LIMITS)
    paths.write_text(root, "a.txt", "overwrite is fine at the cap", LIMITS)


def test_write_text_rejects_unencodable_content(root):
    with pytest.raises(ToolArgumentError, match="not valid text"):
        paths.write_text(root, "s.txt", "\ud800", LIMITS)


def test_list_tree_and_caps(root):
    assert paths.list_tree(root, ".", LIMITS) == "a.txt (14 bytes)\nsub/\nsub/b.txt (3 bytes)"
    assert paths.list_tree(root, "sub/b.txt", LIMITS) == "sub/b.txt (3 bytes)"
    for i in range(5):
        open(os.path.join(root, f"x{i}"), "w").close()
    small = FileLimits(max_list_entries=3)
    listing = paths.list_tree(root, ".", small)
    assert listing.count("\n") == 3 and "5 more entries not shown" in listing
    empty = os.path.join(root, "empty")
    os.mkdir(empty)
    assert paths.list_tree(root, "empty", LIMITS) == "(empty folder)"


def test_usage_stops_early():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for i in range(50):
            open(os.path.join(d, str(i)), "w").close()
        assert paths.usage(d) == paths.Usage(50, 0, False)
        assert paths.usage(d, max_entries=10).over


def test_remove_tree_handles_locked_and_deep_trees(tmp_path):
    locked = tmp_path / "locked"
    (locked / "inner").mkdir(parents=True)
    (locked / "inner" / "f").write_text("x")
    os.chmod(locked / "inner", 0)
    deep = tmp_path / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(1200):  # deeper than shutil.rmtree's recursion allows
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    for path in (locked, deep, tmp_path / "missing"):
        paths.remove_tree(str(path))
        assert not os.path.lexists(path)


def test_file_limits_validate():
    with pytest.raises(InvalidOptionError, match="max_files must be an int >= 1"):
        FileLimits(max_files=0)
