"""GRPO: advantages, the four losses by hand, masks and clipping, log-probs, learn()."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from toy_episodes import SAMPLING, Ep, make_groups

from agentenv.errors import InvalidOptionError
from algorithms.batching import MicroBatch, pack_micro_batches, pack_prefix_trees
from algorithms.config import GRPO_MICRO_BATCH_TOKENS, GRPOConfig, SFTConfig
from algorithms.grpo import GRPO
from algorithms.logprobs import selective_log_softmax, token_logprobs
from algorithms.losses import compute_advantages, kl_estimate, policy_loss
from algorithms.prefix_tree import PrefixTree

LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
METRIC_KEYS = {
    "loss",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "advantages/mean",
    "advantages/std",
    "rewards/mean",
    "rewards/std",
    "frac_reward_zero_std",
    "frac_no_signal",
    "frac_failed",
    "trainable_ratio",
    "entropy",
    "grad_norm",
    "tokens_per_second",
    "learning_rate",
    "num_sequences",
    "step",
    "sampler/logprob_abs_diff_mean",
}
KL_REWARD_KEYS = {"rewards/kl_penalty_mean"}


# peft 0.21 reads a property transformers 5.23 deprecated; nothing for us to act on
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def config(**overrides) -> GRPOConfig:
    base = {"learning_rate": 1e-3, "lora_r": 4, "lora_alpha": 8}
    return GRPOConfig(**{**base, **overrides})


def snapshot(module: torch.nn.Module, trainable: bool | None = None) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().clone()
        for name, p in module.named_parameters()
        if trainable is None or p.requires_grad == trainable
    }


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Bitwise equal on a CPU. On a GPU up to float rounding: GPU kernels are not bitwise
    reproducible run to run (backward passes accumulate with atomics); on an H200 the two
    updates of a test below differed in the last bits."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if pa.device.type == "cpu":
            assert torch.equal(pa, pb), name
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------- advantages


def test_advantages_by_hand_for_both_norms():
    rewards = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 0.0, 1.0]])
    # group 0: mean 1.5, population std sqrt((2.25 + 0.25 + 0.25 + 2.25) / 4) = sqrt(1.25)
    # group 1: mean 0.5, population std 0.5
    std0, std1, eps = math.sqrt(1.25), 0.5, 1e-4
    expected_std = torch.tensor(
        [
            [-1.5 / (std0 + eps), -0.5 / (std0 + eps), 0.5 / (std0 + eps), 1.5 / (std0 + eps)],
            [0.5 / (std1 + eps), -0.5 / (std1 + eps), -0.5 / (std1 + eps), 0.5 / (std1 + eps)],
        ]
    )
    expected_mean = torch.tensor([[-1.5, -0.5, 0.5, 1.5], [0.5, -0.5, -0.5, 0.5]])
    torch.testing.assert_close(compute_advantages(rewards, "mean_std"), expected_std)
    torch.testing.assert_close(compute_advantages(rewards, "mean_only"), expected_mean)


@pytest.mark.parametrize("norm", ["mean_std", "mean_only"])
def test_zero_variance_group_gets_exactly_zero(norm):
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [0.0, 1.0, 0.0]])
    advantages = compute_advantages(rewards, norm)
    assert torch.equal(advantages[:2], torch.zeros(2, 3))
    assert (advantages[2] != 0).all()


def test_median_and_global_baselines_and_reward_clip_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 2.0, 7.0], [1.0, 1.0, 1.0, 1.0]])
    # median of (0, 1, 2, 7) = (1 + 2) / 2 = 1.5; the zero-variance group gets 0
    median = compute_advantages(rewards, "mean_only", baseline="group_median")
    torch.testing.assert_close(median, torch.tensor([[-1.5, -0.5, 0.5, 5.5], [0.0] * 4]))
    std0 = math.sqrt(((0 - 2.5) ** 2 + (1 - 2.5) ** 2 + (2 - 2.5) ** 2 + (7 - 2.5) ** 2) / 4)
    scaled = compute_advantages(rewards, "mean_std", baseline="group_median")
    torch.testing.assert_close(scaled[0], torch.tensor([-1.5, -0.5, 0.5, 5.5]) / (std0 + 1e-4))
    # global mean of all 8 rewards: 14 / 8 = 1.75; every group keeps a signal
    flat = compute_advantages(rewards, "mean_only", baseline="global_mean")
    torch.testing.assert_close(flat, rewards - 1.75)
    var = (0 + 1 + 4 + 49 + 4) / 8 - 1.75**2  # E[r^2] - mean^2 = 4.1875
    scaled = compute_advantages(rewards, "mean_std", baseline="global_mean")
    torch.testing.assert_close(scaled, (rewards - 1.75) / (math.sqrt(var) + 1e-4))
    given = compute_advantages(rewards, "mean_std", baseline="global_mean", batch_mean_std=(1, 2))
    torch.testing.assert_close(given, (rewards - 1) / (2 + 1e-4))


def test_failed_members_get_zero_and_leave_the_group_statistics_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 9.0, 3.0], [1.0, 5.0, 1.0, 1.0], [2.0, 0.0, 4.0, 4.0]])
    valid = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    # group 0, valid (0, 1, 3): mean 4/3, population std sqrt((16 + 1 + 25) / 9 / 3)
    # group 1, valid (1, 1, 1): no variance left -> 0; group 2: one valid member -> 0
    mean0 = 4 / 3
    std0 = math.sqrt(((0 - mean0) ** 2 + (1 - mean0) ** 2 + (3 - mean0) ** 2) / 3)
    want = torch.tensor([[0 - mean0, 1 - mean0, 0.0, 3 - mean0], [0.0] * 4, [0.0] * 4])
    got = compute_advantages(rewards, "mean_only", valid=valid)
    torch.testing.assert_close(got, want)
    scaled = compute_advantages(rewards, "mean_std", valid=valid)
    torch.testing.assert_close(scaled, want / (std0 + 1e-4))
    # the median of (0, 1, 3) is 1
    median = compute_advantages(rewards, "mean_only", baseline="group_median", valid=valid)
    torch.testing.assert_close(median[0], torch.tensor([-1.0, 0.0, 0.0, 2.0]))
    # global mean over the 7 valid rewards: (0 + 1 + 3 + 1 + 1 + 1 + 4) / 7 = 11 / 7
    flat = compute_advantages(rewards, "mean_only", baseline="global_mean", valid=valid)
    torch.testing.assert_close(flat, (rewards - 11 / 7).masked_fill(~valid, 0.0))
    # all valid: exactly the unmasked advantages
    for norm in ("mean_std", "mean_only"):
        everyone = torch.ones_like(valid)
        torch.testing.assert_close(
            compute_advantages(rewards, norm, valid=everyone), compute_advantages(rewards, norm)
        )
    with pytest.raises(InvalidOptionError, match="valid must be a bool tensor"):
        compute_advantages(rewards, valid=valid[:2])


@pytest.mark.parametrize("norm", ["mean_std", "mean_only"])
@pytest.mark.parametrize("baseline", ["group_mean", "group_median"])
def test_a_group_with_failed_members_gets_the_bits_of_the_group_without_them(norm, baseline):
    """Bitwise, not up to rounding: summing a group's rewards with its failed members as
    zeros is the same sum in exact arithmetic, but kernels add in another order (masked sums
    differed from the smaller group in the last bit for most random groups)."""
    g = torch.Generator().manual_seed(0)
    for size in range(3, 17):
        for _ in range(5):
            rewards = torch.randn(2, size, generator=g) * 10.0 ** torch.randint(-3, 3, (2, 1))
            valid = torch.rand(2, size, generator=g) > 0.3
            valid[:, :2] = True  # at least 2 valid members per group
            valid[1, -1] = False  # at least one failed
            got = compute_advantages(rewards, norm, baseline=baseline, valid=valid)
            for row in range(2):
                alone = rewards[row, valid[row]].unsqueeze(0)  # (1, n)
                want = compute_advantages(alone, norm, baseline=baseline)[0]
                assert torch.equal(got[row, valid[row]], want), (size, rewards[row], valid[row])
                assert (got[row, ~valid[row]] == 0).all()


def trained_advantages(trainer: GRPO, groups: list[list[Ep]]) -> list[float | None]:
    """One ``learn`` step; each episode's advantage as its micro-batch carried it into the
    loss (``None``: the episode was in no micro-batch, i.e. dropped)."""
    seen: dict[tuple[int, ...], float] = {}
    optimize = trainer._optimize

    def spy(batches, totals):  # noqa: ANN001, ANN202
        for mb in batches:
            for ids, attn, adv in zip(mb.input_ids, mb.attention_mask, mb.advantages, strict=True):
                seen[tuple(ids[attn.bool()].tolist())] = adv.item()
        return optimize(batches, totals)

    trainer._optimize = spy
    trainer.learn(groups)
    return [seen.get(tuple(ep.input_ids)) for group in groups for ep in group]


def test_reward_clip_comes_before_the_baseline(tiny_model, tokenizer):
    rewards = [[0.0, 1.0, 2.0, 7.0], [1.0, 1.0, 1.0, 1.0]]
    trainer = GRPO(
        tiny_model,
        tokenizer,
        config(reward_clip=1.0, advantage_norm="mean_only"),
        sampling=SAMPLING,
    )
    got = trained_advantages(trainer, make_groups(rewards))
    # clipped to [-1, 1]: (0, 1, 1, 1), mean 0.75; the zero-variance group is dropped
    assert got[:4] == pytest.approx([-0.75, 0.25, 0.25, 0.25])
    assert got[4:] == [None] * 4
    torch.testing.assert_close(
        trainer.last_advantages, torch.tensor([[-0.75, 0.25, 0.25, 0.25], [0.0] * 4])
    )


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"advantage_baseline": "group_median", "advantage_norm": "mean_only"},
        {"advantage_baseline": "global_mean"},
        {"reward_clip": 0.5},
        {"reward_combination": "uniform"},
        {"reward_combination": "std"},
        {"reward_combination": "pca"},
        {"reward_combination": "l2", "advantage_norm": "mean_only"},
        {"beta": 0.1, "kl_placement": "reward", "use_lora": False},
        {"beta": 0.1, "kl_placement": "loss"},
    ],
    ids=["default", "median", "global", "clip", "uniform", "std", "pca", "l2", "kl-reward", "kl"],
)
def test_last_advantages_are_the_ones_the_loss_trained_on(tokenizer, cfg):
    """What the training loop logs (``last_advantages``) equals what each micro-batch
    carried into the loss, for every baseline, clip, reward combination and KL placement;
    episodes left out of the loss (zero-variance groups) have 0."""
    from agentenv.lm.models import tiny_model as build

    groups = make_groups([[0, 1, 1, 0], [1, 1, 1, 1], [0.5, 0, 2, 1]])
    for i, ep in enumerate(ep for group in groups for ep in group):
        ep.info = {"reward_components": {"answer": ep.reward, "format": float(i % 3 == 0)}}
    trainer = GRPO(build(tokenizer), tokenizer, config(**cfg), sampling=SAMPLING)
    trainer.learn(groups)  # a second step: with beta, the policy has moved off the reference
    got = trained_advantages(trainer, groups)
    logged = trainer.last_advantages.flatten().tolist()
    assert sum(a is not None for a in got) >= 8 and any(logged)
    for want, have in zip(got, logged, strict=True):
        assert have == (0.0 if want is None else want)
    if cfg.get("kl_placement") == "reward":  # the penalty moved them off the env's rewards
        plain = compute_advantages(torch.tensor([[ep.reward for ep in g] for g in groups]))
        assert not torch.allclose(trainer.last_advantages, plain)


def test_advantages_reject_bad_input():
    with pytest.raises(InvalidOptionError, match="norm='median'"):
        compute_advantages(torch.zeros(2, 3), "median")
    with pytest.raises(InvalidOptionError, match=r"shape \(6,\)"):
        compute_advantages(torch.zeros(6))
    with pytest.raises(InvalidOptionError, match="baseline='mode'"):
        compute_advantages(torch.zeros(2, 3), baseline="mode")


# ---------------------------------------------------------------- config


def test_config_defaults_and_lr_resolution():
    assert GRPOConfig().learning_rate == 5e-5
    assert GRPOConfig(use_lora=False).learning_rate == 1e-5
    assert GRPOConfig(learning_rate=3e-4).learning_rate == 3e-4
    assert GRPOConfig().loss_type == "dapo"
    fields = GRPOConfig.__dataclass_fields__.values()
    assert all(f.metadata.get("help") for f in fields)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "ppo"}, "loss_type must be one of .*'ppo'"),
        ({"epsilon_low": 1.5}, r"epsilon_low must be in \[0, 1\), got 1.5"),
        ({"beta": -0.1}, "beta must be >= 0"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(InvalidOptionError, match=message):
        GRPOConfig(**kwargs)


@pytest.mark.parametrize(
    ("cfg", "kwargs", "message"),
    [
        ({"lr_scheduler": "cosine"}, {}, "total_steps=None; pass total_steps"),
        ({"warmup_steps": 10}, {"total_steps": 5}, "total_steps must be .*warmup_steps=10"),
        (
            {},
            {"sampling": SimpleNamespace(temperature=0.0)},
            "temperature 0.0.*set temperature > 0",
        ),
    ],
)
def test_trainer_rejects_bad_run_values_before_any_work(
    tiny_model, tokenizer, cfg, kwargs, message
):
    with pytest.raises(InvalidOptionError, match=message):
        GRPO(tiny_model, tokenizer, config(**cfg), **{"sampling": SAMPLING, **kwargs})


def test_trainer_reads_the_samplers_temperature_from_its_settings_object(tiny_model, tokenizer):
    """One owner: changing the sampler's temperature changes the learner's, with no copy."""
    sampling = SimpleNamespace(temperature=0.7)
    trainer = GRPO(tiny_model, tokenizer, config(), sampling=sampling)
    assert trainer.temperature == 0.7
    sampling.temperature = 0.3
    assert trainer.temperature == 0.3
    assert not hasattr(trainer.config, "temperature") and not hasattr(trainer.config, "group_size")


# ---------------------------------------------------------------- policy_loss by hand


def toy_batch():
    """Two sequences; token ratios r = exp(logp - old_logp) chosen by hand.

    seq 0 (A = +1): policy tokens at t=1,2 with r = 1.5, 0.5
    seq 1 (A = -2): policy tokens at t=1,2,3 with r = 1.0, 1.3, 0.5
    """
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -1.5, -3.0]])
    ratios = torch.tensor([[1.0, 1.5, 0.5, 1.0], [1.0, 1.0, 1.3, 0.5]])
    logp = (old + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0])
    return logp, old, advantages, mask


def test_policy_loss_grpo_dapo_dr_grpo_by_hand():
    # eps = 0.2: clip range [0.8, 1.2]; per-token loss = max(-A r, -A clip(r))
    # seq 0, A=+1: r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped high); r=0.5 -> max(-0.5, -0.8) = -0.5
    # seq 1, A=-2: r=1.0 -> 2.0; r=1.3 -> max(2.6, 2.4) = 2.6; r=0.5 -> max(1.0, 1.6) = 1.6 (low)
    seq0, seq1 = [-1.2, -0.5], [2.0, 2.6, 1.6]
    expected = {
        "grpo": (sum(seq0) / 2 + sum(seq1) / 3) / 2,  # 0.608333...
        "dapo": (sum(seq0) + sum(seq1)) / 5,  # 0.9
        "dr_grpo": (sum(seq0) + sum(seq1)) / (2 * 4),  # 0.5625 with max_completion_length=4
    }
    for loss_type, value in expected.items():
        logp, old, advantages, mask = toy_batch()
        cfg = GRPOConfig(loss_type=loss_type, max_completion_length=4)
        loss, metrics = policy_loss(logp, old, advantages, mask, cfg)
        assert loss.item() == pytest.approx(value, abs=1e-6), loss_type
        assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)  # seq 0, r=1.5
        assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)  # seq 1, r=0.5
        assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)
        assert metrics["kl"] == 0.0


def test_dr_grpo_defaults_to_longest_policy_span():
    logp, old, advantages, mask = toy_batch()
    loss, _ = policy_loss(logp, old, advantages, mask, GRPOConfig(loss_type="dr_grpo"))
    assert loss.item() == pytest.approx(4.5 / (2 * 3))  # longest sequence has 3 policy tokens


def test_policy_loss_gspo_by_hand_and_its_token_gradient():
    logp, old, advantages, mask = toy_batch()
    cfg = GRPOConfig(loss_type="gspo", epsilon_low=0.1, epsilon_high=0.1)
    loss, metrics = policy_loss(logp, old, advantages, mask, cfg)
    # sequence ratio s_i = exp(mean log r) = geometric mean of the token ratios
    s0 = math.sqrt(1.5 * 0.5)  # 0.866, A=+1: max(-0.866, -0.9) = -0.866, not clipped
    s1 = (1.0 * 1.3 * 0.5) ** (1 / 3)  # 0.866, A=-2: max(1.732, 1.8) = 1.8, clipped low
    seq0 = max(-1 * s0, -1 * min(max(s0, 0.9), 1.1))
    seq1 = max(2 * s1, 2 * min(max(s1, 0.9), 1.1))
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, abs=1e-6)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(3 / 5)  # all of seq 1's tokens
    loss.backward()
    # GSPO-token: d loss / d logp_t = -A * s_i / |y_i| / N on unclipped sequences, 0 if clipped
    expected = torch.tensor([[0, -s0 / 2 / 2, -s0 / 2 / 2, 0], [0.0, 0, 0, 0]])
    torch.testing.assert_close(logp.grad, expected)


def test_policy_loss_kl_k3_by_hand():
    logp, old, advantages, mask = toy_batch()
    ref = logp.detach().clone()
    ref[0, 1] += math.log(2.0)  # ref - logp = log 2 -> k3 = 2 - log 2 - 1
    ref[1, 3] -= 1.0  # ref - logp = -1 -> k3 = exp(-1) + 1 - 1
    ref[0, 0] += 50.0  # a mask-0 position: must not count
    k3 = (2 - math.log(2) - 1) + math.exp(-1)
    cfg = GRPOConfig(loss_type="dapo", beta=0.1)
    loss, metrics = policy_loss(logp, old, advantages, mask, cfg, ref)
    assert loss.item() == pytest.approx((4.5 + 0.1 * k3) / 5, abs=1e-6)
    assert metrics["kl"] == pytest.approx(k3 / 5, abs=1e-6)


@pytest.mark.parametrize(
    "estimator, expected",
    [  # d = logp - ref: -log 2 at seq 0 t=1, +1 at seq 1 t=3, 0 elsewhere
        ("k1", -math.log(2) + 1),
        ("k2", 0.5 * math.log(2) ** 2 + 0.5),
        ("k3", (1 - math.log(2)) + math.exp(-1)),  # exp(-d) + d - 1
    ],
)
def test_kl_estimators_by_hand(estimator, expected):
    logp, old, advantages, mask = toy_batch()
    ref = logp.detach().clone()
    ref[0, 1] += math.log(2.0)
    ref[1, 3] -= 1.0
    ref[0, 0] += 50.0  # a mask-0 position: must not count
    cfg = GRPOConfig(loss_type="dapo", beta=0.1, kl_estimator=estimator)
    loss, metrics = policy_loss(logp, old, advantages, mask, cfg, ref)
    assert loss.item() == pytest.approx((4.5 + 0.1 * expected) / 5, abs=1e-6)
    assert metrics["kl"] == pytest.approx(expected / 5, abs=1e-6)
    d = torch.tensor([-math.log(2), 1.0])
    values = kl_estimate(d, torch.zeros(2), estimator)
    assert values.sum().item() == pytest.approx(expected, abs=1e-6)


def test_policy_loss_cispo_by_hand_and_its_gradient():
    logp, old, advantages, mask = toy_batch()
    loss, metrics = policy_loss(logp, old, advantages, mask, GRPOConfig(loss_type="cispo"))
    # weights clip(r, 0.8, 1.2), no gradient through them: seq 0 (A=+1) r=1.5, 0.5 -> 1.2, 0.8;
    # seq 1 (A=-2) r=1.0, 1.3, 0.5 -> 1.0, 1.2, 0.8. Token loss -A * w * logp, / 5 tokens.
    weights = torch.tensor([[0, 1.2, 0.8, 0], [0, 1.0, 1.2, 0.8]])
    adv = torch.tensor([[1.0], [-2.0]])
    expected = (-adv * weights * logp.detach() * mask).sum() / 5
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()
    # every token keeps a gradient, even the clipped ones: -A * w / 5
    torch.testing.assert_close(logp.grad, -adv * weights * mask / 5)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(2 / 5)  # r = 1.5 and 1.3
    assert metrics["clip_ratio/low_mean"] == pytest.approx(2 / 5)  # r = 0.5 twice


def test_entropy_bonus_by_hand():
    logp, old, advantages, mask = toy_batch()
    entropy = torch.tensor([[9.0, 1, 2, 9], [9, 3, 4, 5]], requires_grad=True)
    cfg = GRPOConfig(loss_type="dapo", entropy_coef=0.1)
    loss, _ = policy_loss(logp, old, advantages, mask, cfg, entropy=entropy)
    assert loss.item() == pytest.approx((4.5 - 0.1 * 15) / 5, abs=1e-6)  # policy tokens: 15
    loss.backward()
    torch.testing.assert_close(entropy.grad, -0.1 * mask.float() / 5)  # mask-0: no gradient
    grpo = GRPOConfig(loss_type="grpo", entropy_coef=0.1)  # aggregated like the loss
    loss, _ = policy_loss(logp, old, advantages, mask, grpo, entropy=entropy.detach())
    seq0, seq1 = [-1.2, -0.5], [2.0, 2.6, 1.6]
    base = (sum(seq0) / 2 + sum(seq1) / 3) / 2
    assert loss.item() == pytest.approx(base - 0.1 * ((1 + 2) / 2 + (3 + 4 + 5) / 3) / 2)


def test_clipping_engages_and_blocks_the_gradient():
    mask = torch.tensor([[0, 1, 1]])
    old = torch.tensor([[0.0, -2.0, -2.0]])
    logp = (old + torch.tensor([[0.0, math.log(1.5), 0.0]])).requires_grad_(True)  # r=1.5, 1
    cfg = GRPOConfig(loss_type="dapo", epsilon_high=0.2)
    loss, metrics = policy_loss(logp, old, torch.tensor([1.0]), mask, cfg)
    loss.backward()
    assert metrics["clip_ratio/high_mean"] == pytest.approx(0.5)
    assert metrics["clip_ratio/low_mean"] == 0.0
    assert logp.grad[0, 1] == 0.0  # clipped token: no gradient
    assert logp.grad[0, 2] == pytest.approx(-0.5)  # unclipped: -A * r / num_tokens


def test_mask_zero_tokens_get_exactly_zero_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    input_ids = torch.randint(0, 11, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 1, 1]])
    logp = torch.nn.functional.pad(selective_log_softmax(logits[:, :-1], input_ids[:, 1:]), (1, 0))
    old = (logp.detach() + 0.1 * torch.randn(2, 6)).masked_fill(mask == 0, 0.0)  # sampler-like
    ref = logp.detach() - 30.0  # huge KL on environment tokens: must stay masked
    for loss_type in LOSS_TYPES:
        logits.grad = None
        cfg = GRPOConfig(loss_type=loss_type, beta=0.5)
        loss, _ = policy_loss(logp, old, torch.tensor([1.0, -0.5]), mask, cfg, ref)
        loss.backward(retain_graph=True)
        # logits at position t-1 predict token t: mask-0 tokens t>0 -> rows t-1 get no gradient
        for n, t in (mask[:, 1:] == 0).nonzero().tolist():
            assert torch.equal(logits.grad[n, t], torch.zeros(11)), (loss_type, n, t)
        assert logits.grad.abs().sum() > 0


def test_zero_advantage_episodes_contribute_no_gradient(tiny_model, tokenizer):
    """Same fixed normalisers: a batch with an all-equal-reward group has the same gradient."""
    groups = make_groups([[0, 1, 1, 0], [1, 1, 1, 1]], seed=3)
    flat = [ep for g in groups for ep in g]
    advantages = compute_advantages(torch.tensor([[e.reward for e in g] for g in groups]))
    normalisers = {"num_tokens": 100.0, "num_sequences": 4.0, "completion_length": 10.0}

    def grads(episodes, adv, loss_type):
        tiny_model.zero_grad()
        mb = MicroBatch.from_episodes(episodes, adv, tokenizer.pad_token_id)
        logp = token_logprobs(tiny_model, mb.input_ids, mb.attention_mask)
        cfg = GRPOConfig(loss_type=loss_type)
        loss, _ = policy_loss(
            logp, logp.detach(), mb.advantages, mb.action_mask, cfg, **normalisers
        )
        loss.backward()
        return [p.grad.clone() for p in tiny_model.parameters()]

    for loss_type in LOSS_TYPES:
        with_group = grads(flat, advantages.flatten().tolist(), loss_type)
        without = grads(flat[:4], advantages[0].tolist(), loss_type)
        for a, b in zip(with_group, without, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


# ---------------------------------------------------------------- log-probs


def test_selective_log_softmax_matches_full_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50) * 4
    index = torch.randint(0, 50, (3, 7))
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index), expected, atol=1e-5, rtol=0)
    bf16 = selective_log_softmax(logits.bfloat16(), index)
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, expected, atol=0.1, rtol=0)


def test_token_logprobs_align_to_input_positions(tiny_model, tokenizer):
    mb = MicroBatch.from_episodes(
        [e for g in make_groups([[0, 1, 0, 1]]) for e in g], [0.0] * 4, tokenizer.pad_token_id
    )
    with torch.no_grad():
        full = token_logprobs(tiny_model, mb.input_ids, mb.attention_mask)
        logits = tiny_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        hot = token_logprobs(tiny_model, mb.input_ids, mb.attention_mask, temperature=0.5)
    assert full.shape == mb.input_ids.shape
    assert torch.equal(full[:, 0], torch.zeros(4))
    assert torch.equal(
        full[mb.attention_mask == 0], torch.zeros(int((mb.attention_mask == 0).sum()))
    )
    # token t is scored by the logits at t-1
    t = 5
    expected = torch.log_softmax(logits[:, t - 1], -1).gather(-1, mb.input_ids[:, t, None])
    torch.testing.assert_close(full[:, t], expected.squeeze(-1), atol=1e-5, rtol=0)
    expected_hot = torch.log_softmax(logits[:, t - 1] / 0.5, -1).gather(
        -1, mb.input_ids[:, t, None]
    )
    torch.testing.assert_close(hot[:, t], expected_hot.squeeze(-1), atol=1e-5, rtol=0)


def test_pack_micro_batches_respects_the_token_budget():
    lengths = [10, 30, 20, 25, 5, 100]
    packs = pack_micro_batches(lengths, token_budget=60)
    assert sorted(i for p in packs for i in p) == list(range(6))
    assert packs[0] == [5]  # longer than the budget: alone
    for pack in packs[1:]:
        assert len(pack) * max(lengths[i] for i in pack) <= 60


def test_pack_prefix_trees_counts_shared_prefixes_once():
    rows = [
        [1, 2, 3, 4, 5],  # 0
        [1, 2, 3, 9],  # 1: shares 1 2 3 with row 0
        [7, 8],  # 2: its own
        [1, 2, 3, 4, 6, 6],  # 3: shares 1 2 3 4 with row 0
        [7, 8, 9],  # 4: shares 7 8 with row 2
    ]
    # sorted: 0, 3, 1, 4 ... as [1 2 3 4 5] [1 2 3 4 6 6] [1 2 3 9] [7 8] [7 8 9]
    # costs: 5, 6 - 4 = 2, 4 - 3 = 1, 2 (nothing in common with row 1), 3 - 2 = 1
    assert pack_prefix_trees(rows, token_budget=11) == [[0, 3, 1, 2, 4]]
    assert pack_prefix_trees(rows, token_budget=8) == [[0, 3, 1], [2, 4]]
    assert pack_prefix_trees(rows, token_budget=7) == [[0, 3], [1, 2, 4]]  # 4 + 2 + 1
    assert pack_prefix_trees(rows, token_budget=3) == [[0], [3], [1], [2, 4]]  # over: alone
    tree = PrefixTree.from_rows(*_padded([rows[i] for i in (0, 3, 1, 2, 4)]))
    assert len(tree) == 11  # the sizes the packer counts are the tree's


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(map(len, rows))
    ids = torch.tensor([r + [0] * (t - len(r)) for r in rows])
    return ids, torch.tensor([[1] * len(r) + [0] * (t - len(r)) for r in rows])


def test_collate_right_pads():
    episodes = [Ep([5, 6, 7], [0, 1, 1], [0, -1, -2], 1.0), Ep([8, 9], [0, 1], [0, -3], 0.0)]
    mb = MicroBatch.from_episodes(episodes, [0.5, -0.5], pad_token_id=2)
    assert mb.input_ids.tolist() == [[5, 6, 7], [8, 9, 2]]
    assert mb.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert mb.action_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert mb.sampler_logprobs.tolist() == [[0, -1, -2], [0, -3, 0]]
    assert mb.advantages.tolist() == [0.5, -0.5]


# ---------------------------------------------------------------- learn()


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_learn_updates_the_policy(tiny_model, tokenizer, loss_type, use_lora):
    eps = {"epsilon_low": 3e-4, "epsilon_high": 4e-4} if loss_type == "gspo" else {}
    cfg = config(loss_type=loss_type, use_lora=use_lora, num_iterations=2, **eps)
    trainer = GRPO(tiny_model, tokenizer, cfg, sampling=SAMPLING)
    frozen = snapshot(trainer.unwrapped_model, trainable=False)
    trainable = snapshot(trainer.unwrapped_model, trainable=True)
    metrics = trainer.learn(make_groups([[0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]))
    assert set(metrics) == METRIC_KEYS
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["step"] == 1 and trainer.step == 1
    assert metrics["num_sequences"] == 12
    assert metrics["frac_reward_zero_std"] == pytest.approx(1 / 3)
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    assert 0 < metrics["trainable_ratio"] < 1
    after = dict(trainer.unwrapped_model.named_parameters())
    assert any(not torch.equal(after[n], p) for n, p in trainable.items())
    assert all(torch.equal(after[n], p) for n, p in frozen.items())
    assert bool(frozen) == use_lora  # LoRA freezes the base; full FT trains everything
    if use_lora:
        assert all("lora_" in n for n in trainable)


def test_first_iteration_ratio_is_one_and_kl_zero_with_lora_reference(tiny_model, tokenizer):
    trainer = GRPO(
        tiny_model, tokenizer, config(beta=0.1), sampling=SAMPLING
    )  # LoRA B = 0: policy == reference
    metrics = trainer.learn(make_groups([[0, 1, 1, 0], [1, 0, 0, 0]]))
    assert abs(metrics["kl"]) < 1e-6
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert metrics[key] == 0.0
    second = trainer.learn(make_groups([[0, 1, 1, 0], [1, 0, 0, 0]]))
    assert second["kl"] > 0  # the adapter moved away from the reference


def test_kl_in_the_reward_penalises_each_sequence_before_advantages(tokenizer):
    from agentenv.lm.models import tiny_model as build

    cfg = config(use_lora=False, beta=0.5, kl_placement="reward", kl_estimator="k1")
    trainer = GRPO(
        build(tokenizer), tokenizer, cfg, sampling=SAMPLING
    )  # reference: a frozen copy, as passed in
    with torch.no_grad():  # move the policy away from the reference
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    groups = make_groups([[1, 1, 1, 1]], seed=3)  # equal rewards: only the penalty differs
    batch = MicroBatch.from_episodes(groups[0], [0.0] * 4, tokenizer.pad_token_id)
    with torch.no_grad():
        args = (batch.input_ids, batch.attention_mask, 1.0)
        logp = token_logprobs(trainer.model, *args, action_mask=batch.action_mask)
        ref = token_logprobs(trainer.ref_model, *args, action_mask=batch.action_mask)
    per_seq = ((logp - ref) * batch.action_mask).sum(-1)  # k1 summed over policy tokens
    metrics = trainer.learn(groups)
    assert metrics["rewards/kl_penalty_mean"] == pytest.approx(per_seq.mean().item(), rel=1e-4)
    tokens = batch.action_mask.sum().item()
    assert metrics["kl"] == pytest.approx(per_seq.sum().item() / tokens, rel=1e-4)
    expected = compute_advantages(1.0 - 0.5 * per_seq[None, :])  # (1, 4)
    assert metrics["advantages/std"] == pytest.approx(expected.std(correction=0).item(), rel=1e-3)
    assert metrics["grad_norm"] > 0  # a zero-variance reward group still learns from the KL


def test_later_iterations_clip(tiny_model, tokenizer):
    cfg = config(num_iterations=3, learning_rate=0.05, epsilon_low=0.01, epsilon_high=0.01)
    metrics = GRPO(tiny_model, tokenizer, cfg, sampling=SAMPLING).learn(
        make_groups([[0, 1, 1, 0], [1, 0, 0, 0]])
    )
    assert metrics["clip_ratio/region_mean"] > 0


def test_zero_variance_group_is_skipped_exactly(tokenizer):
    from agentenv.lm.models import tiny_model as build

    groups = make_groups([[0, 1, 1, 0], [1, 1, 1, 1]], seed=1)
    a = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    b = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    a.learn(groups)
    b.learn(groups[:1])
    assert_same_weights(a.model, b.model)


def test_a_failed_episode_is_left_out_exactly(tokenizer):
    """A failed episode (its env raised; reward 5 from before the failure) changes nothing:
    the update equals that of its group without it."""
    from agentenv.lm.models import tiny_model as build

    group = make_groups([[0, 1, 5, 0]], seed=3)[0]
    group[2].failed = True
    a = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    b = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    metrics = a.learn([group])
    b.learn([[group[0], group[1], group[3]]])
    assert metrics["frac_failed"] == 0.25
    assert_same_weights(a.model, b.model)
    trainer = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    advantages = trained_advantages(trainer, [group])
    assert advantages[2] is None  # in no micro-batch
    assert trainer.last_advantages[0].tolist() == pytest.approx(
        [
            -1 / 3 / (math.sqrt(2) / 3 + 1e-4),
            2 / 3 / (math.sqrt(2) / 3 + 1e-4),
            0.0,
            -1 / 3 / (math.sqrt(2) / 3 + 1e-4),
        ]
    )


def test_micro_batch_tokens_none_is_the_default_for_the_models_device(tokenizer):
    from agentenv.lm.models import tiny_model as build
    from algorithms.config import SFT_MICRO_BATCH_TOKENS, micro_batch_tokens_for
    from algorithms.sft import SFT

    assert GRPOConfig().micro_batch_tokens is None  # settled by the trainer, not the config
    assert micro_batch_tokens_for(GRPO_MICRO_BATCH_TOKENS, "cpu") == 768
    assert micro_batch_tokens_for(GRPO_MICRO_BATCH_TOKENS, "cuda") == 4096  # not launch-bound
    assert micro_batch_tokens_for(SFT_MICRO_BATCH_TOKENS, "cpu") == 1024
    assert GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING).micro_batch_tokens == 768
    sft = SFT(build(tokenizer), tokenizer, SFTConfig(micro_batch_tokens=99))
    assert sft.micro_batch_tokens == 99  # a value given wins


def test_a_model_on_another_device_than_the_process_accelerator_is_refused(tokenizer):
    """accelerate keeps one device per process: after a CPU trainer, a model elsewhere (a
    meta model stands in for a GPU one) is refused by name instead of being moved."""
    from agentenv.lm.models import tiny_model as build
    from algorithms.trainer import default_accelerator

    GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)  # accelerate on the CPU
    with pytest.raises(InvalidOptionError, match="model is on 'meta'.*runs this process on 'cpu'"):
        default_accelerator(build(tokenizer).to("meta"))
    assert default_accelerator(build(tokenizer)).device.type == "cpu"  # the same device: fine


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batching_gives_the_one_batch_update(tokenizer, loss_type):
    from agentenv.lm.models import tiny_model as build

    groups = make_groups([[0, 1, 1, 0], [1, 0, 0, 0]], seed=2)
    cfg = {"loss_type": loss_type, "use_lora": False, "learning_rate": 1e-3, "beta": 0.1}
    small = GRPO(
        build(tokenizer), tokenizer, config(micro_batch_tokens=20, **cfg), sampling=SAMPLING
    )
    large = GRPO(
        build(tokenizer), tokenizer, config(micro_batch_tokens=10_000, **cfg), sampling=SAMPLING
    )
    ms, ml = small.learn(groups), large.learn(groups)
    assert ms["loss"] == pytest.approx(ml["loss"], abs=1e-6)
    assert ms["grad_norm"] == pytest.approx(ml["grad_norm"], rel=1e-4)
    for ps, pl in zip(small.model.parameters(), large.model.parameters(), strict=True):
        # .grad still holds the accumulated gradient of the step: same up to float rounding,
        # which differs with the summation order (bounded relative to the tensor's scale)
        scale = pl.grad.abs().max().item()
        torch.testing.assert_close(ps.grad, pl.grad, atol=1e-5 * scale + 1e-12, rtol=1e-4)
        # Adam's first step is lr * g / (|g| + eps): where |g| is near eps, rounding of g
        # moves the step a lot, so compare the entries whose gradient is well above eps
        clear = pl.grad.abs() > 1e-6
        torch.testing.assert_close(ps[clear], pl[clear], atol=1e-6, rtol=0)


def test_all_zero_variance_batch_changes_nothing(tiny_model, tokenizer):
    trainer = GRPO(tiny_model, tokenizer, config(), sampling=SAMPLING)
    before = snapshot(trainer.model)
    metrics = trainer.learn(make_groups([[1, 1, 1, 1], [0, 0, 0, 0]]))
    assert metrics["frac_reward_zero_std"] == 1.0 and metrics["loss"] == 0.0
    assert trainer.step == 1
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_a_zero_gradient_step_skips_the_passes_and_steps_as_they_would(tokenizer, monkeypatch):
    """A global-mean baseline over equal rewards gives every episode advantage 0: the
    loss's gradient is zero, so the step skips its forward and backward passes but still
    steps AdamW on zero gradients (its momentum and weight decay move the weights). Bit
    for bit what the passes give, over a learning step before it and one after."""
    from agentenv.lm.models import tiny_model as build

    cfg = config(advantage_baseline="global_mean", weight_decay=0.1)
    steps = [[[0, 1, 1, 0]], [[1, 1, 1, 1], [1, 1, 1, 1]], [[1, 0, 0, 1]]]
    skipping = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    passes = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    monkeypatch.setattr(passes, "_zero_gradient", lambda batches: False)  # always the passes
    ran = []
    optimize = skipping._optimize
    monkeypatch.setattr(skipping, "_optimize", lambda *a: ran.append(1) or optimize(*a))
    for i, rewards in enumerate(steps):
        before = snapshot(skipping.model, trainable=True)
        a = skipping.learn(make_groups(rewards, seed=i))
        b = passes.learn(make_groups(rewards, seed=i))
        assert_same_weights(skipping.model, passes.model)
        assert a["grad_norm"] == b["grad_norm"]
        after = snapshot(skipping.model, trainable=True)
        assert any(not torch.equal(after[n], before[n]) for n in after)  # momentum moved them
    assert len(ran) == 2  # the first and last steps ran the passes; the middle one did not
    assert (
        skipping.optimizer.state_dict()["state"].keys()
        == passes.optimizer.state_dict()["state"].keys()
    )


def test_gae_before_any_reward_skips_the_passes(tokenizer, monkeypatch):
    """``gae`` with every reward 0 and its critic at 0 (a cold start: no turn answered
    right yet) has every advantage 0; an entropy bonus or a KL term in the loss keeps
    the passes (their gradients are not zero)."""
    from agentenv.lm.models import tiny_model as build

    for overrides, skips in [({}, True), ({"entropy_coef": 0.01}, False), ({"beta": 0.1}, False)]:
        trainer = GRPO(
            build(tokenizer), tokenizer, config(credit="gae", **overrides), sampling=SAMPLING
        )
        ran = []
        optimize = trainer._optimize
        monkeypatch.setattr(
            trainer, "_optimize", lambda *a, f=optimize, r=ran: r.append(1) or f(*a)
        )
        metrics = trainer.learn(make_groups([[0, 0, 0], [0, 0, 0]]))
        assert metrics["frac_no_signal"] == 1.0 and trainer.step == 1
        assert (not ran) == skips, overrides
        if "entropy_coef" in overrides:  # (the KL's gradient is 0 too while policy = reference)
            assert metrics["grad_norm"] > 0


def test_learn_rejects_malformed_groups(tiny_model, tokenizer):
    trainer = GRPO(tiny_model, tokenizer, config(), sampling=SAMPLING)
    with pytest.raises(InvalidOptionError, match="same size, got group sizes \\[3, 4\\]"):
        trainer.learn(make_groups([[0, 1, 1, 0]]) + make_groups([[0, 1, 1]]))
    with pytest.raises(InvalidOptionError, match=">= 2 episodes.*sizes \\[1\\]"):
        trainer.learn(make_groups([[1]]))
    bad = make_groups([[0, 1, 1, 0]])
    bad[0][1].sampler_logprobs = bad[0][1].sampler_logprobs[:-1]
    with pytest.raises(InvalidOptionError, match="equally long"):
        trainer.learn(bad)


def test_learning_rate_schedule_counts_learn_calls(tiny_model, tokenizer):
    cfg = config(lr_scheduler="linear", warmup_steps=1, learning_rate=1e-3)
    trainer = GRPO(tiny_model, tokenizer, cfg, total_steps=3, sampling=SAMPLING)
    groups = make_groups([[0, 1, 1, 0]])
    lrs = [trainer.learn(groups)["learning_rate"] for _ in range(3)]
    assert lrs == pytest.approx([0.0, 1e-3, 5e-4])


def test_a_peft_model_keeps_its_adapter(tiny_model, tokenizer):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_model, LoraConfig(task_type="CAUSAL_LM", r=2))
    expected = {n for n, p in peft_model.named_parameters() if "lora_" in n}
    trainer = GRPO(peft_model, tokenizer, config(), sampling=SAMPLING)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable == expected  # no adapter nested inside the adapter
    assert trainer.learn(make_groups([[0, 1, 1, 0]]))["grad_norm"] > 0
    from agentenv.lm.models import tiny_model as build

    other = get_peft_model(build(tokenizer), LoraConfig(task_type="CAUSAL_LM", r=2))
    with pytest.raises(InvalidOptionError, match="merge_and_unload"):
        GRPO(other, tokenizer, config(use_lora=False), sampling=SAMPLING)


def test_gradient_checkpointing_gives_the_same_gradient(tokenizer):
    from agentenv.lm.models import tiny_model as build

    groups = make_groups([[0, 1, 1, 0], [1, 0, 0, 0]])
    plain = GRPO(build(tokenizer), tokenizer, config(), sampling=SAMPLING)
    with warnings.catch_warnings(record=True) as seen:  # transformers' current names
        warnings.simplefilter("always")
        checkpointed = GRPO(
            build(tokenizer), tokenizer, config(gradient_checkpointing=True), sampling=SAMPLING
        )
    assert not [w for w in seen if "gradient_checkpointing" in str(w.message)]
    plain.learn(groups)
    checkpointed.learn(groups)
    for a, b in zip(plain._params, checkpointed._params, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-5)


def _warm_started(tokenizer):
    """A PeftModel whose adapter is not zero, as after an SFT warm start."""
    from peft import LoraConfig, get_peft_model

    from agentenv.lm.models import tiny_model as build

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    return get_peft_model(build(tokenizer), lora)


def test_a_warm_started_adapter_is_its_own_kl_reference(tokenizer, tmp_path):
    groups = make_groups([[0, 1, 1, 0], [1, 0, 0, 0]])
    trainer = GRPO(_warm_started(tokenizer), tokenizer, config(beta=0.1), sampling=SAMPLING)
    reference = {
        n: p.clone() for n, p in trainer.unwrapped_model.named_parameters() if ".reference." in n
    }
    assert reference and not any(p.requires_grad for p in reference.values())
    metrics = trainer.learn(groups)
    assert metrics["kl"] == 0.0  # step 0: the policy is its reference, exactly
    assert trainer.learn(groups)["kl"] > 0  # then it moves away from it
    after = dict(trainer.unwrapped_model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in reference.items())  # frozen
    saved = trainer.save(tmp_path / "ckpt") / "adapter"
    assert not (saved / "reference").exists()  # the checkpoint holds the trained adapter only

    base = GRPO(
        _warm_started(tokenizer), tokenizer, config(beta=0.1, reference="base"), sampling=SAMPLING
    )
    assert base.learn(groups)["kl"] > 0  # the adapter-disabled base differs from the start


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_logprobs_match_autograd(dtype):
    """The hand-written backward of the LM-head chunk equals autograd through the
    checkpointed reference: log-probs, entropy, and gradients of hidden, weight and bias."""
    from algorithms.logprobs import _chunk_logprobs, _HeadLogprobs

    torch.manual_seed(0)
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    bias = torch.randn(11, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 5, 5, 1])
    upstream = torch.randn(6)
    results = []
    for fn in (_chunk_logprobs, _HeadLogprobs.apply):
        for t in (hidden, weight, bias):
            t.grad = None
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logp, entropy = fn(hidden, weight, bias, targets, 0.7, True)
        (logp * upstream).sum().backward()
        results.append((logp, entropy, hidden.grad, weight.grad, bias.grad))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for ref, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused.float(), ref.float(), atol=tol, rtol=tol)
    assert results[1][1].requires_grad is False  # entropy: a metric, no gradient
