"""Conversations (ConversationEnv) and stateful toolsets (toolset, episode_tools), on the
shop example: user turns scored one by one, the cart's state carried between them and
never shared between episodes, the episode's tokens exact and its user turns masked."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import gymnasium as gym
import pytest

import agentenv
from agentenv import ConversationEnv, Task, toolset
from agentenv.errors import ToolDefinitionError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "conversation_env.py"


@pytest.fixture(scope="module")
def shop():
    spec = importlib.util.spec_from_file_location("conversation_env_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers Shop-v0
    return module


def play(env, actions):
    out = []
    for action in actions:
        out.append(env.step(action))
        if out[-1][2] or out[-1][3]:
            break
    return out


def test_toolset_turns_public_methods_into_tools_bound_to_the_object(shop):
    cart = shop.Cart()
    tools = toolset(cart)
    assert [t.name for t in tools] == ["add_item", "remove_item", "total"]
    add = tools[0].schema["function"]
    assert add["parameters"]["required"] == ["item", "quantity"]
    assert add["parameters"]["properties"]["quantity"]["type"] == "integer"
    tools[0](item="pear", quantity=2)
    assert cart.items == {"pear": 2} and tools[2]() == 6
    renamed = toolset(cart, include=["total"], rename={"total": "cart_total"})
    assert [t.name for t in renamed] == ["cart_total"] and renamed[0]() == 6
    with pytest.raises(ToolDefinitionError, match="Cart has no public method 'checkout'"):
        toolset(cart, include=["checkout"])


def test_each_user_turn_is_scored_and_the_next_one_sent(shop):
    env = shop.ShopEnv(split="train")
    assert env.num_tasks == 54 and shop.ShopEnv(split="test").num_tasks == 18
    for task_id in range(env.num_tasks):
        obs, info = env.reset(options={"task_id": task_id})
        assert info["user_turn"] == 0
        steps = play(env, env.demonstration(env.task))
        rewards = [s[1] for s in steps]
        turn_rewards = [s[4].get("turn_reward") for s in steps]
        assert rewards == [0.0, 0.0, 0.0, 0.0, 1.0]
        assert turn_rewards == [None, None, 1.0, None, 1.0]
        follow_up = steps[2][0]
        assert follow_up == [{"role": "user", "content": env.task.metadata["user_turns"][0]}]
        assert steps[2][4]["answered_turn"] == 0 and steps[2][4]["user_turn"] == 1
        last = steps[-1][4]
        assert steps[-1][2] and last["correct"] and last["turns_correct"] == 2
        # every step says how far the conversation got (eval's turn_accuracy reads it)
        progress = [(s[4]["turns_correct"], s[4]["user_turns"]) for s in steps]
        assert progress == [(0, 2), (0, 2), (1, 2), (1, 2), (2, 2)]


def test_a_wrong_follow_up_answer_scores_that_turn_0_and_the_conversation_half(shop):
    env = shop.ShopEnv(split="test")
    env.reset(options={"task_id": 3})
    actions = env.demonstration(env.task)
    actions[-1] = "<answer>1000</answer>"
    steps = play(env, actions)
    assert [s[4].get("turn_reward") for s in steps if "answered_turn" in s[4]] == [1.0, 0.0]
    assert steps[-1][1] == 0.5 and steps[-1][4]["correct"] is False
    assert steps[-1][4]["turns_correct"] == 1


def test_the_cart_carries_over_user_turns_and_each_episode_has_its_own(shop):
    """Two envs interleaved, and one env reset mid-conversation: each episode's tools act
    on its own cart; the second request sees what the first put in."""
    a, b = shop.ShopEnv(split="train"), shop.ShopEnv(split="train")
    a.reset(options={"task_id": 0})
    b.reset(options={"task_id": 0})
    demo = a.demonstration(a.task)
    a.step(demo[0])
    assert b.cart.items == {} and sum(a.cart.items.values()) > 0
    first_cart = a.cart
    play(a, demo[1:3])  # the first answer: the follow-up arrives, the cart kept
    assert a.cart is first_cart and a.user_turn == 1
    a.reset(options={"task_id": 0})
    assert a.cart is not first_cart and a.cart.items == {}


def test_max_turns_counts_every_action_of_the_conversation(shop):
    env = shop.ShopEnv(split="train", max_turns=3)
    env.reset(options={"task_id": 0})
    steps = play(env, env.demonstration(env.task))
    assert len(steps) == 3 and steps[-1][3]  # answered turn 0 at action 3: truncated
    assert steps[-1][1] == 0.0 and steps[-1][4]["correct"] is False
    assert steps[-1][4]["turn_reward"] == 1.0  # the answered turn keeps its reward
    assert (steps[-1][4]["turns_correct"], steps[-1][4]["user_turns"]) == (1, 2)


def test_a_simulated_user_sees_the_conversation_and_may_end_it(shop):
    seen = []

    def user(task: Task, messages: list[dict]) -> str | None:
        seen.append([m["role"] for m in messages])
        return "And the total of two carts like that?" if len(seen) == 1 else None

    class Doubling(shop.ShopEnv):
        def score_turn(self, answer, task, turn):
            want = task.answer[0] * (2 if turn else 1)
            return float(answer == str(want)), {"correct": answer == str(want)}

    env = Doubling(split="train", user=user)
    env.reset(options={"task_id": 1})
    total = env.task.answer[0]
    steps = play(env, [*env.demonstration(env.task)[:3], f"<answer>{2 * total}</answer>"])
    assert seen[0][-1] == "assistant" and steps[2][0][0]["content"].startswith("And the total")
    assert steps[-1][2] and steps[-1][1] == 1.0 and len(seen) == 2
    assert "user_turns" not in steps[2][4]  # a simulated user's turns are not known ahead
    assert steps[-1][4]["user_turns"] == 2  # but counted once it ended the conversation
    with pytest.raises(agentenv.errors.InvalidOptionError, match="user must be a callable"):
        shop.ShopEnv(user="alice")


def test_a_tool_that_raises_is_an_error_observation(shop):
    env = shop.ShopEnv(split="train")
    env.reset(options={"task_id": 0})
    obs, *_, info = env.step(shop.call("remove_item", item="melon", quantity=5))
    assert (
        obs[0]["content"].startswith("Error:") and "the cart holds 0 x melon" in obs[0]["content"]
    )
    assert info["num_tool_errors"] == 1


def test_calls_of_one_message_run_in_order_on_a_stateful_toolset(shop):
    env = shop.ShopEnv(split="train")
    env.reset(options={"task_id": 0})
    calls = [shop.call("add_item", item="plum", quantity=1) for _ in range(6)]
    obs, *_ = env.step("".join(calls) + shop.call("total"))
    assert [m["content"] for m in obs] == [f"{i} x plum in the cart" for i in range(1, 7)] + ["6"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_make_vec_runs_conversations_each_with_its_own_cart(shop, mode):
    envs = gym.make_vec("agentenv/Shop-v0", num_envs=3, vectorization_mode=mode)
    try:
        envs.reset(seed=[0, 1, 2])
        single = shop.ShopEnv(split="train")
        demos = []
        for seed in range(3):
            single.reset(seed=seed)
            demos.append(single.demonstration(single.task))
        for turn in range(5):
            obs, reward, terminated, truncated, info = envs.step([d[turn] for d in demos])
        assert terminated.all() and reward.tolist() == [1.0, 1.0, 1.0]
    finally:
        envs.close()


STRICT = (  # a template that knows system/user/assistant only: tool output as user turns
    "{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("template", [None, STRICT], ids=["smollm2", "strict"])
def test_collected_conversations_are_exact_tokens_with_user_turns_masked(shop, tokenizer, template):
    from agentenv.lm.backend import SamplingConfig
    from agentenv.rollout.collect import ScriptedPolicy, collect
    from agentenv.rollout.config import RolloutConfig
    from agentenv.rollout.episode import ChatFormat

    ref = shop.ShopEnv(split="train")
    ref.reset(seed=5)
    demo = ref.demonstration(ref.task)

    def respond(prompt: str) -> str:
        return demo[prompt.count("<|im_start|>assistant") - 1]

    fmt = ChatFormat(tokenizer, chat_template=template)
    policy = ScriptedPolicy(tokenizer, respond)
    config = RolloutConfig(group_size=2, max_turns=8, sampling=SamplingConfig(96))
    config.show_progress = False
    make = functools.partial(shop.ShopEnv, split="train")
    (group,), _ = collect(make, [5], policy, fmt, config)
    for ep in group:
        assert ep.reward == 1.0 and ep.stop_reason == "terminated" and ep.info["correct"]
        assert ep.turn_rewards == [0.0, 0.0, 1.0, 0.0, 1.0]
        spans = ep.policy_spans()
        texts = [tokenizer.decode(ep.input_ids[s:e], skip_special_tokens=True) for s, e in spans]
        assert texts == demo
        env_text = tokenizer.decode(
            [t for t, m in zip(ep.input_ids, ep.action_mask, strict=True) if not m]
        )
        follow_up = ref.task.metadata["user_turns"][0]
        assert follow_up in env_text and "<tool_call>" not in env_text.split(follow_up)[1]
        assert tokenizer.decode(ep.input_ids) == fmt.render(
            fmt.map_roles(ep.messages)
        ).removesuffix("\n")
        assert [m["role"] for m in ep.messages].count("user") == 2


def test_demonstrations_of_a_conversation_make_sft_episodes(shop, tokenizer):
    from agentenv.rollout.demos import demonstration_episodes
    from agentenv.rollout.episode import ChatFormat

    episodes = demonstration_episodes(
        functools.partial(shop.ShopEnv, split="train"), ChatFormat(tokenizer), 3
    )
    assert [e.reward for e in episodes] == [1.0, 1.0, 1.0]
    assert all(e.num_turns == 5 for e in episodes)


def test_a_conversation_env_must_score_turns():
    class Bare(ConversationEnv):
        num_tasks = 1

        def get_task(self, index):
            return Task("t", "hi", "x", {"user_turns": ["again"]})

    env = Bare()
    env.reset(seed=0)
    with pytest.raises(NotImplementedError, match="Bare must implement score_turn"):
        env.step("<answer>x</answer>")
    assert json.dumps(env.messages)  # the transcript stays plain data
