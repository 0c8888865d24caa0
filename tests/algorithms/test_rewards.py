"""Reward combinations by hand, and GRPO learning from a combined reward."""

import math

import pytest
import torch
from toy_episodes import SAMPLING, Ep

from agentenv.errors import InvalidOptionError
from algorithms.config import GRPOConfig
from algorithms.grpo import GRPO
from algorithms.rewards import batch_moments, combine_rewards

X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])


def test_uniform_std_and_l2_by_hand():
    assert combine_rewards(X, "uniform").tolist() == [0.5, 0.5, 1.0, 0.0]
    assert combine_rewards(X, "l2").tolist() == pytest.approx([1, 1, math.sqrt(2), 0])
    # each column: mean 0.5, population std 0.5 -> x / 0.5, summed
    assert combine_rewards(X, "std").tolist() == pytest.approx([2, 2, 4, 0])


def test_pca_projects_on_the_main_direction_by_hand():
    x = torch.tensor([[2.0, 1.0], [0.0, 0.0], [1.0, 0.5], [3.0, 1.5]])  # column 2 = column 1 / 2
    # covariance of rank 1 along (2, 1) / sqrt(5); centred rows (0.5, 0.25), (-1.5, -0.75), ...
    expected = [1.25, -3.75, -1.25, 3.75]
    got = combine_rewards(x, "pca").tolist()
    assert got == pytest.approx([v / math.sqrt(5) for v in expected])


def test_pca_sign_follows_the_sum_of_components():
    c1 = torch.tensor([2.0, 0.0, 1.0, 3.0])
    x = torch.stack([c1, -c1 / 4], dim=1)  # anti-correlated; their sum (3/4 c1) grows with c1
    score = combine_rewards(x, "pca")
    total = x.sum(-1)
    assert ((score - score.mean()) * (total - total.mean())).sum() > 0
    assert combine_rewards(-x, "pca").tolist() == pytest.approx((-score).tolist())


def test_a_zero_variance_component_contributes_nothing():
    x = torch.tensor([[1.0, 5.0], [0.0, 5.0], [1.0, 5.0], [0.0, 5.0]])
    assert combine_rewards(x, "std").tolist() == pytest.approx([2, 0, 2, 0])
    assert combine_rewards(x, "pca").tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])
    constant = torch.full((3, 2), 7.0)
    assert combine_rewards(constant, "pca").tolist() == [0.0, 0.0, 0.0]
    assert combine_rewards(constant, "std").tolist() == [0.0, 0.0, 0.0]


def test_given_moments_replace_the_local_ones():
    mean, cov = batch_moments(X)
    assert mean.tolist() == [0.5, 0.5] and cov.tolist() == [[0.25, 0.0], [0.0, 0.25]]
    wide = combine_rewards(X, "std", mean=mean, cov=cov * 4)  # a global batch with std 1
    assert wide.tolist() == pytest.approx([1, 1, 2, 0])


def test_bad_input_names_the_choices():
    with pytest.raises(InvalidOptionError, match="method='sum'"):
        combine_rewards(X, "sum")
    with pytest.raises(InvalidOptionError, match="reward_combination"):
        GRPOConfig(reward_combination="sum")


def episodes(components: list[dict[str, float]], reward: float = 1.0) -> list[Ep]:
    mask = [0, 0, 0, 1, 1, 1, 0, 1]
    return [
        Ep(
            [100 + 7 * i + t for t in range(8)],
            mask,
            [-9.0 * m for m in mask],
            reward,
            {"reward_components": c},
        )
        for i, c in enumerate(components)
    ]


def test_grpo_learns_from_combined_components(tiny_model, tokenizer):
    group = episodes([{"answer": 1, "format": 1}, {"answer": 0, "format": 1}, {"format": 0}])
    weighted = GRPO(tiny_model, tokenizer, GRPOConfig(learning_rate=1e-3), sampling=SAMPLING)
    metrics = weighted.learn([group])  # the env's rewards are equal: nothing to learn
    assert metrics["frac_reward_zero_std"] == 1.0 and metrics["grad_norm"] == 0.0
    assert metrics["rewards/components/answer"] == pytest.approx(1 / 3)
    assert metrics["rewards/components/format"] == pytest.approx(2 / 3)

    uniform = GRPO(
        tiny_model,
        tokenizer,
        GRPOConfig(learning_rate=1e-3, reward_combination="uniform"),
        sampling=SAMPLING,
    )
    metrics = uniform.learn([group])  # rewards (1, 0.5, 0): a learning signal
    assert metrics["rewards/mean"] == pytest.approx(0.5)
    assert metrics["frac_reward_zero_std"] == 0.0 and metrics["grad_norm"] > 0
