"""WorkspaceEnv: the gymnasium contract, reproducibility, isolation and hostile actions.

Every hostile action must end with a clear observation, leave the host unharmed (this
process and its other workspaces keep working) and leave nothing behind (checked by the
autouse ``no_leftovers`` fixture).
"""

import gc
import json
import os

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import agentenv
from agentenv.errors import InvalidOptionError
from envs.workspace import WorkspaceEnv, _procs


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture
def make_env(small):
    made = []

    def make(**kwargs):
        kwargs.setdefault("limits", small)
        made.append(agentenv.make("Workspace-v0", **kwargs))
        return made[-1]

    yield make
    for env in made:
        env.close()


@pytest.fixture
def env(make_env, mode):
    env = make_env(sandbox=mode, max_turns=50)
    env.reset(seed=0)
    return env


def tool_output(env, action):
    obs, reward, terminated, truncated, info = env.step(action)
    assert len(obs) == 1 and obs[0]["role"] == "tool" and not terminated
    return obs[0]["content"], info


@pytest.mark.filterwarnings("ignore:Workspace sandbox:RuntimeWarning")  # auto without bwrap
@pytest.mark.parametrize("sandbox", ["auto", "rlimit"])
def test_check_env_passes(sandbox, small):
    env = gym.make("agentenv/Workspace-v0", sandbox=sandbox, limits=small, num_tasks=16)
    try:
        check_env(env.unwrapped)
    finally:
        env.close()


def test_reset_info_and_prompt(make_env, mode):
    env = make_env(sandbox=mode)
    obs, info = env.reset(seed=3)
    assert info["sandbox"] == mode == env.sandbox_mode
    assert [m["role"] for m in obs] == ["system", "user"]
    system = obs[0]["content"]
    for name in ("list_files", "read_file", "write_file", "run_python", "run"):
        assert f'"name": "{name}"' in system
    assert "<answer>done</answer>" in system and "2 s" in system
    assert env.workspace.root not in system + obs[1]["content"]  # no host paths leak
    assert env.task.prompt == obs[1]["content"]


def test_seeds_reproduce_tasks_files_and_observations(make_env, mode):
    a, b = make_env(sandbox=mode), make_env(sandbox=mode)
    assert a.reset(seed=11)[0] == b.reset(seed=11)[0]
    assert a.workspace.root != b.workspace.root
    files = a.task.metadata["files"]
    for path, text in files.items():
        assert a.workspace.read_file(path) == b.workspace.read_file(path) == text
    actions = [
        call("list_files"),
        call("run_python", code="import os; print(sorted(os.listdir()))"),
    ]
    for action in actions:
        assert a.step(action)[0] == b.step(action)[0]
    assert a.reset(seed=1)[0] != a.reset(seed=2)[0]


def test_same_task_in_parallel_instances_gives_independent_workspaces(make_env, mode):
    group = [make_env(sandbox=mode) for _ in range(4)]
    for env in group:
        env.reset(seed=5)
    roots = {env.workspace.root for env in group}
    assert len(roots) == 4
    for i, env in enumerate(group):
        tool_output(env, call("write_file", path="mine.txt", content=f"instance {i}"))
    others = [env.workspace.root for env in group[1:]]
    spy = "\n".join(
        [
            "import os",
            f"for root in {others!r}:",
            "    try:",
            "        print(open(os.path.join(root, 'mine.txt')).read())",
            "    except OSError as exc:",
            "        print(type(exc).__name__)",
        ]
    )
    out, _ = tool_output(group[0], call("run_python", code=spy))
    assert "instance" not in out, out  # other instances' files are out of reach
    for i, env in enumerate(group):
        assert env.workspace.read_file("mine.txt") == f"instance {i}"


def test_reset_close_and_gc_remove_the_workspace(make_env, mode):
    env = make_env(sandbox=mode)
    env.reset(seed=0)
    first = env.workspace.path
    env.reset(seed=0)
    assert not os.path.exists(first) and os.path.isdir(env.workspace.path)
    second = env.workspace.path
    env.close()
    assert not os.path.exists(second) and env.workspace is None
    dropped = WorkspaceEnv(sandbox=mode)
    dropped.reset(seed=0)
    third = dropped.workspace.path
    del dropped
    gc.collect()
    assert not os.path.exists(third)


@pytest.mark.parametrize(
    ("action", "expect"),
    [
        (call("read_file", path="../../etc/passwd"), "'..' is not allowed"),
        (call("write_file", path="../escape.txt", content="x"), "'..' is not allowed"),
        (call("read_file", path="/etc/passwd"), "absolute paths are not allowed"),
        (call("list_files", path="/"), "absolute paths are not allowed"),
        (call("write_file", path="/tmp/agentenv-escape", content="x"), "absolute paths"),
    ],
)
def test_paths_outside_the_workspace_are_refused(env, action, expect):
    out, info = tool_output(env, action)
    assert out.startswith("Error: ") and expect in out
    assert info["tool_errors"] == {"path": 1}
    assert not os.path.exists("/tmp/agentenv-escape")


def test_symlink_to_root_is_refused(env):
    out, _ = tool_output(env, call("run_python", code="import os; os.symlink('/', 'slash')"))
    assert out == "(no output)"
    assert "slash -> /" in tool_output(env, call("list_files"))[0]
    for action in (
        call("read_file", path="slash/etc/passwd"),
        call("list_files", path="slash"),
        call("write_file", path="slash/tmp/pwned", content="x"),
    ):
        out, _ = tool_output(env, action)
        assert out.startswith("Error: ") and "resolves outside the workspace" in out
    assert not os.path.exists("/tmp/pwned")


def test_writing_a_1gb_file_is_stopped(env):
    out, info = tool_output(env, call("write_file", path="big.txt", content="x" * (2 << 20)))
    assert out.startswith("Error: content is 2097152 bytes; the limit is 1048576")
    code = (
        "with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)"
    )
    out, _ = tool_output(env, call("run_python", code=code))
    assert "OSError: [Errno 27] File too large" in out and "[exit code 1]" in out
    out, _ = tool_output(env, call("run", command="head -c 1073741824 /dev/zero > big2.bin"))
    assert "Error" in out or "exit code" in out
    for name in ("big.bin", "big2.bin"):
        assert os.path.getsize(os.path.join(env.workspace.root, name)) <= 4 << 20
    assert info["tool_errors"] == {"limit": 1}


def test_fork_bomb(env, children):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    out, info = tool_output(env, call("run_python", code=code))
    assert out.startswith("Error: the code was stopped after the 2 s wall-clock limit")
    assert info["tool_errors"] == {"sandbox": 1} and not children()
    assert tool_output(env, call("run_python", code="print('ok')"))[0] == "ok\n"


def test_memory_bomb(env):
    out, _ = tool_output(env, call("run_python", code="x = []\nwhile True: x.append(' ' * 10**7)"))
    assert "\nMemoryError\n" in out and out.endswith("[exit code 1]")


def test_infinite_loop(env):
    out, info = tool_output(env, call("run_python", code="while True:\n    pass"))
    assert out.startswith("Error: the code was stopped after the 2 s wall-clock limit")
    out, _ = tool_output(env, call("run", command="while true; do :; done"))
    assert out.startswith("Error: the command was stopped after the 2 s wall-clock limit")
    assert info["tool_errors"] == {"sandbox": 1}


def test_killing_the_parent_leaves_the_host_unharmed(env, mode):
    out, _ = tool_output(env, call("run_python", code="import os\nos.kill(os.getppid(), 9)"))
    assert "PermissionError" in out or out.startswith("Error: the code was ended by")
    if env.workspace.uid is not None or mode == "bwrap":  # else kill -1 would hit our user
        out, _ = tool_output(env, call("run", command="kill -9 $PPID; kill -9 -1; echo done"))
        assert out.startswith("Error: the command was ended by SIGKILL") or "done" in out
    assert tool_output(env, call("run_python", code="print('alive')"))[0] == "alive\n"


def test_secrets_in_the_environment_are_not_visible(env, monkeypatch):
    monkeypatch.setenv("AGENTENV_TEST_API_KEY", "sk-test-hunter2")
    code = f"import os\nprint(dict(os.environ))\nprint(open('/proc/{os.getpid()}/environ').read())"
    out, _ = tool_output(env, call("run_python", code=code))
    assert "hunter2" not in out and "AGENTENV_TEST_API_KEY" not in out
    out, _ = tool_output(env, call("run", command="env; cat /proc/*/environ 2>&1 | head -c 3000"))
    assert "hunter2" not in out


def test_background_process_does_not_outlive_the_call(env, children):
    code = "import subprocess\np = subprocess.Popen(['sleep', '100'])\nprint('started', p.pid)"
    out, _ = tool_output(env, call("run_python", code=code))
    assert out.startswith("started")
    assert not children()
    if env.workspace.uid is not None:
        assert _procs.live_pids_of_uid(env.workspace.uid) == []
    out, _ = tool_output(env, call("run", command="sleep 100 & echo bg"))
    assert out == "bg\n" and not children()


def test_ten_megabytes_of_output_is_truncated(env):
    out, _ = tool_output(env, call("run_python", code="print('A' + 'x' * 10_000_000 + 'Z')"))
    assert len(out) < 4200 and out.startswith("A") and out.rstrip().endswith("Z")
    assert "truncated" in out


def test_no_shell_option_and_bad_options(make_env):
    env = make_env(sandbox="rlimit", shell=False)
    assert [t.name for t in env.tools] == ["list_files", "read_file", "write_file", "run_python"]
    with pytest.raises(InvalidOptionError, match="sandbox must be one of"):
        WorkspaceEnv(sandbox="docker")
    with pytest.raises(InvalidOptionError, match="limits must be a SandboxLimits"):
        WorkspaceEnv(limits={"timeout_s": 1})


def test_render_and_step_after_close(make_env):
    env = make_env(sandbox="rlimit", render_mode="ansi")
    env.reset(seed=0)
    env.step(call("list_files"))
    assert "[tool]" in env.render()
    env.close()
    out, info = tool_output(env, call("list_files"))
    assert out == "Error: there is no open workspace; call reset() first"
    assert info["tool_errors"] == {"sandbox": 1}
    _, reward, terminated, _, info = env.step("<answer>done</answer>")
    assert (reward, terminated, info["correct"]) == (0.0, True, False)
    assert info["checks_failed"] == ["the workspace was closed before the answer"]


def test_demonstrations_replay_the_scripted_solvers(tokenizer):
    from agentenv.rollout.demos import demonstration_episodes
    from agentenv.rollout.episode import ChatFormat

    def make():
        return agentenv.make("Workspace-v0", sandbox="rlimit", max_turns=20)

    episodes = demonstration_episodes(make, ChatFormat(tokenizer), 8, max_episode_tokens=8192)
    assert len(episodes) == 8  # every family's solver passes its checker
    assert {e.info["checks_passed"] == e.info["checks_total"] for e in episodes} == {True}
    assert all(e.messages[-1]["content"] == "<answer>done</answer>" for e in episodes)


def test_compact_prompt_names_every_tool_and_works(make_env, tokenizer):
    env = make_env(sandbox="rlimit", prompt_style="compact", families=["files"])
    obs, _ = env.reset(seed=0)
    prompt = obs[0]["content"]
    assert len(tokenizer.encode(prompt)) < 160
    for signature in ["list_files(path)", "write_file(path, content)", "run(command)"]:
        assert signature in prompt
    no_shell = make_env(sandbox="rlimit", prompt_style="compact", shell=False)
    assert "run(command)" not in no_shell.system_prompt()
    # the example call in the prompt is a valid call of a real tool
    example = prompt.split("<tool_call>")[1].split("</tool_call>")[0]
    files = env.task.metadata["files"]
    out, _ = tool_output(env, f"<tool_call>{example}</tool_call>")
    assert not out.startswith("Error")  # a harmless call: it lists the task's files
    assert out.splitlines() == [f"{name} ({len(text)} bytes)" for name, text in files.items()]


def test_data_demonstration_computes_the_answer_from_the_file(tmp_path, monkeypatch):
    from envs.workspace import solve_task
    from envs.workspace.tasks import load_tasks

    monkeypatch.chdir(tmp_path)
    for task in load_tasks("train", num_tasks=30, families=["data"], levels=["easy"]):
        params = task.metadata["params"]
        ((call,),) = [solve_task(task)]  # one run_python call: no gold in the demonstration
        code = call["arguments"]["code"]
        assert call["name"] == "run_python" and f"{params['answer']:.2f}" not in code
        # the code reads the data: doubling every row's units changes what it writes
        rows = task.metadata["files"]["sales.csv"].splitlines()
        header, body = rows[0], [r.split(",") for r in rows[1:]]
        units = header.split(",").index("units")
        for doubled in (False, True):
            lines = [header] + [
                ",".join(str(int(v) * 2) if doubled and i == units else v for i, v in enumerate(r))
                for r in body
            ]
            (tmp_path / "sales.csv").write_text("\n".join(lines) + "\n")
            exec(code, {"__name__": "demo"})  # noqa: S102 (our own generated code)
            value = float((tmp_path / "answer.txt").read_text())
            if "sum(1 for" not in params["expression"]:  # a count is not linear in units
                assert value == pytest.approx(params["answer"] * (1 + doubled), abs=0.011)
