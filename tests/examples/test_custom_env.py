"""examples/custom_env.py: a user's env whose demonstrations solve its tasks."""

import importlib.util
from pathlib import Path

import pytest

import agentenv
from agentenv import ReActParser

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_env.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_env_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers Capitals-v0 (override=True)
    return module


@pytest.mark.parametrize("parser", [None, ReActParser()], ids=["hermes", "react"])
def test_every_train_demonstration_earns_reward_1(example, parser):
    env = example.CapitalsEnv(split="train", parser=parser)
    assert env.num_tasks == 8
    for task_id in range(env.num_tasks):
        env.reset(options={"task_id": task_id})
        actions = env.demonstration(env.task)
        assert len(actions) == 2
        it = iter(actions)
        result = agentenv.play_episode(env, lambda _, it=it: next(it), options={"task_id": task_id})
        assert result.reward == 1.0 and result.terminated
        assert result.info["num_tool_calls"] == 1 and result.info["num_tool_errors"] == 0
        assert result.messages[-2]["content"] == example.CAPITALS[env.task.id]  # the tool's


def test_the_demonstration_is_hermes_text_the_scripted_policy_plays(example):
    env = example.CapitalsEnv(split="test")
    env.reset(options={"task_id": 0})
    assert env.demonstration(env.task) == [
        '<tool_call>{"name": "lookup_capital", "arguments": {"country": "Canada"}}</tool_call>',
        "<answer>Ottawa</answer>",
    ]
    assert example.main() == 1.0  # the scripted policy, on the test split
