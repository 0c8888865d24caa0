"""Calculator-v0 ``source="prices"``: shopping problems that take two lookups and the
calculator, their per-turn rewards and their demonstrations."""

from __future__ import annotations

import json
import re

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import agentenv
from envs.calculator import load_tasks, prices


def price_call(item: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'price', 'arguments': {'item': item}})}</tool_call>"


def test_problems_are_deterministic_and_hide_their_prices():
    a, b = prices.generate(40, seed=3), prices.generate(60, seed=3)
    assert a == b[:40] and a != prices.generate(40, seed=4)
    for p in b:
        (x, qx), (y, qy) = p.quantities.items()
        assert p.answer == qx * p.prices[x] + qy * p.prices[y]
        assert p.expression == f"{qx} * {p.prices[x]} + {qy} * {p.prices[y]}"
        assert len(p.prices) == prices.CATALOGUE and {x, y} <= set(p.prices)
        # the question's numbers are the quantities alone: one call cannot price them
        assert [int(n) for n in re.findall(r"\d+", p.question)] == [qx, qy]
        assert f"{qx} {prices.plural(x)}" in p.question


def test_splits_are_disjoint_and_tasks_carry_their_shop():
    train, test = load_tasks("prices", "train"), load_tasks("prices", "test")
    assert len(train) == 2000 and len(test) == 500
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    task = train[0]
    assert set(task.metadata) >= {"prices", "quantities", "expression"}
    assert task.metadata["source"] == "prices"


def test_the_price_tool_knows_the_tasks_shop_and_rewards_each_first_lookup():
    env = agentenv.make("Calculator-v0", source="prices")
    env.reset(options={"task_id": 5})
    task = env.unwrapped.task
    (a, qa), (b, qb) = task.metadata["quantities"].items()
    table = task.metadata["prices"]

    obs, reward, _, _, info = env.step(price_call(prices.plural(a)))  # a miss
    listed = ", ".join(table)
    assert (
        obs[0]["content"] == f"no price for {prices.plural(a)!r} here; this shop prices: {listed}"
    )
    assert info["turn_reward"] == 0.0 and info["prices_found"] == [False, False]
    obs, _, _, _, info = env.step(price_call(f" {a.upper()} "))  # case and spaces ignored
    assert obs[0]["content"] == f"{a}: {table[a]}"
    assert info["turn_reward"] == 0.5 and info["prices_found"] == [True, False]
    obs, _, _, _, info = env.step(price_call(a))  # again: nothing new
    assert info["turn_reward"] == 0.0
    both = price_call(b) + price_call(a)  # two calls in one message
    obs, _, _, _, info = env.step(both)
    assert [m["content"] for m in obs] == [f"{b}: {table[b]}", f"{a}: {table[a]}"]
    assert info["turn_reward"] == 0.5 and info["prices_found"] == [True, True]
    _, reward, terminated, _, info = env.step(f"<answer>{qa * table[a] + qb * table[b]}</answer>")
    assert terminated and reward == 1.0 and info["correct"]
    env.reset(options={"task_id": 5})  # a new episode starts with nothing looked up
    _, _, _, _, info = env.step(price_call(b))
    assert info["prices_found"] == [False, True] and info["turn_reward"] == 0.5


def test_other_sources_have_no_price_tool():
    env = agentenv.make("Calculator-v0", source="word_problems")
    env.reset(seed=0)
    obs, _, _, _, info = env.step(price_call("lantern"))
    assert "unknown" in obs[0]["content"].lower() and "turn_reward" not in info
    assert '"price"' not in env.unwrapped.system_prompt()


def test_check_env_passes():
    check_env(gym.make("agentenv/Calculator-v0", source="prices", num_tasks=20).unwrapped)


def test_demonstrations_look_up_both_prices_some_after_a_miss_and_score_1():
    env = agentenv.make("Calculator-v0", source="prices", num_tasks=300)
    requeried = 0
    for i in range(env.unwrapped.num_tasks):
        env.reset(options={"task_id": i})
        task = env.unwrapped.task
        actions = env.unwrapped.demonstration(task)
        turn_rewards = []
        for action in actions:
            obs, reward, terminated, _, info = env.step(action)
            turn_rewards.append(info.get("turn_reward"))
        assert terminated and reward == 1.0, actions
        assert info["num_tool_calls"] == len(actions) - 1 and info["num_tool_errors"] == 0
        if len(actions) == 5:  # a lookup by the plural that misses, then the two
            requeried += 1
            assert prices.wants_requery(task.id) and turn_rewards == [0.0, 0.5, 0.5, 0.0, 0.0]
        else:
            assert turn_rewards == [0.5, 0.5, 0.0, 0.0]
    assert 0.25 < requeried / env.unwrapped.num_tasks < 0.42


@pytest.mark.parametrize("style", ["compact", "full"])
def test_the_prompts_show_the_price_tool(style):
    env = agentenv.make("Calculator-v0", source="prices", prompt_style=style)
    obs, _ = env.reset(seed=0)
    assert '"name": "price"' in obs[0]["content"] and "calculator" in obs[0]["content"]
