"""The ToolEnv loop, tested on a small env defined here (no bundled env involved)."""

import time
from typing import Any

import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env

from agentenv import Task, ToolEnv, tool
from agentenv.env.parsers import ReActParser
from agentenv.errors import InvalidOptionError


@tool
def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: What to echo.
    """
    return text


@tool
def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


class EchoEnv(ToolEnv):
    def __init__(self, **kwargs: Any):
        super().__init__([echo, nap], tool_timeout_s=0.2, **kwargs)

    @property
    def num_tasks(self) -> int:
        return 50

    def get_task(self, index: int) -> Task:
        return Task(id=str(index), prompt=f"Say {index}.", answer=str(index))

    def score(self, answer: str, task: Task) -> tuple[float, dict[str, Any]]:
        return float(answer == task.answer), {"correct": answer == task.answer}


def call(name: str, **args: Any) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_check_env_passes():
    check_env(EchoEnv())
    check_env(EchoEnv(render_mode="ansi"))


def test_reset_returns_system_and_task_and_seed_reproduces():
    env = EchoEnv()
    obs, info = env.reset(seed=5)
    assert [m["role"] for m in obs] == ["system", "user"]
    assert "echo" in obs[0]["content"] and "<tool_call>" in obs[0]["content"]
    assert obs[1]["content"] == f"Say {info['task_id']}."
    obs2, info2 = EchoEnv().reset(seed=5)
    assert obs2 == obs and info2 == info
    seen = {EchoEnv().reset(seed=s)[1]["task_id"] for s in range(20)}
    assert len(seen) > 5  # different seeds pick different tasks


def test_task_id_option_and_its_validation():
    env = EchoEnv()
    assert env.reset(options={"task_id": 7})[0][1]["content"] == "Say 7."
    for bad in (-1, 50, "3", 1.0, True):
        with pytest.raises(InvalidOptionError, match="task_id"):
            env.reset(options={"task_id": bad})
    with pytest.raises(InvalidOptionError, match="unknown reset option"):
        env.reset(options={"taskid": 1})


def test_tool_call_answer_and_info_counters():
    env = EchoEnv()
    env.reset(options={"task_id": 3})
    obs, reward, term, trunc, info = env.step(call("echo", text="hi") + call("nope"))
    assert obs[0] == {"role": "tool", "content": "hi"}
    assert obs[1]["content"].startswith("Error: unknown tool 'nope'")
    assert (reward, term, trunc) == (0.0, False, False)
    assert info["num_tool_calls"] == 2 and info["num_tool_errors"] == 1
    assert info["tool_errors"] == {"unknown_tool": 1}
    obs, reward, term, trunc, info = env.step("<answer>3</answer>")
    assert (obs, reward, term, trunc) == ([], 1.0, True, False)
    assert info["correct"] is True and info["turn"] == 2 and info["answer"] == "3"
    with pytest.raises(ResetNeeded):
        env.step("<answer>3</answer>")


def test_no_call_no_answer_gets_format_reminder():
    env = EchoEnv()
    env.reset(seed=0)
    obs, *_ = env.step("I think the answer is 3")
    assert obs[0]["role"] == "user" and "<answer>" in obs[0]["content"]


def test_max_turns_truncates_with_zero_reward():
    env = EchoEnv(max_turns=2)
    env.reset(seed=0)
    assert env.step("hmm")[3] is False
    obs, reward, term, trunc, info = env.step("hmm")
    assert (reward, term, trunc, info["correct"]) == (0.0, False, True, False)


def test_slow_tool_times_out_and_episode_goes_on():
    env = EchoEnv()
    env.reset(options={"task_id": 1})
    start = time.perf_counter()
    obs, *_, info = env.step(call("nap", seconds=3))
    assert time.perf_counter() - start < 1.0
    assert "timed out" in obs[0]["content"] and info["tool_errors"] == {"timeout": 1}
    assert env.step("<answer>1</answer>")[1] == 1.0


def test_step_before_reset_and_bad_action_type():
    env = EchoEnv()
    with pytest.raises(ResetNeeded):
        env.step("x")
    env.reset(seed=0)
    with pytest.raises(InvalidOptionError, match="action must be a str"):
        env.step(123)  # type: ignore[arg-type]


def test_react_parser_is_pluggable():
    env = EchoEnv(parser=ReActParser())
    obs, _ = env.reset(options={"task_id": 4})
    assert "Action Input:" in obs[0]["content"]
    obs, *_ = env.step('Action: echo\nAction Input: {"text": "yo"}')
    assert obs[0]["content"] == "yo"
    assert env.step("Final Answer: 4")[1] == 1.0


def test_render_ansi_transcript_and_bad_split():
    env = EchoEnv(render_mode="ansi")
    env.reset(options={"task_id": 2})
    env.step(call("echo", text="x"))
    text = env.render()
    assert "[user]\nSay 2." in text and "[assistant]" in text and "[tool]\nx" in text
    with pytest.raises(InvalidOptionError, match="split"):
        EchoEnv(split="validation")


def test_prompt_style_compact_needs_the_envs_compact_prompt():
    with pytest.raises(InvalidOptionError, match="EchoEnv has no compact prompt"):
        EchoEnv(prompt_style="compact")
    with pytest.raises(InvalidOptionError, match="prompt_style must be one of"):
        EchoEnv(prompt_style="tiny")

    class ShortEchoEnv(EchoEnv):
        def compact_prompt(self) -> str:
            return "Echo it."

    assert ShortEchoEnv(prompt_style="compact").reset(seed=0)[0][0]["content"] == "Echo it."
    assert ShortEchoEnv().system_prompt().startswith(EchoEnv().instructions())
    assert ShortEchoEnv(prompt_style="compact", system_prompt="Mine.").system_prompt() == "Mine."
