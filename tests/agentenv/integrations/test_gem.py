"""agentenv ids in GEM's registry, run by GEM's own ``make`` and vector envs."""

import pytest

pytest.importorskip("gem", reason="GEM is not installed: pip install --no-deps gem-llm")

import gem  # noqa: E402

import agentenv  # noqa: E402
import agentenv.integrations.gem as agentenv_gem  # noqa: E402
from agentenv.errors import InvalidOptionError  # noqa: E402
from envs.calculator import CalculatorEnv  # noqa: E402

ENV = {"source": "word_problems", "prompt_style": "compact"}


def joined(messages):
    return "\n\n".join(m["content"] for m in messages)


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [
        ("Calculator-v0", ENV),
        ("RAG-v0", {"chroma": "memory", "num_tasks": 4}),
        ("Workspace-v0", {"sandbox": "rlimit", "num_tasks": 4}),
    ],
)
def test_gem_make_plays_every_bundled_env(env_id, kwargs):
    env = gem.make(f"agentenv:{env_id}", **kwargs)
    local = agentenv.make(env_id, **kwargs)
    try:
        obs, info = env.reset(seed=4)
        local_obs, _ = local.reset(seed=4)
        assert obs == joined(local_obs) and info["messages"] == local_obs
        assert env.env_id == f"agentenv:{env_id}"  # set by GEM's make
        action = "no tool call and no answer"
        text, reward, terminated, truncated, info = env.step(action)
        want = local.step(action)
        assert (text, reward, terminated, truncated) == (joined(want[0]), *want[1:4])
        assert info["use_tool"] is False and info["messages"][0]["role"] == "user"
    finally:
        env.close()
        local.close()


def test_tool_results_are_marked_for_gems_observation_wrapper():
    env = gem.make("agentenv:Calculator-v0", **ENV)
    env.reset(seed=0)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    text, reward, terminated, _, info = env.step(call)
    assert (text, reward, terminated, info["use_tool"]) == ("42", 0.0, False, True)
    env.close()


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_gem_vector_envs_step_four_calculators(async_mode):
    vec = gem.make_vec(["agentenv:Calculator-v0"] * 4, async_mode=async_mode, seed=10, **ENV)
    local = [agentenv.make("Calculator-v0", **ENV) for _ in range(4)]
    obs, infos = vec.reset(seed=10)
    expected = [env.reset(seed=10 + i)[0] for i, env in enumerate(local)]
    assert list(obs) == [joined(e) for e in expected]
    golds = [env.unwrapped.task.answer for env in local]
    actions = [f"<answer>{g}</answer>" if i % 2 == 0 else "<answer>-1</answer>"
               for i, g in enumerate(golds)]  # fmt: skip
    obs, rewards, terminated, truncated, infos = vec.step(actions)
    assert list(rewards) == [1.0, 0.0, 1.0, 0.0]
    assert list(terminated) == [True] * 4 and not any(truncated)
    # GEM's default autoreset (same step): a finished env is reset at once, its new prompt
    # returned; that reset continues each env's own RNG, as the local envs' does
    assert list(obs) == [joined(env.reset()[0]) for env in local]


def test_envs_registered_later_are_added_by_register():
    class Later(CalculatorEnv):
        pass

    agentenv.register("LaterForGEM-v0", entry_point=Later, override=True)
    try:
        assert "agentenv:LaterForGEM-v0" in agentenv_gem.register()  # with others' test envs
        assert agentenv_gem.register() == []  # already there
        env = gem.make("agentenv:LaterForGEM-v0")
        assert isinstance(env.env.unwrapped, Later)
        env.close()
    finally:
        agentenv.deregister("LaterForGEM-v0")
    with pytest.raises(InvalidOptionError, match="'Nope-v0' is not a registered agentenv id"):
        agentenv_gem.register(["Nope-v0"])


def test_a_bfcl_conversation_plays_through_gem_with_its_follow_up_user_turns():
    """BFCL-v0 (a ConversationEnv with stateful tools) through GEM: tool results are marked
    use_tool, each follow-up user turn comes back as the next observation, and the
    ground truth earns reward 1."""
    pytest.importorskip("bfcl_eval", reason="bfcl-eval is not installed (install.sh does)")
    agentenv_gem.register(["BFCL-v0"])
    env = gem.make("agentenv:BFCL-v0", num_tasks=2)
    try:
        env.reset(seed=0)
        inner = env.env.unwrapped
        follow_ups = list(inner.task.metadata["user_turns"])
        texts = []
        for action in inner.demonstration(inner.task):
            text, reward, terminated, _, info = env.step(action)
            texts.append((text, info["use_tool"]))
        users = [t for t, use_tool in texts if t and not use_tool]
        assert users == follow_ups and terminated and reward == 1.0
        assert any(use_tool for _, use_tool in texts)
    finally:
        env.close()
