"""agentenv envs through skyrl-gym's own register / make / init / step API."""

import json

import pytest

pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed: pip install 'agentenv[skyrl]'")

import skyrl_gym  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from agentenv import make  # noqa: E402
from agentenv.errors import InvalidOptionError  # noqa: E402
from agentenv.integrations import skyrl  # noqa: E402

CALC = {"source": "word_problems"}  # tasks with a demonstration (a calculator call)


@pytest.fixture
def calculator_id():
    skyrl_id = skyrl.register("Calculator-v0", **CALC)
    yield skyrl_id
    skyrl_gym.envs.registration.deregister(skyrl_id)


def test_a_demonstration_solves_the_task_through_skyrl_gym(calculator_id):
    row = skyrl.dataset_rows("Calculator-v0", num_tasks=2, **CALC)[1]
    assert calculator_id == row["env_class"] == "agentenv/Calculator-v0"
    extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
    env = skyrl_gym.make(row["env_class"], env_config=DictConfig({}), extras=extras)
    assert isinstance(env, skyrl_gym.Env)

    prompt, meta = env.init(row["prompt"])
    assert prompt == row["prompt"] and meta["task_id"] == 1
    inner = make("Calculator-v0", **CALC).unwrapped
    call, answer = inner.demonstration(inner.get_task(1))

    out = env.step(call)
    assert out["done"] is False and out["reward"] == 0.0
    assert [m["role"] for m in out["observations"]] == ["tool"]
    expression = json.loads(call.split("<tool_call>")[1].split("</tool_call>")[0])
    assert out["observations"][0]["content"] == inner.tools[0](**expression["arguments"])

    out = env.step(answer)
    assert out["done"] is True and out["reward"] == 1.0 and out["observations"] == []
    assert env.get_metrics() == {
        "turns": 2,
        "num_tool_calls": 1,
        "num_tool_errors": 0,
        "correct": 1.0,
    }
    env.close()


def test_max_turns_from_extras_ends_the_episode(calculator_id):
    env = skyrl_gym.make(calculator_id, extras={"task_id": 0, "max_turns": 2})
    env.init([])
    first = env.step("thinking...")
    assert first["done"] is False
    assert first["observations"][0]["role"] == "user"  # the env's format reminder
    last = env.step("still thinking")
    assert last["done"] is True and last["reward"] == 0.0 and last["observations"] == []
    assert env.get_metrics()["correct"] == 0.0


def test_workspace_state_is_per_env_and_scored_on_files():
    skyrl_id = skyrl.register("Workspace-v0", sandbox="rlimit", families=["files"])
    try:
        a = skyrl_gym.make(skyrl_id, extras={"task_id": 0})
        b = skyrl_gym.make(skyrl_id, extras={"task_id": 0})
        a.init([])
        b.init([])
        call = {"name": "write_file", "arguments": {"path": "x.txt", "content": "1"}}
        out = a.step(f"<tool_call>{json.dumps(call)}</tool_call>")
        assert out["observations"] == [{"role": "tool", "content": "wrote 1 bytes to x.txt"}]
        listing = {"name": "list_files", "arguments": {}}
        seen = b.step(f"<tool_call>{json.dumps(listing)}</tool_call>")
        assert "x.txt" not in seen["observations"][0]["content"]
        out = a.step("<answer>done</answer>")
        assert out["done"] and out["reward"] == 0.0  # the task's file was never written
        assert out["metadata"]["checks_failed"]
        a.close()
        b.close()
    finally:
        skyrl_gym.envs.registration.deregister(skyrl_id)


def test_string_entry_point_takes_the_env_from_env_config():
    skyrl_gym.register("agentenv-any", "agentenv.integrations.skyrl:AgentEnvTextEnv")
    try:
        config = DictConfig({"env_id": "Calculator-v0", "env_kwargs": CALC})
        env = skyrl_gym.make("agentenv-any", env_config=config, extras={"task_id": 3})
        prompt, _ = env.init([])
        task = make("Calculator-v0", **CALC).unwrapped.get_task(3)
        assert prompt[1] == {"role": "user", "content": task.prompt}
        with pytest.raises(InvalidOptionError, match="task_id"):
            skyrl_gym.make("agentenv-any", env_config=config, extras={})
        with pytest.raises(InvalidOptionError, match="env_id"):
            skyrl_gym.make("agentenv-any", extras={"task_id": 0})
    finally:
        skyrl_gym.envs.registration.deregister("agentenv-any")


def test_a_conversation_plays_its_follow_up_user_turn_through_skyrl_gym():
    """The shop example (two user turns, a cart per episode) through skyrl-gym: the
    follow-up arrives as a user observation, and the demonstration earns reward 1."""
    import importlib.util
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "examples" / "conversation_env.py"
    spec = importlib.util.spec_from_file_location("conversation_env_skyrl", example)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # registers Shop-v0
    skyrl_id = skyrl.register("Shop-v0")
    try:
        row = skyrl.dataset_rows("Shop-v0", num_tasks=1)[0]
        extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
        env = skyrl_gym.make(skyrl_id, env_config=DictConfig({}), extras=extras)
        env.init(row["prompt"])
        inner = make("Shop-v0").unwrapped
        outs = [env.step(action) for action in inner.demonstration(inner.get_task(0))]
        follow_up = outs[2]["observations"]
        assert [m["role"] for m in follow_up] == ["user"]
        assert follow_up[0]["content"] == inner.get_task(0).metadata["user_turns"][0]
        assert [o["done"] for o in outs] == [False] * 4 + [True] and outs[-1]["reward"] == 1.0
    finally:
        skyrl_gym.envs.registration.deregister(skyrl_id)
