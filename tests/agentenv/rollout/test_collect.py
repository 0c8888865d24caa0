import gymnasium as gym
import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

import agentenv
from agentenv.errors import InvalidOptionError
from agentenv.lm.engine import SamplingConfig
from agentenv.lm.sampler import TransformersPolicy
from agentenv.rollout.collect import collect
from agentenv.rollout.config import RolloutConfig
from agentenv.rollout.episode import ChatFormat, collate


class RecordingPolicy(TransformersPolicy):
    """Keeps what generate() returned, to compare with what the episodes stored."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def generate(self, prompts, sampling, **kwargs):
        gens = super().generate(prompts, sampling, **kwargs)
        self.calls.append(gens)
        return gens


def make_env():
    return agentenv.make("Calculator-v0", source="basic_arithmetic", num_tasks=50)


def rollout(model, tokenizer, dtype="float32", **kwargs):
    sampling = kwargs.pop("sampling", SamplingConfig(max_new_tokens=12))
    config = RolloutConfig(
        group_size=3, max_turns=2, sampling=sampling, show_progress=False, **kwargs
    )
    policy = RecordingPolicy(model, tokenizer, dtype=dtype)
    groups, metrics = collect(make_env, [4, 9], policy, ChatFormat(tokenizer), config)
    return policy, groups, metrics


def test_groups_share_task_and_store_generated_ids(tiny_model, tokenizer):
    policy, groups, metrics = rollout(tiny_model, tokenizer)
    assert [len(g) for g in groups] == [3, 3]
    for b, group in enumerate(groups):
        prompts = {tuple(e.input_ids[: e.policy_spans()[0][0]]) for e in group}
        assert len(prompts) == 1  # same seed -> same task -> same prompt tokens
        assert all(e.seed == [4, 9][b] and e.group == b for e in group)
    episodes = [e for g in groups for e in g]
    for turn, gens in enumerate(policy.calls):
        for ep, gen in zip(episodes, gens, strict=True):
            start, end = ep.policy_spans()[turn]
            assert ep.input_ids[start:end] == gen.token_ids
            assert ep.sampler_logprobs[start:end] == pytest.approx(gen.sampler_logprobs)
    assert set(metrics) == {
        "rollout/generate_s",
        "rollout/env_s",
        "rollout/total_s",
        "rollout/tokens",
        "rollout/env_errors",
    }
    assert metrics["rollout/env_errors"] == 0
    assert metrics["rollout/tokens"] == sum(e.num_policy_tokens for e in episodes)
    assert all(e.stop_reason == "max_turns" and e.num_turns == 2 for e in episodes)


class FlakyEnv(gym.Wrapper):
    """Raises on its second step when ``bad``."""

    def __init__(self, env, bad: bool):
        super().__init__(env)
        self.bad, self.steps = bad, 0

    def step(self, action):
        self.steps += 1
        if self.bad and self.steps == 2:
            raise ConnectionError("tool server went away")
        return self.env.step(action)


def test_an_env_that_raises_ends_only_its_own_episode(tiny_model, tokenizer):
    made = []

    def make_flaky():
        made.append(None)
        return FlakyEnv(make_env(), bad=len(made) == 2)  # group 0, member 1

    config = RolloutConfig(
        group_size=3, max_turns=3, sampling=SamplingConfig(max_new_tokens=8), show_progress=False
    )
    policy = RecordingPolicy(tiny_model, tokenizer, dtype="float32")
    groups, metrics = collect(make_flaky, [4, 9], policy, ChatFormat(tokenizer), config)
    episodes = [e for g in groups for e in g]
    assert metrics["rollout/env_errors"] == 1
    bad = groups[0][1]
    assert bad.stop_reason == "env_error" and bad.num_turns == 2
    assert bad.info["env_error"] == "ConnectionError: tool server went away"
    assert bad.reward == 0.0 and bad.action_mask[-1] == 1  # ends on its last policy turn
    others = [e for e in episodes if e is not bad]
    assert all(e.stop_reason == "max_turns" and e.num_turns == 3 for e in others)
    assert all("env_error" not in e.info for e in others)


def test_sampler_logprobs_match_a_forward_pass(tiny_model, tokenizer):
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.7, top_k=50, top_p=0.9)
    _, groups, _ = rollout(tiny_model, tokenizer, sampling=sampling)
    episodes = [e for g in groups for e in g]
    batch = collate(episodes, [0.0] * len(episodes), tokenizer.pad_token_id)
    with torch.no_grad():
        logits = (
            tiny_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            / 0.7
        )
    ids = batch["input_ids"][:, 1:]
    mask = batch["action_mask"][:, 1:].bool()
    rows = logits[:, :-1][mask]  # (P, V): the distributions policy tokens were drawn from
    for warp in (TopKLogitsWarper(50), TopPLogitsWarper(0.9)):
        rows = warp(None, rows)
    expected = torch.log_softmax(rows, -1).gather(1, ids[mask][:, None]).squeeze(1)
    stored = batch["sampler_logprobs"][:, 1:][mask]
    assert stored == pytest.approx(expected.tolist(), abs=1e-4)


def test_greedy_group_is_identical_and_temperature_varies(tiny_model, tokenizer):
    _, groups, _ = rollout(tiny_model, tokenizer, sampling=SamplingConfig(12, temperature=0.0))
    assert len({tuple(e.input_ids) for e in groups[0]}) == 1
    _, groups, _ = rollout(tiny_model, tokenizer, sampling=SamplingConfig(12, temperature=1.5))
    assert len({tuple(e.input_ids) for e in groups[0]}) > 1


def test_token_budget_stops_episodes(tiny_model, tokenizer):
    prompt_len = len(ChatFormat(tokenizer).prompt_ids(make_env().reset(seed=4)[0]))
    _, groups, _ = rollout(tiny_model, tokenizer, max_episode_tokens=prompt_len + 30)
    for ep in (e for g in groups for e in g):
        assert len(ep.input_ids) <= prompt_len + 30
        assert ep.stop_reason in {"max_tokens", "max_turns"}
    assert any(e.stop_reason == "max_tokens" for g in groups for e in g)


def test_config_validation():
    with pytest.raises(InvalidOptionError, match="group_size"):
        RolloutConfig(group_size=0)
    with pytest.raises(InvalidOptionError, match="top_p"):
        SamplingConfig(top_p=0.0)


@pytest.mark.slow
def test_real_smollm2_rollout_on_calculator(smollm2):
    model, tokenizer = smollm2
    config = RolloutConfig(
        group_size=2,
        max_turns=2,
        max_episode_tokens=1024,
        sampling=SamplingConfig(max_new_tokens=32),
        show_progress=False,
    )
    groups, metrics = collect(
        make_env, [0, 1], TransformersPolicy(model, tokenizer), ChatFormat(tokenizer), config
    )
    assert [len(g) for g in groups] == [2, 2]
    for ep in (e for g in groups for e in g):
        assert 1 <= ep.num_turns <= 2 and ep.num_policy_tokens > 0
        assert len(ep.input_ids) == len(ep.action_mask) == len(ep.sampler_logprobs) <= 1024
        assert all(lp <= 0 for lp, m in zip(ep.sampler_logprobs, ep.action_mask, strict=True) if m)
        assert ep.reward in (0.0, 1.0) and "turn" in ep.info
    assert metrics["rollout/generate_s"] > 0
