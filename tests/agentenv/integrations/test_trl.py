"""agentenv envs in TRL's own GRPOTrainer (environment_factory), run on CPU.

The end-to-end tests use a tiny model that learned one solution by heart (tests/helpers/
memorized.py), so TRL's own loop makes a real tool call into the env and its answer is
scored by the env: the rewards are the env's, not 0 by default.
"""

import copy
import inspect
import os
import re

import pytest

pytest.importorskip("trl", reason="TRL is not installed: pip install 'agentenv[trl]'")

from transformers.utils import get_json_schema  # noqa: E402
from trl_steps import memorized_policy, train_one_step  # noqa: E402

from agentenv import make  # noqa: E402
from agentenv.errors import InvalidOptionError  # noqa: E402
from agentenv.integrations.trl import (  # noqa: E402
    dataset,
    environment_factory,
    mixture_dataset,
    mixture_factory,
    reward_func,
    tool_chat_template,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

WORKSPACE = {"sandbox": "rlimit", "families": ["files"], "levels": ["easy"]}


def test_tool_methods_carry_the_env_tools_schema():
    factory = environment_factory("Workspace-v0", **WORKSPACE)
    env_tools = {t.name: t for t in make("Workspace-v0", **WORKSPACE).unwrapped.tools}
    # TRL lists the tools as the class's public functions other than reset/get_reward
    methods = {
        n: f
        for n, f in inspect.getmembers(factory, predicate=inspect.isfunction)
        if not n.startswith("_") and n not in ("reset", "get_reward")
    }
    assert (
        set(methods)
        == set(env_tools)
        == {
            "list_files",
            "read_file",
            "write_file",
            "run_python",
            "run",
        }
    )
    instance = factory()
    for name, tool in env_tools.items():
        schema = get_json_schema(getattr(instance, name))["function"]
        assert schema["name"] == name
        assert schema["description"] == tool.description
        params = schema["parameters"]
        assert params.get("required", []) == tool.parameters.get("required", [])
        for arg, spec in tool.parameters["properties"].items():
            assert params["properties"][arg]["description"] == spec["description"]
            assert params["properties"][arg]["type"] == spec["type"]


def test_tools_run_in_the_sandbox_of_their_own_instance():
    factory = environment_factory("Workspace-v0", **WORKSPACE)
    a, b = factory(), factory()
    a.reset(task_id=0)
    b.reset(task_id=0)
    assert a.write_file(path="note.txt", content="hi\n") == "wrote 3 bytes to note.txt"
    assert "note.txt" in a.list_files()
    assert "note.txt" not in b.list_files()  # each instance owns its sandbox
    assert a.read_file(path="nope.txt").startswith("Error")  # errors come back as text
    assert a.read_file(paht="note.txt").startswith("Error")  # so do bad arguments
    assert a._tool_calls == 4 and a._tool_errors == 2


def test_reward_func_scores_the_last_answer_with_the_env():
    factory = environment_factory("Calculator-v0")
    env = factory()
    env.reset(task_id=3)
    gold = env._inner.task.answer
    reply = {"role": "assistant", "content": f"<answer>{gold}</answer>"}
    wrong = {"role": "assistant", "content": f"<answer>{gold}1</answer>"}
    call = {"role": "assistant", "content": "", "tool_calls": []}
    tool = {"role": "tool", "content": "4"}
    assert reward_func([[call, tool, reply]], environments=[env]) == [1.0]
    assert reward_func([[reply, tool, wrong]], environments=[env]) == [0.0]  # the last one counts
    assert reward_func([[call]], environments=[env]) == [0.0]  # no answer
    with pytest.raises(InvalidOptionError, match="environment_factory"):
        reward_func([[reply]])


def test_dataset_rows_reset_to_their_task():
    rows = dataset("Calculator-v0", num_tasks=3)
    env = make("Calculator-v0")
    assert rows.column_names == ["prompt", "task_id"]
    for row in rows:
        opening = env.reset(options={"task_id": row["task_id"]})[0]
        assert row["prompt"][1] == opening[1]  # the task
        assert row["prompt"][0] == {"role": "system", "content": env.unwrapped.instructions()}
    with pytest.raises(InvalidOptionError, match="num_tasks=10000"):
        dataset("Calculator-v0", num_tasks=10_000)


def test_factory_rejects_a_non_tool_env():
    import gymnasium as gym

    from agentenv import FreeText, Messages, register
    from agentenv.env.registration import deregister

    class Plain(gym.Env):
        observation_space = Messages()
        action_space = FreeText()

    register("PlainForTRL-v0", Plain)
    try:
        with pytest.raises(InvalidOptionError, match="not a ToolEnv"):
            environment_factory("PlainForTRL-v0")
    finally:
        deregister("PlainForTRL-v0")


def test_trl_grpo_trainer_runs_a_calculator_step_with_env_tool_calls(tokenizer, tmp_path):
    tokenizer = tool_chat_template(copy.deepcopy(tokenizer))  # the fixture is shared
    factory = environment_factory("Calculator-v0")
    rows = dataset("Calculator-v0", num_tasks=1)
    gold = make("Calculator-v0").unwrapped.get_task(0).answer
    turns = [("calculator", {"expression": f"{gold}+0"}), f"<answer>{gold}</answer>"]
    model = memorized_policy(tokenizer, factory, rows[0], turns)
    trainer = train_one_step(model, tokenizer, factory, rows, tmp_path)

    log = trainer.state.log_history[0]
    assert trainer.state.global_step == 1
    assert [e._task_id for e in trainer.environments] == [0, 0]
    assert [e._tool_calls for e in trainer.environments] == [1, 1]  # TRL called our calculator
    assert log["tools/call_frequency"] > 0 and log["tools/failure_frequency"] == 0
    assert log["rewards/reward_func/mean"] == 1.0  # the env scored the memorised answer


def test_trl_grpo_trainer_runs_a_workspace_step_scored_on_the_files(tokenizer, tmp_path):
    tokenizer = tool_chat_template(copy.deepcopy(tokenizer))  # the fixture is shared
    factory = environment_factory("Workspace-v0", **WORKSPACE)
    rows = dataset("Workspace-v0", num_tasks=1, **WORKSPACE)
    task = rows[0]["prompt"][1]["content"]
    path = re.search(r"`([^`]+)`", task).group(1)
    lines = task.split("\n\n", 1)[1].strip() + "\n"
    turns = [("write_file", {"path": path, "content": lines}), "<answer>done</answer>"]
    model = memorized_policy(tokenizer, factory, rows[0], turns)
    trainer = train_one_step(model, tokenizer, factory, rows, tmp_path)

    log = trainer.state.log_history[0]
    assert trainer.state.global_step == 1
    assert [e._tool_calls for e in trainer.environments] == [1, 1]
    assert log["rewards/reward_func/mean"] == 1.0  # the checker read the file the tool wrote


def test_trl_grpo_trainer_steps_on_a_two_env_mixture(tokenizer, tmp_path):
    """TRL's dict environment_factory: each row's `environment` picks its env (a Calculator
    or a Workspace instance, reset to the row's task); the weights 1:1 give 2 rows each,
    and a batch of 8 draws each row twice (G = 2)."""
    from trl_steps import train_one_step

    tokenizer = tool_chat_template(copy.deepcopy(tokenizer))  # the fixture is shared
    envs = [
        "calc=Calculator-v0",
        {"env_id": "Workspace-v0", "name": "files", "env_kwargs": WORKSPACE},
    ]
    factories = mixture_factory(envs)
    rows = mixture_dataset(envs, num_tasks=4)
    assert rows["environment"] == ["calc", "calc", "files", "files"]
    assert rows["task_id"] == [0, 1, 0, 1]
    from agentenv.lm.models import tiny_model

    trainer = train_one_step(tiny_model(tokenizer), tokenizer, factories, rows, tmp_path, batch=8)
    assert trainer.state.global_step == 1
    kinds = sorted(type(e).__name__ for e in trainer.environments)
    assert kinds == ["CalculatorEnvironment"] * 4 + ["WorkspaceEnvironment"] * 4
    assert all(e._task_id in (0, 1) for e in trainer.environments)
    assert "rewards/reward_func/mean" in trainer.state.log_history[0]


def test_a_conversation_env_is_refused_saying_what_trl_cannot_carry():
    import importlib.util
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "examples" / "conversation_env.py"
    spec = importlib.util.spec_from_file_location("conversation_env_trl", example)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # registers Shop-v0
    with pytest.raises(InvalidOptionError, match="TRL ends a rollout at the first answer"):
        environment_factory("Shop-v0")
