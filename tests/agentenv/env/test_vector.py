"""Gymnasium vector envs over agentenv envs: make_vec in sync and async modes, defaults."""

import copy

import gymnasium as gym
import pytest

import agentenv  # noqa: F401  (registers the bundled envs)
from agentenv.env.spaces import SHARED_MEMORY_BYTES, Messages, SharedMessages

CALC = {"source": "basic_arithmetic", "num_tasks": 20}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_make_vec_runs_the_calculator_with_default_arguments(mode):
    envs = gym.make_vec("agentenv/Calculator-v0", num_envs=3, vectorization_mode=mode, **CALC)
    try:
        obs, _ = envs.reset(seed=[0, 1, 2])
        single = gym.make("agentenv/Calculator-v0", **CALC)
        for i in range(3):  # each env's own task, as a lone env resets to it
            assert list(obs[i]) == single.reset(seed=i)[0]
            assert Messages().contains(list(obs[i]))
        answers = [f"<answer>{k}</answer>" for k in range(3)]
        obs, reward, terminated, truncated, _ = envs.step(answers)
        assert terminated.all() and not truncated.any()
        assert reward.shape == (3,) and set(reward.tolist()) <= {0.0, 1.0}
        single.close()
    finally:
        envs.close()


def test_async_observations_decode_from_shared_memory_and_deepcopy_to_a_tuple():
    import multiprocessing as mp

    from gymnasium.vector.utils import (
        create_shared_memory,
        read_from_shared_memory,
        write_to_shared_memory,
    )

    space = Messages()
    memory = create_shared_memory(space, n=2, ctx=mp)
    view = read_from_shared_memory(space, memory, n=2)
    assert isinstance(view, SharedMessages) and list(view) == [[], []]
    msgs = [{"role": "tool", "content": "héllo ✓\n" * 3}]
    write_to_shared_memory(space, 1, msgs, memory)
    assert view[1] == msgs and view[0] == [] and view[-1] == msgs  # the view follows writes
    assert copy.deepcopy(view) == ([], msgs) and isinstance(copy.deepcopy(view), tuple)
    too_big = [{"role": "tool", "content": "x" * SHARED_MEMORY_BYTES}]
    with pytest.raises(ValueError, match="shared_memory': False"):
        write_to_shared_memory(space, 0, too_big, memory)
