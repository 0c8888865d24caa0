"""Turn-level credit (``GRPOConfig.credit="turn"``): per-turn advantages by hand, their
tokens, and learn() with them; the bandit default untouched."""

from __future__ import annotations

import math

import pytest
import torch
from toy_episodes import SAMPLING, make_groups

from agentenv.errors import InvalidOptionError
from agentenv.rollout.episode import mask_spans
from algorithms.batching import token_advantages
from algorithms.config import GRPOConfig
from algorithms.grpo import GRPO
from algorithms.losses import policy_loss, shaped_rewards, turn_advantages, turn_return_spread

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def config(**overrides) -> GRPOConfig:
    base = {"learning_rate": 1e-3, "lora_r": 4, "lora_alpha": 8}
    return GRPOConfig(**{**base, **overrides})


# A group of 3: member 0 takes 3 turns, its second without reward; member 1 failed (its
# env raised) after 3 turns; member 2 was truncated after 2 turns.
TURN_REWARDS = [[[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [0.0, 1.0]]]
VALID = torch.tensor([[True, False, True]])
OUTCOME = torch.tensor([[0.5, 0.0, -0.5]])  # (B, G): compute_advantages' (failed: 0)


def test_turn_advantages_by_hand_with_one_baseline_per_group():
    """gamma 0.5: member 0's returns 1 + 0.5 (0 + 0.5 1) = 1.25, 0 + 0.5 1 = 0.5, 1;
    member 2's 0.5, 1. The valid members' 5 returns: mean 0.85, population std 0.3
    (deviations 0.4, -0.35, 0.15, -0.35, 0.15). Weight 2: + 2 (G - 0.85) / 0.3."""
    got = turn_advantages(OUTCOME, TURN_REWARDS, VALID, weight=2.0, gamma=0.5, eps=0.0)
    expected = [[0.5 + 8 / 3, 0.5 - 7 / 3, 0.5 + 1.0], [0.0] * 3, [-0.5 - 7 / 3, -0.5 + 1.0]]
    assert len(got) == 1 and [len(a) for a in got[0]] == [3, 3, 2]
    for a, e in zip(got[0], expected, strict=True):
        assert a == pytest.approx(e, abs=1e-12)
    flat = turn_advantages(OUTCOME, TURN_REWARDS, VALID, 2.0, 0.5, "mean_only")
    assert flat[0][0] == pytest.approx([0.5 + 0.8, 0.5 - 0.7, 0.5 + 0.3])
    assert flat[0][2] == pytest.approx([-0.5 - 0.7, -0.5 + 0.3])
    # eps as in compute_advantages: the std plus 1e-4
    default = turn_advantages(OUTCOME, TURN_REWARDS, VALID, 2.0, 0.5)
    assert default[0][0][0] == pytest.approx(0.5 + 2 * 0.4 / (0.3 + 1e-4))


def test_undiscounted_returns_and_a_turn_weight_of_zero_give_the_outcome():
    """gamma 1: member 0's returns 2, 1, 1 and member 2's 1, 1 (mean 1.2, std 0.4)."""
    got = turn_advantages(OUTCOME, TURN_REWARDS, VALID, weight=1.0, gamma=1.0, eps=0.0)
    assert got[0][0] == pytest.approx([0.5 + 2.0, 0.5 - 0.5, 0.5 - 0.5])
    assert got[0][2] == pytest.approx([-0.5 - 0.5, -0.5 - 0.5])
    zero = turn_advantages(OUTCOME, TURN_REWARDS, VALID, weight=0.0)
    assert zero[0] == [[0.5] * 3, [0.0] * 3, [-0.5] * 2]


def test_a_group_whose_returns_are_all_equal_gets_no_turn_term():
    rewards = [[[0.0, 1.0], [0.0, 0.0, 1.0], [7.0]], [[0.0], [1.0], [0.0]]]
    valid = torch.tensor([[True, True, False], [True, True, True]])
    outcome = torch.tensor([[0.25, -0.25, 0.0], [0.0, 0.0, 0.0]])
    got = turn_advantages(outcome, rewards, valid, weight=3.0, gamma=1.0)
    assert got[0] == [[0.25, 0.25], [-0.25, -0.25, -0.25], [0.0]]  # returns all 1
    assert got[1][1][0] > 0 > got[1][0][0] == got[1][2][0]
    assert turn_return_spread(rewards, valid, 1.0).tolist() == [False, True]
    same = [[[1.0, 0.0], [1.0, 0.0]]]  # returns differ only from one turn to the next
    assert turn_return_spread(same, torch.ones(1, 2, dtype=torch.bool), 1.0).tolist() == [True]
    with pytest.raises(InvalidOptionError, match="norm must be one of"):
        turn_advantages(outcome, rewards, valid, 1.0, norm="median")


def test_leave_one_out_baselines_by_hand():
    """gamma 0.5: member 0's returns 1.25, 0.5, 1 and member 2's 0.5, 1 (member 1 failed).
    Member 0's baseline is member 2's mean 0.75, member 2's member 0's mean 2.75 / 3;
    nothing is divided. Weight 2."""
    got = turn_advantages(OUTCOME, TURN_REWARDS, VALID, 2.0, 0.5, baseline="loo")
    assert got[0][0] == pytest.approx([0.5 + 2 * 0.5, 0.5 - 2 * 0.25, 0.5 + 2 * 0.25])
    assert got[0][1] == [0.0] * 3
    assert got[0][2] == pytest.approx([-0.5 + 2 * (0.5 - 2.75 / 3), -0.5 + 2 * (1 - 2.75 / 3)])
    # the same under mean_only: the leave-one-out term has no std to divide by
    assert (
        turn_advantages(OUTCOME, TURN_REWARDS, VALID, 2.0, 0.5, "mean_only", baseline="loo") == got
    )


def test_a_pool_of_two_keeps_the_size_of_its_difference_only_with_leave_one_out():
    outcome, valid = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    for gap in (0.5, 0.01):
        rewards = [[[gap], [0.0]]]
        group = turn_advantages(outcome, rewards, valid, 1.0, eps=0.0)
        loo = turn_advantages(outcome, rewards, valid, 1.0, baseline="loo")
        assert group[0] == [[pytest.approx(1.0)], [pytest.approx(-1.0)]]  # whatever the gap
        assert loo[0] == [[pytest.approx(gap)], [pytest.approx(-gap)]]
    # a member whose only other member failed has no one to be compared with
    alone = turn_advantages(outcome, [[[1.0], [0.0]]], torch.tensor([[True, False]]), 1.0,
                            baseline="loo")  # fmt: skip
    assert alone[0] == [[0.0], [0.0]]
    with pytest.raises(InvalidOptionError, match="baseline must be one of"):
        turn_advantages(outcome, [[[1.0], [0.0]]], valid, 1.0, baseline="index")


def test_shaped_rewards_add_the_weighted_return_from_the_first_turn():
    outcome = torch.tensor([[1.0, 0.0, 0.0]])
    turns = [[[0.5, 0.5], [0.5], []]]  # the last episode took no rewarded turn
    assert shaped_rewards(outcome, turns, 1.0).tolist() == [[2.0, 0.5, 0.0]]
    assert shaped_rewards(outcome, turns, 2.0, gamma=0.5).tolist() == [[2.5, 1.0, 0.0]]
    assert shaped_rewards(outcome, turns, 0.0) is outcome  # the bandit default: untouched


def test_turn_weight_none_means_one_under_turn_credit_and_zero_under_the_bandit():
    assert GRPOConfig().turn_reward_weight == 0.0
    assert GRPOConfig(credit="turn").turn_reward_weight == 1.0
    assert GRPOConfig(credit="gae").turn_reward_weight == 1.0
    assert GRPOConfig(credit="gae", turn_weight=0.0).turn_reward_weight == 0.0
    assert GRPOConfig(turn_weight=0.5).turn_reward_weight == 0.5


def test_token_advantages_put_each_turns_value_on_its_tokens():
    spans = [[(2, 4), (6, 7)], [(1, 2)]]
    out = token_advantages(spans, [[0.5, -1.0], [2.0]], width=8)
    assert out.tolist() == [
        [0, 0, 0.5, 0.5, 0, 0, -1.0, 0],
        [0, 2.0, 0, 0, 0, 0, 0, 0],
    ]


def test_per_token_advantages_equal_to_the_sequences_give_the_same_loss_bitwise():
    torch.manual_seed(0)
    logp = torch.randn(3, 6, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(3, 6)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0]])
    adv = torch.tensor([0.7, -1.2, 0.3])
    for loss_type in ("grpo", "dapo", "dr_grpo", "gspo", "cispo"):
        cfg = config(loss_type=loss_type)
        a, ma = policy_loss(logp, old, adv, mask, cfg)
        b, mb = policy_loss(logp, old, adv[:, None].expand(3, 6).clone(), mask, cfg)
        assert torch.equal(a, b) and ma == mb, loss_type


def two_turn_groups(rewards, turn_rewards):
    """make_groups' episodes (two policy turns each) with per-turn rewards."""
    groups = make_groups(rewards, seed=4)
    for group, turns in zip(groups, turn_rewards, strict=True):
        for episode, values in zip(group, turns, strict=True):
            episode.turn_rewards = values
    return groups


def test_turn_credit_trains_each_turns_tokens_with_its_advantage(tokenizer, monkeypatch):
    """The loss sees, on each turn's tokens, that turn's advantage; a group whose outcomes
    are equal but whose turns' rewards differ is trained (bandit: skipped)."""
    from agentenv.lm.models import tiny_model as build
    from algorithms import grpo

    groups = two_turn_groups(
        [[0, 1, 1, 0], [1, 1, 1, 1]],
        [[[1, 0], [0, 0], [1, 1], [0, 1]], [[0, 0], [1, 0], [0, 0], [0, 0]]],
    )
    seen = []
    real = grpo.policy_loss
    monkeypatch.setattr(
        grpo, "policy_loss", lambda *a, **k: seen.append((a[2], a[3])) or real(*a, **k)
    )
    trainer = GRPO(build(tokenizer), tokenizer, config(credit="turn"), sampling=SAMPLING)
    metrics = trainer.learn(groups)
    # the second group's outcomes are equal, its turns' returns are not: it has a signal
    assert metrics["frac_reward_zero_std"] == 0.5 and metrics["frac_no_signal"] == 0.0
    # By hand (weight 1, gamma 1, eps 1e-4). Group 0's outcomes 0 1 1 0: +-0.5 / (0.5 +
    # eps); its returns [1, 0], [0, 0], [2, 1], [1, 1]: mean 0.75, std sqrt(3.5 / 8).
    # Group 1's outcomes all 1 (advantage 0); its returns [0, 0], [1, 0], [0, 0], [0, 0]:
    # mean 0.125, std sqrt(0.125 x 0.875).
    o = 0.5 / (0.5 + 1e-4)
    s0, s1 = math.sqrt(3.5 / 8) + 1e-4, math.sqrt(0.125 * 0.875) + 1e-4
    expected = [
        [-o + 0.25 / s0, -o - 0.75 / s0],
        [o - 0.75 / s0, o - 0.75 / s0],
        [o + 1.25 / s0, o + 0.25 / s0],
        [-o + 0.25 / s0, -o + 0.25 / s0],
        [-0.125 / s1] * 2,
        [0.875 / s1, -0.125 / s1],
        [-0.125 / s1] * 2,
        [-0.125 / s1] * 2,
    ]
    assert len(trainer.last_turn_advantages) == 8
    for got, want in zip(trainer.last_turn_advantages, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5)  # the outcome advantages are float32
    assert trainer.last_advantages[1].tolist() == [0.0] * 4  # outcomes all 1
    trained = []  # each trained row's advantages on its policy tokens
    for adv, mask in seen:
        assert adv.shape == mask.shape  # (N, T)
        for a, m in zip(adv, mask, strict=True):
            trained.append(tuple(round(v, 5) for v in a[m.bool()].tolist()))
    episodes = [e for g in groups for e in g]
    for episode, per_turn in zip(episodes, trainer.last_turn_advantages, strict=True):
        spans = mask_spans(episode.action_mask)
        assert len(spans) == len(per_turn) == 2
        values = [v for (s, e), v in zip(spans, per_turn, strict=True) for _ in range(e - s)]
        assert tuple(round(v, 5) for v in values) in trained
    assert len(trained) == 8  # both groups trained (no padding micro-batch here)


def test_the_bandit_default_trains_each_sequence_with_its_group_advantage_bitwise(
    tokenizer, monkeypatch
):
    """What the code before per-turn credit trained (aaf4b63^: ``flat[idx]`` per micro-
    batch): one advantage per sequence ``(N,)``, bit for bit ``(r - mean) / (std + 1e-4)``
    of its group, computed in float32; the group whose rewards are equal is dropped even
    though its turns' rewards differ."""
    from agentenv.lm.models import tiny_model as build
    from algorithms import grpo

    groups = two_turn_groups(
        [[0, 1, 1, 0], [1, 1, 1, 1]],
        [[[1, 0], [0, 0], [1, 1], [0, 1]], [[0, 0], [1, 0], [0, 0], [0, 0]]],
    )
    seen = []
    real = grpo.policy_loss
    monkeypatch.setattr(grpo, "policy_loss", lambda *a, **k: seen.append(a[2]) or real(*a, **k))
    trainer = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    assert trainer.config.credit == "bandit"
    trainer.learn(groups)
    r = torch.tensor([0.0, 1.0, 1.0, 0.0])
    want = (r - r.mean()) / (r.std(correction=0) + 1e-4)  # (G,) float32
    assert torch.equal(trainer.last_advantages[0], want)
    assert torch.equal(trainer.last_advantages[1], torch.zeros(4))
    assert trainer.last_turn_advantages is None
    trained = torch.cat([a for a in seen if a.numel()])
    assert all(a.dim() == 1 for a in seen)  # one value per sequence, not per token
    assert sorted(trained.tolist()) == sorted(want.tolist())  # group 1 dropped, exactly


def test_turn_credit_with_a_turn_weight_of_zero_is_the_bandit_update(tokenizer):
    from agentenv.lm.models import tiny_model as build

    groups = two_turn_groups([[0, 1, 1, 0]], [[[1, 0], [0, 0], [1, 1], [0, 1]]])
    bandit = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    turn = GRPO(
        build(tokenizer), tokenizer, config(credit="turn", turn_weight=0.0), sampling=SAMPLING
    )
    mb, mt = bandit.learn(groups), turn.learn(groups)
    assert mb["loss"] == mt["loss"] and mb["grad_norm"] == mt["grad_norm"]
    for a, b in zip(bandit.model.parameters(), turn.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert bandit.last_turn_advantages is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"credit": "gae2"}, "credit must be one of"),
        ({"turn_weight": -1.0}, "turn_weight must be None or >= 0"),
        ({"turn_baseline": "index"}, "turn_baseline must be one of"),
        ({"turn_gamma": 1.5}, r"turn_gamma must be in \[0, 1\]"),
    ],
)
def test_credit_options_are_checked(kwargs, message):
    with pytest.raises(InvalidOptionError, match=message):
        GRPOConfig(**kwargs)


# Group 0: outcomes equal, per-turn rewards differ; group 1: outcomes differ; group 2:
# outcomes and per-turn rewards equal between the members; group 3: one valid member.
SIGNAL_REWARDS = [[1, 1], [0, 1], [0, 0], [1, 0]]
SIGNAL_TURNS = [[[0.5, 0], [0, 0]], [[0, 0], [0, 0]], [[0.5, 0], [0.5, 0]], [[0.5, 0], [0, 0]]]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, [False, True, False, False]),
        ({"turn_weight": 1.0}, [True, True, False, False]),  # bandit + shaping
        # returns 0.5 then 0 differ from turn to turn: the turn baselines credit them
        ({"credit": "turn"}, [True, True, True, True]),
        ({"credit": "turn", "turn_weight": 0.0}, [False, True, False, False]),
        ({"credit": "turn", "turn_baseline": "loo"}, [True, True, True, False]),
        ({"credit": "gae"}, [True, True, True, True]),
        ({"credit": "gae", "turn_weight": 0.0}, [False, True, False, False]),
    ],
)
def test_group_signal_is_the_decision_learn_drops_groups_by(tokenizer, overrides, expected):
    from agentenv.lm.models import tiny_model as build

    groups = two_turn_groups(SIGNAL_REWARDS, SIGNAL_TURNS)
    for episode in groups[3][1:]:
        episode.failed = True
    trainer = GRPO(build(tokenizer), tokenizer, config(**overrides), sampling=SAMPLING)
    assert trainer.group_signal(groups) == expected
    metrics = trainer.learn(groups)
    assert metrics["frac_no_signal"] == expected.count(False) / 4
    if trainer.config.credit != "gae":  # the groups learn() trained: those with a signal
        trained = [bool(a.abs().sum()) for a in trainer.last_advantages]
        if trainer.last_turn_advantages is not None:
            per_turn = trainer.last_turn_advantages
            trained = [any(any(t) for t in per_turn[2 * b : 2 * b + 2]) for b in range(4)]
        assert trained == expected


def test_bandit_shaping_trains_on_the_outcome_plus_the_weighted_turn_rewards(tokenizer):
    """turn_weight 1 under bandit: group 0's rewards 1 + 0.5 and 1 + 0 (the outcome alone
    ties), so +-1 after the group's mean and std; group 2's 0 + 0.5 each: no signal."""
    from agentenv.lm.models import tiny_model as build

    groups = two_turn_groups(SIGNAL_REWARDS[:3], SIGNAL_TURNS[:3])
    trainer = GRPO(build(tokenizer), tokenizer, config(turn_weight=1.0), sampling=SAMPLING)
    metrics = trainer.learn(groups)
    r = torch.tensor([1.5, 1.0])
    assert torch.equal(trainer.last_advantages[0], (r - r.mean()) / (r.std(correction=0) + 1e-4))
    assert trainer.last_advantages[2].tolist() == [0.0, 0.0]
    assert metrics["rewards/mean"] == pytest.approx(0.5)  # the outcome, as logged elsewhere
    assert metrics["frac_reward_zero_std"] == pytest.approx(2 / 3)  # outcomes tie in 0 and 2


def test_turn_rewards_when_terminated_counts_only_episodes_the_env_ended(tokenizer):
    """bandit, turn_weight 1. Group 0: outcomes 0, 0 and per-turn rewards 0.5 each, but
    member 1 ran out of turns: always ties (0.5, 0.5: no signal); terminated gives 0.5
    and 0, so +-1 after the mean and std. Group 1: outcomes 1, 0 with member 1 cut at the
    token limit after earning 1.0 of per-turn rewards: always 1.5 vs 1.0, terminated 1.5
    vs 0. An episode without a stop_reason (or an empty one) counts as ended by its env."""
    from agentenv.lm.models import tiny_model as build

    groups = two_turn_groups([[0, 0], [1, 0]], [[[0.5, 0], [0, 0.5]], [[0.5, 0], [0.5, 0.5]]])
    groups[0][0].stop_reason = ""
    groups[0][1].stop_reason = "max_turns"
    groups[1][0].stop_reason = "terminated"
    groups[1][1].stop_reason = "max_tokens"

    def mean_std(values: list[float]) -> torch.Tensor:
        r = torch.tensor(values)
        return (r - r.mean()) / (r.std(correction=0) + 1e-4)

    always = GRPO(build(tokenizer), tokenizer, config(turn_weight=1.0), sampling=SAMPLING)
    assert always.group_signal(groups) == [False, True]
    always.learn(groups)
    assert always.last_advantages[0].tolist() == [0.0, 0.0]
    assert torch.equal(always.last_advantages[1], mean_std([1.5, 1.0]))

    cfg = config(turn_weight=1.0, turn_rewards_when="terminated")
    terminated = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    assert terminated.group_signal(groups) == [True, True]
    metrics = terminated.learn(groups)
    assert torch.equal(terminated.last_advantages[0], mean_std([0.5, 0.0]))
    assert torch.equal(terminated.last_advantages[1], mean_std([1.5, 0.0]))
    assert metrics["rewards/mean"] == pytest.approx(0.25)  # the outcome, as logged elsewhere

    # turn credit: the cut member's turns return 0 and 0, the ended one's 0.5 and 0
    cfg = config(credit="turn", turn_rewards_when="terminated", advantage_norm="mean_only")
    turn = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    turn.learn(groups[:1])
    assert turn.last_turn_advantages == [[0.375, -0.125], [-0.125, -0.125]]


def test_turn_rewards_when_names_its_choices():
    with pytest.raises(InvalidOptionError, match=r"turn_rewards_when must be one of.*'sometimes'"):
        config(turn_rewards_when="sometimes")
