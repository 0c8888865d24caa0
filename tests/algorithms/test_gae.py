"""The ``gae`` credit: GAE over turns by hand, the critic, and learn() with it (the value
head learns from the value loss alone, the policy from the policy loss alone)."""

from __future__ import annotations

import math

import pytest
import torch
from toy_episodes import SAMPLING, make_groups

from agentenv.errors import InvalidOptionError
from agentenv.lm.models import tiny_model as build
from agentenv.rollout.episode import mask_spans
from algorithms.batching import MicroBatch
from algorithms.checkpoint import latest_checkpoint
from algorithms.config import GRPOConfig
from algorithms.critic import Critic, ValueHead
from algorithms.grpo import GRPO
from algorithms.logprobs import _unwrap, hidden_before
from algorithms.losses import gae, gae_advantages

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def config(**overrides) -> GRPOConfig:
    base = {"learning_rate": 1e-3, "lora_r": 4, "lora_alpha": 8, "credit": "gae"}
    return GRPOConfig(**{**base, **overrides})


def test_gae_by_hand_on_three_turns_one_without_reward():
    """r = 1, 0, 2; V = 0.5, 1, 0.25; gamma 0.5, lambda 0.5 (V after the end: 0):
    deltas 1 + 0.5 - 0.5 = 1, 0 + 0.125 - 1 = -0.875, 2 - 0.25 = 1.75;
    A2 = 1.75, A1 = -0.875 + 0.25 x 1.75 = -0.4375, A0 = 1 + 0.25 x -0.4375 = 0.890625."""
    advantages, targets = gae([1.0, 0.0, 2.0], [0.5, 1.0, 0.25], gamma=0.5, lam=0.5)
    assert advantages == pytest.approx([0.890625, -0.4375, 1.75], abs=1e-12)
    assert targets == pytest.approx([1.390625, 0.5625, 2.0], abs=1e-12)
    # lambda 1: the discounted return (1.5, 1, 2) less the value; lambda 0: the TD errors
    assert gae([1.0, 0.0, 2.0], [0.5, 1.0, 0.25], 0.5, 1.0)[0] == pytest.approx([1.0, 0.0, 1.75])
    assert gae([1.0, 0.0, 2.0], [0.5, 1.0, 0.25], 0.5, 0.0)[0] == pytest.approx([1.0, -0.875, 1.75])
    assert gae([], [], 1.0, 0.95) == ([], [])


# A group of 3: member 0 takes 3 turns, its second without reward, and succeeds; member 1
# failed (its env raised); member 2 was truncated after 2 turns (outcome 0).
TURN_REWARDS = [[[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [0.0, 1.0]]]
OUTCOME = torch.tensor([[1.0, 1.0, 0.0]])
VALUES = [[[0.5, 0.5, 0.5], [], [0.25, 0.25]]]
VALID = torch.tensor([[True, False, True]])


def test_gae_advantages_by_hand_with_a_failed_and_a_truncated_episode():
    """Weight 0.5, gamma = lambda = 1. Member 0's rewards 0.5, 0, 0.5 + 1 (the outcome at
    the last turn): returns 2, 1.5, 1.5, less V 0.5: 1.5, 1, 1. Member 2 (truncated: its
    end is terminal, nothing bootstrapped): rewards 0, 0.5, returns 0.5, 0.5, less 0.25."""
    kwargs = {"weight": 0.5, "gamma": 1.0, "lam": 1.0}
    raw, targets = gae_advantages(OUTCOME, TURN_REWARDS, VALUES, VALID, norm="mean_only", **kwargs)
    assert raw[0][0] == pytest.approx([1.5, 1.0, 1.0])
    assert raw[0][1] == [0.0, 0.0, 0.0] and targets[0][1] == []
    assert raw[0][2] == pytest.approx([0.25, 0.25])
    assert targets[0][0] == pytest.approx([2.0, 1.5, 1.5])
    assert targets[0][2] == pytest.approx([0.5, 0.5])

    # whitened over the 5 valid turns: mean 0.8, population variance 1.175 / 5
    white, _ = gae_advantages(OUTCOME, TURN_REWARDS, VALUES, VALID, eps=0.0, **kwargs)
    std = math.sqrt(1.175 / 5)
    assert white[0][0] == pytest.approx([0.7 / std, 0.2 / std, 0.2 / std])
    assert white[0][2] == pytest.approx([-0.55 / std, -0.55 / std])
    assert white[0][1] == [0.0] * 3


def test_the_value_head_starts_at_zero_and_fits_returns():
    torch.manual_seed(0)
    hidden = torch.randn(12, 8)
    targets = torch.nn.functional.layer_norm(hidden, (8,))[:, 0] * 2 + 1  # linear in its input
    critic = Critic(8, lr=0.05, max_grad_norm=10.0, device="cpu")
    assert torch.equal(critic.values(hidden), torch.zeros(12))
    stats = critic.fit(hidden, targets, epochs=200)
    # before: V = 0, so the loss is half the mean square target and nothing is explained
    assert stats["critic/value_loss"] == pytest.approx(0.5 * targets.square().mean().item())
    assert stats["critic/explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert stats["critic/value_loss_after"] < 0.01 * stats["critic/value_loss"]
    again = critic.fit(hidden, targets, epochs=1)
    assert again["critic/explained_variance"] > 0.95
    assert isinstance(critic.head, ValueHead)


def test_hidden_before_is_what_the_head_turns_into_the_tokens_logits(tokenizer):
    model = build(tokenizer)
    episodes = [ep for group in make_groups([[1, 0], [0, 1]]) for ep in group]
    mb = MicroBatch.from_episodes(episodes, [0.0] * 4, tokenizer.pad_token_id)
    marked = torch.zeros_like(mb.action_mask, dtype=torch.bool)
    marked[:, 6] = True  # every row's token 6, and its last real token
    last = mb.attention_mask.sum(-1) - 1
    marked[torch.arange(4), last] = True
    with torch.no_grad():
        hidden = hidden_before(model, mb.input_ids, mb.attention_mask, marked)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    rows, cols = marked.nonzero(as_tuple=True)
    assert hidden.shape == (len(rows), model.config.hidden_size)
    head = _unwrap(model).lm_head
    torch.testing.assert_close(head(hidden), logits[rows, cols - 1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="position 0"):
        hidden_before(model, mb.input_ids, mb.attention_mask, torch.ones_like(marked))


def test_hidden_before_on_rows_that_run_as_a_prefix_tree(tokenizer, monkeypatch):
    """A group whose episodes go on alike runs as its prefix tree: the same states."""
    from algorithms.prefix_tree import PrefixTree

    model = build(tokenizer)
    base = make_groups([[1]])[0][0].input_ids
    ids = torch.tensor([base] * 2 + [base[:-2] + [7, 8]] * 2)
    attn = torch.ones_like(ids)
    marked = torch.zeros_like(ids, dtype=torch.bool)
    marked[:, 5] = marked[:, -1] = True
    sizes, real = [], PrefixTree.model_inputs
    monkeypatch.setattr(PrefixTree, "model_inputs", lambda t: sizes.append(len(t)) or real(t))
    with torch.no_grad():
        hidden = hidden_before(model, ids, attn, marked)
        logits = model(input_ids=ids, attention_mask=attn).logits
    assert sizes == [len(base) + 2]  # one tree: what the rows share, once
    rows, cols = marked.nonzero(as_tuple=True)
    head = _unwrap(model).lm_head
    torch.testing.assert_close(head(hidden), logits[rows, cols - 1], atol=1e-4, rtol=1e-4)


def test_learn_gives_each_turn_its_advantage_and_trains_the_critic(tokenizer):
    cfg = config(turn_weight=0.5, gae_lambda=1.0)
    trainer = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    groups = make_groups([[1, 0, 0], [0, 0, 0]])  # the second group: equal outcomes
    groups[1][0].turn_rewards = [1.0, 0.0]  # a retrieval-like reward on a first turn
    metrics = trainer.learn(groups)
    per_turn = trainer.last_turn_advantages
    assert per_turn is not None and [len(a) for a in per_turn] == [2] * 6
    # the critic started at 0: with lambda 1 the advantages are the whitened returns, so
    # equal returns get equal ones, and the group of equal outcomes teaches (not dropped)
    returns = [[1.0, 1.0], [0, 0], [0, 0], [0.5, 0.0], [0, 0], [0, 0]]
    flat = torch.tensor([x for r in returns for x in r])
    expected = ((flat - flat.mean()) / (flat.std(correction=0) + 1e-4)).view(6, 2)
    torch.testing.assert_close(torch.tensor(per_turn), expected, atol=1e-6, rtol=0)
    assert metrics["critic/value_loss"] == pytest.approx(0.5 * flat.square().mean().item())
    assert metrics["critic/value_loss_after"] < metrics["critic/value_loss"]
    assert metrics["num_sequences"] == 6 and metrics["frac_reward_zero_std"] == 0.5
    assert metrics["time/critic_s"] > 0  # the critic's forward and fit, timed apart
    assert trainer.critic is not None
    assert not torch.equal(trainer.critic.values(torch.randn(3, 64)), torch.zeros(3))


def test_the_value_head_learns_only_from_the_value_loss_and_the_policy_only_from_its_own(
    tokenizer,
):
    trainer = GRPO(build(tokenizer), tokenizer, config(value_epochs=3), sampling=SAMPLING)
    assert trainer.critic is not None
    phase = ["policy"]
    events: list[tuple[str, str]] = []
    critic_params = {id(p) for p in trainer.critic.head.parameters()}
    adapters = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert adapters and not critic_params & {id(p) for _, p in adapters}
    for name, param in [*adapters, *trainer.critic.head.named_parameters(prefix="critic")]:
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: events.append((phase[0], name))
        )
    fit = trainer.critic.fit

    def fit_marked(*args, **kwargs):
        phase[0] = "value"
        try:
            return fit(*args, **kwargs)
        finally:
            phase[0] = "policy"

    trainer.critic.fit = fit_marked
    trainer.learn(make_groups([[1, 0, 0], [0, 1, 1]]))
    value = [name for p, name in events if p == "value"]
    policy = [name for p, name in events if p == "policy"]
    assert sorted(value) == sorted(["critic.linear.weight", "critic.linear.bias"] * 3)
    assert policy and not any(name.startswith("critic.") for name in policy)
    assert all(".lora_" in name for name in policy)


def test_a_gae_run_resumes_exactly_with_its_critic(tmp_path, tokenizer):
    cfg = config(turn_weight=0.5)
    uninterrupted = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    for seed in range(3):
        uninterrupted.learn(make_groups([[1, 0, 0], [0, 1, 0]], seed=seed))
    first = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    for seed in range(2):
        first.learn(make_groups([[1, 0, 0], [0, 1, 0]], seed=seed))
    path = first.save(tmp_path / "checkpoint-2")
    assert (path / "critic.pt").is_file()
    resumed = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    resumed.load(latest_checkpoint(tmp_path))
    a = resumed.learn(make_groups([[1, 0, 0], [0, 1, 0]], seed=2))
    b_critic = uninterrupted.critic.head.state_dict()  # type: ignore[union-attr]
    for name, value in resumed.critic.head.state_dict().items():  # type: ignore[union-attr]
        assert torch.equal(value, b_critic[name]), name
    for (name, x), y in zip(
        resumed.model.named_parameters(), uninterrupted.model.parameters(), strict=True
    ):
        assert torch.equal(x, y), name
    assert a["step"] == 3

    bandit = GRPO(build(tokenizer), tokenizer, config(credit="bandit"), sampling=SAMPLING)
    bandit.learn(make_groups([[1, 0, 0], [0, 1, 0]]))
    saved = bandit.save(tmp_path / "bandit" / "checkpoint-1")
    with pytest.raises(InvalidOptionError, match=r"no critic\.pt.*--init-from"):
        GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING).load(saved)


@pytest.mark.parametrize(("field", "value"), [("gae_lambda", 1.5), ("value_lr", 0.0)])
def test_gae_settings_are_checked(field, value):
    with pytest.raises(InvalidOptionError, match=field):
        config(**{field: value})


def _learner_states(model, episodes) -> None:
    """Give each episode the learner's own hidden states before its turns (what a sampler
    in float32 records, up to rounding) as ``turn_hidden``."""
    for ep in episodes:
        spans = mask_spans(ep.action_mask)
        marked = torch.zeros(1, len(ep.input_ids), dtype=torch.bool)
        for start, _ in spans:
            marked[0, start] = True
        ids = torch.tensor([ep.input_ids])
        with torch.no_grad():
            ep.turn_hidden = list(hidden_before(model, ids, torch.ones_like(ids), marked))


def test_critic_input_sampler_reads_the_episodes_states_instead_of_a_forward(
    tokenizer, monkeypatch
):
    """With the learner's own states recorded in the episodes, ``critic_input="sampler"``
    trains exactly as ``"learner"`` does over two steps (the second one's values come
    from the critic fitted on the first's states), without calling ``hidden_before``."""
    steps = [make_groups([[1, 0, 0], [0, 1, 1]], seed=s) for s in range(2)]
    learner = GRPO(build(tokenizer), tokenizer, config(turn_weight=0.5), sampling=SAMPLING)
    sampler = GRPO(
        build(tokenizer), tokenizer, config(turn_weight=0.5, critic_input="sampler"),
        sampling=SAMPLING,
    )  # fmt: skip
    for groups in steps:
        expected = learner.learn(groups)
        _learner_states(sampler.model, [ep for g in groups for ep in g])
        with monkeypatch.context() as m:
            m.setattr("algorithms.grpo.hidden_before", lambda *a, **k: pytest.fail("forward"))
            got = sampler.learn(groups)
        torch.testing.assert_close(
            torch.tensor(sampler.last_turn_advantages),
            torch.tensor(learner.last_turn_advantages),
            atol=1e-5,
            rtol=0,
        )
        assert got["critic/sampler_states"] == 1.0 and expected["critic/sampler_states"] == 0.0
    assert not torch.equal(torch.tensor(learner.last_turn_advantages[0]), torch.zeros(2))
    for name, value in sampler.critic.head.state_dict().items():  # type: ignore[union-attr]
        ref = learner.critic.head.state_dict()[name]  # type: ignore[union-attr]
        torch.testing.assert_close(value, ref, atol=1e-5, rtol=0)


def test_critic_input_sampler_uses_the_recorded_states_and_runs_the_forward_without(
    tokenizer, monkeypatch
):
    """Other recorded states give other values (they are read, not ignored), and a
    micro-batch with an episode that recorded none runs the learner's forward."""
    cfg = config(turn_weight=0.5, critic_input="sampler")
    first, second = make_groups([[1, 0, 0], [0, 1, 1]]), make_groups([[0, 1, 0], [1, 1, 0]], 1)
    runs, noise = [], torch.Generator().manual_seed(0)
    for other in (False, True):
        trainer = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
        for groups in (first, second):
            episodes = [ep for g in groups for ep in g]
            _learner_states(trainer.model, episodes)
            for ep in episodes:  # other states: random ones of the same shape
                if other:
                    ep.turn_hidden = [torch.randn(h.shape, generator=noise) for h in ep.turn_hidden]
            trainer.learn(groups)
        runs.append(torch.tensor(trainer.last_turn_advantages))
    assert (runs[0] - runs[1]).abs().max() > 1e-3  # the second step's values differ

    calls = []
    real = hidden_before
    monkeypatch.setattr(
        "algorithms.grpo.hidden_before", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    trainer = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    groups = make_groups([[1, 0, 0], [0, 1, 1]])
    metrics = trainer.learn(groups)  # toy episodes record no states
    assert calls and metrics["critic/sampler_states"] == 0.0
