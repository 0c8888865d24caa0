"""Task difficulty pools: counts, retirements and readmissions by hand; the state saved
and resumed bit for bit."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from agentenv.errors import InvalidOptionError
from agentenv.run.config import TrainConfig
from agentenv.run.pools import TaskPool, group_results, solved


def ep(reward: float, **info) -> SimpleNamespace:
    return SimpleNamespace(reward=reward, info=info, failed=info.pop("failed", False))


def test_a_task_retires_after_its_groups_were_all_solved_or_none_and_a_mixed_one_readmits():
    pool = TaskPool(num_tasks=5, retire_after=2)
    pool.update([(0, 4, 4), (1, 4, 0), (2, 4, 2)])
    assert pool.retired == {}  # one group each: not yet
    pool.update([(0, 4, 4), (1, 4, 0), (2, 4, 4)])
    assert pool.retired == {0: "easy", 1: "hard"}  # 2 is at 1 easy group after a mixed one
    assert pool.streak == {0: ("easy", 2), 1: ("hard", 2), 2: ("easy", 1)}
    pool.update([(1, 4, 1)])  # readmitted and mixed: active again
    assert pool.retired == {0: "easy"} and pool.streak[1] == ("", 0)
    assert pool.metrics() == {
        "pools/active": 4.0,
        "pools/retired_easy": 1.0,
        "pools/retired_hard": 0.0,
        "pools/tasks_seen": 3.0,
        "pools/pass_rate": (4 + 0 + 2 + 4 + 0 + 4 + 1) / 28,
    }
    assert pool.groups == {0: 2, 1: 3, 2: 2} and pool.solved == {0: 8, 1: 1, 2: 6}


def test_tasks_are_drawn_from_the_active_ones_and_readmit_shares_the_retired():
    seeds = list(range(400))
    pool = TaskPool(num_tasks=4, readmit=0.0)
    assert sorted(set(pool.task_ids(seeds))) == [0, 1, 2, 3]
    pool.retired = {1: "easy", 3: "hard"}
    assert sorted(set(pool.task_ids(seeds))) == [0, 2]
    assert pool.task_ids(seeds) == pool.task_ids(seeds)  # a pure function of seed and pool
    pool.readmit = 0.25
    picked = pool.task_ids(seeds)
    share = sum(t in (1, 3) for t in picked) / len(seeds)
    assert 0.18 < share < 0.32  # about readmit of them
    pool.retired = dict.fromkeys(range(4), "easy")  # all retired: drawn from those
    assert sorted(set(pool.task_ids(seeds))) == [0, 1, 2, 3]
    assert pool.options([5, 6]) == [{"task_id": t} for t in pool.task_ids([5, 6])]


def test_solved_reads_the_envs_correct_flag_else_a_positive_reward_and_skips_failures():
    assert solved(ep(0.0, correct=True)) and not solved(ep(1.0, correct=False))
    assert solved(ep(0.5)) and not solved(ep(0.0))
    groups = [[ep(1.0), ep(0.0), ep(1.0, failed=True)], [ep(0.0, failed=True)]]
    assert group_results(groups, [7, 8]) == [(7, 2, 1)]  # a group with no valid episode: none


def test_the_pool_state_survives_a_checkpoint_bit_for_bit():
    pool = TaskPool(num_tasks=5)
    pool.update([(0, 4, 4), (0, 4, 4), (3, 2, 1)])
    buffer = io.BytesIO()
    torch.save(pool.state_dict(), buffer)
    buffer.seek(0)
    restored = TaskPool(num_tasks=5)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored == pool
    assert restored.task_ids(range(50)) == pool.task_ids(range(50))
    with pytest.raises(InvalidOptionError, match="covers 5 tasks"):
        TaskPool(num_tasks=6).load_state_dict(pool.state_dict())


def test_pool_settings_are_checked():
    with pytest.raises(InvalidOptionError, match="retire_after must be >= 1"):
        TrainConfig(pools={"retire_after": 0})
    with pytest.raises(InvalidOptionError, match=r"readmit must be in \[0, 1\]"):
        TrainConfig(pools={"readmit": 1.5})
    with pytest.raises(InvalidOptionError, match="use one of the two"):
        TrainConfig(pools={"difficulty_pools": True}, evolution={"population": 2})
