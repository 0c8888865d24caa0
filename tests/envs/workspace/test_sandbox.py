"""The sandbox on its own, in each mode: limits, isolation, cleanup, output capture."""

import os
import time

import pytest

from agentenv.errors import InvalidOptionError
from envs.workspace import (
    Backend,
    FileLimits,
    Sandbox,
    SandboxLimits,
    SandboxUnavailableError,
    Workspace,
    _procs,
    detect_backend,
)
from envs.workspace.backend import SANDBOX_HOME


@pytest.fixture
def ws(mode, make_workspace):
    return make_workspace(mode, {"hello.txt": "hi\n"})


def test_runs_code_in_the_workspace_with_a_minimal_environment(ws, monkeypatch):
    monkeypatch.setenv("AGENTENV_TEST_SECRET", "hunter2-do-not-leak")
    result = ws.run_python(
        "import os, sys\nprint(open('hello.txt').read().strip())\n"
        "print(sorted(os.environ))\nprint(os.getcwd())\nprint(sys.flags.isolated)"
    )
    assert result.ok, result
    lines = result.output.splitlines()
    assert lines[0] == "hi"
    assert "AGENTENV_TEST_SECRET" not in result.output and "hunter2" not in result.output
    assert set(eval(lines[1])) <= {  # noqa: S307 - our own test output
        "PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PWD", "PYTHONDONTWRITEBYTECODE",
        "PYTHONIOENCODING", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    }  # fmt: skip
    assert lines[2] == (SANDBOX_HOME if ws.mode == "bwrap" else ws.root)
    assert lines[3] == "1"  # python -I


def test_host_secrets_are_out_of_reach(ws, monkeypatch):
    monkeypatch.setenv("AGENTENV_TEST_SECRET", "hunter2-do-not-leak")
    code = (
        "import os\n"
        f"for path in ['/proc/{os.getpid()}/environ', '/proc/1/environ', '/root/.bashrc']:\n"
        "    try:\n"
        "        data = open(path, 'rb').read()\n"
        "        print(path, 'READ', b'hunter2' in data)\n"
        "    except OSError as exc:\n"
        "        print(path, type(exc).__name__)\n"
    )
    result = ws.run_python(code)
    assert result.ok and "hunter2" not in result.output
    assert "READ True" not in result.output
    if ws.uid is not None:  # a private unprivileged uid cannot read root's files
        assert "READ" not in result.output, result.output


def test_exit_codes_and_tracebacks(ws):
    result = ws.run_python("1/0")
    assert result.exit_code == 1 and not result.ok
    assert 'File "<code>", line 1' in result.output and "ZeroDivisionError" in result.output
    assert "_boot" not in result.output and "_run_python" not in result.output
    assert ws.run_python("import sys; sys.exit(3)").exit_code == 3
    syntax = ws.run_python("def (")
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.output
    shell = ws.run_shell("echo out; echo err >&2; exit 4")
    assert shell.exit_code == 4 and "out" in shell.output and "err" in shell.output
    missing = ws.run_shell("no-such-program-xyz")
    assert missing.exit_code == 127 and "not found" in missing.output


def test_python_and_shell_see_the_same_files(ws):
    assert ws.run_python("open('made.txt', 'w').write('x')").ok
    assert (
        ws.run_shell("cat made.txt && python -c 'import sys; print(sys.version_info[0])'").output
        == "x3\n"
    )
    assert ws.read_file("made.txt") == "x"


def test_wall_clock_timeout_kills_the_run(ws):
    start = time.monotonic()
    result = ws.run_python("print('start', flush=True)\nwhile True: pass")
    assert result.stopped == "timeout" and result.exit_code is None
    assert "2 s wall-clock limit" in result.detail and result.output == "start\n"
    assert time.monotonic() - start < 6
    assert ws.run_python("print('alive')").output == "alive\n"


def test_cpu_limit(mode, make_workspace):
    limits = SandboxLimits(timeout_s=15, cpu_s=1, memory_bytes=256 << 20)
    result = make_workspace(mode, limits=limits).run_python("while True: pass")
    assert result.signal in ("SIGXCPU", "SIGKILL") and result.stopped is None
    assert "CPU time limit" in result.detail or "killed" in result.detail


def test_memory_bomb_gets_memory_error(ws):
    result = ws.run_python("a = []\nwhile True: a.append(bytearray(10**7))")
    assert result.exit_code == 1 and "MemoryError" in result.output
    assert ws.run_python("x = bytearray(10**10)").output.strip().endswith("MemoryError")


def test_file_size_limit(ws):
    result = ws.run_python(
        "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)"
    )
    assert result.exit_code == 1 and "File too large" in result.output
    assert os.path.getsize(os.path.join(ws.root, "big")) <= ws.sandbox.limits.file_size_bytes
    shell = ws.run_shell("head -c 1073741824 /dev/zero > big2")
    assert not shell.ok
    assert os.path.getsize(os.path.join(ws.root, "big2")) <= ws.sandbox.limits.file_size_bytes


def test_fork_bomb_is_contained(ws, children):
    before = len(children())
    result = ws.run_python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    assert result.stopped == "timeout"
    simple = ws.run_python("import os\nwhile True: os.fork()")
    assert "BlockingIOError" in simple.output or simple.stopped == "timeout"
    assert len(children()) == before
    if ws.uid is not None:
        assert _procs.live_pids_of_uid(ws.uid) == []
    assert ws.run_python("print('still works')").output == "still works\n"


def test_killing_the_parent_does_not_reach_the_host(ws):
    result = ws.run_python("import os\nos.kill(os.getppid(), 9)\nprint('after')")
    assert not result.ok
    assert ws.run_python("print('host fine')").output == "host fine\n"


def test_background_processes_do_not_outlive_the_call(ws, children):
    code = (
        "import subprocess, os\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        "os.system('sleep 61 &')\n"
        "if os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(62)\n"
        "print('started', p.pid)\n"
    )
    result = ws.run_python(code)
    assert result.ok and result.output.startswith("started")
    assert result.stopped is None  # returned when the code ended, not at the time limit
    if ws.uid is not None:
        assert _procs.live_pids_of_uid(ws.uid) == []
    assert not children()


def test_output_is_capped_head_and_tail(ws):
    start = time.monotonic()
    result = ws.run_python("print('HEAD' + 'x' * 10_000_000 + 'TAIL')")
    assert result.ok and time.monotonic() - start < 5
    assert result.output_bytes == 10_000_009
    assert len(result.output) < ws.sandbox.limits.max_output_bytes + 100
    assert result.output.startswith("HEAD") and result.output.rstrip().endswith("TAIL")
    assert "bytes of output truncated" in result.output


def test_quota_stops_a_run_that_floods_the_workspace(mode, make_workspace):
    box = make_workspace(
        mode,
        limits=SandboxLimits(timeout_s=10, poll_interval_s=0.05, memory_bytes=256 << 20),
        file_limits=FileLimits(max_files=200),
    )
    result = box.run_python("i = 0\nwhile True:\n    open(f'f{i}', 'w').close()\n    i += 1")
    assert result.stopped == "quota" and "quota" in result.detail
    assert result.elapsed_s < 5


def test_network_and_filesystem_isolation_in_bwrap(make_workspace):
    box = make_workspace("bwrap")
    if True:
        code = (
            "import os, socket\n"
            "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
            "    print('NET OPEN')\nexcept OSError as exc:\n    print('net', exc.errno)\n"
            "print(sorted(os.listdir('/')))\n"
            "print(os.path.exists('/etc/passwd'), os.path.exists('/home'))\n"
            "try:\n    open('/usr/escape', 'w')\n"
            "except OSError as exc:\n    print('ro', exc.errno)\n"
        )
        result = box.run_python(code)
        assert result.ok and "NET OPEN" not in result.output
        assert "['bin', 'dev', 'lib'" in result.output or "'workspace'" in result.output
        assert "False False" in result.output and "ro 30" in result.output


def test_close_kills_a_running_call(mode, make_workspace):
    import threading

    box = make_workspace(mode, limits=SandboxLimits(timeout_s=30))
    results = []

    def sleeper() -> None:
        results.append(box.run_python("import time; time.sleep(30)"))

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    box.close()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert results[0].stopped in ("closed", None) and not results[0].ok
    assert not os.path.exists(box.path)


def test_closed_workspace_refuses_work(mode, make_workspace):
    box = make_workspace(mode)
    box.close()
    box.close()  # idempotent
    from envs.workspace import SandboxError

    with pytest.raises(SandboxError, match="closed"):
        box.run_python("print(1)")
    with pytest.raises(SandboxError, match="closed"):
        box.read_file("x")


def test_garbage_collection_removes_the_workspace(mode):
    import gc

    box = Workspace({"a.txt": "x"}, backend=detect_backend(mode))
    path = box.path
    assert os.path.isdir(path)
    del box
    gc.collect()
    assert not os.path.exists(path)


def test_interpreter_exit_removes_the_workspace(mode):
    import subprocess
    import sys

    script = (
        "import sys\nfrom envs.workspace import Workspace, detect_backend\n"
        f"ws = Workspace({{'a.txt': 'x'}}, backend=detect_backend({mode!r}))\n"
        "print(ws.path, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(out.stdout.strip())


def test_detect_backend_modes():
    assert detect_backend("rlimit").mode == "rlimit"
    with pytest.raises(InvalidOptionError, match="sandbox must be one of"):
        detect_backend("docker")
    try:
        assert detect_backend("bwrap").mode == "bwrap"
    except SandboxUnavailableError as exc:
        assert "bubblewrap" in str(exc) or "bwrap" in str(exc)


def test_auto_falls_back_to_rlimit_with_a_warning(monkeypatch):
    from envs.workspace import sandbox as backend_module

    real_which = backend_module.shutil.which

    def which(name, path=None):
        return None if name == "bwrap" else real_which(name, path=path)

    monkeypatch.setattr(backend_module.shutil, "which", which)
    backend_module.detect_backend.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="rlimit sandbox"):
            chosen = backend_module.detect_backend("auto")
        assert chosen.mode == "rlimit" and "apt-get install -y bubblewrap" in chosen.note
        with pytest.raises(SandboxUnavailableError, match="bwrap"):
            backend_module.detect_backend("bwrap")
    finally:
        backend_module.detect_backend.cache_clear()


def test_limits_validate_with_clear_messages(tmp_path):
    with pytest.raises(InvalidOptionError, match="timeout_s must be > 0"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(InvalidOptionError, match="too small for Python"):
        SandboxLimits(memory_bytes=1 << 20)
    with pytest.raises(InvalidOptionError, match="max_processes"):
        SandboxLimits(max_processes=0)
    root_backend = Backend("rlimit", "/usr/bin/python3", True)
    with pytest.raises(InvalidOptionError, match="pass uid"):
        Sandbox(str(tmp_path), backend=root_backend)


def test_rlimit_mode_without_a_private_uid(make_workspace, children):
    """What a non-root host gets (no uid switch): the guard parent and session cleanup.

    Run here with a forced backend; nothing that relies on RLIMIT_NPROC is tried, since
    root ignores it.
    """
    import sys

    shared = Backend("rlimit", os.path.realpath(sys.executable), False)
    box = Workspace(backend=shared, limits=SandboxLimits(timeout_s=2))
    try:
        assert box.uid is None and box.run_python("print(6 * 7)").output == "42\n"
        parent = box.run_python(f"import os\nprint(os.getppid() != {os.getpid()})")
        assert parent.output == "True\n"  # the code's parent is the guard, not the host
        bg = box.run_python("import subprocess\nsubprocess.Popen(['sleep', '60'])\nprint('bg')")
        assert bg.ok and bg.stopped is None and not children()
        assert box.run_python("while True: pass").stopped == "timeout" and not children()
        shell = box.run_shell("sleep 60 & echo $$")
        assert shell.ok and not children()
    finally:
        box.close()
