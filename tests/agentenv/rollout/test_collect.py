import collections
import time

import gymnasium as gym
import pytest
import torch
from draws import assert_same_episode_draws
from transformers import TopKLogitsWarper, TopPLogitsWarper

import agentenv
from agentenv.errors import InvalidOptionError
from agentenv.lm.backend import SamplingConfig
from agentenv.lm.reference import ReferencePolicy
from agentenv.lm.sampler import TransformersPolicy
from agentenv.rollout.collect import collect
from agentenv.rollout.config import RolloutConfig
from agentenv.rollout.episode import ChatFormat, collate


class RecordingPolicy(TransformersPolicy):
    """Keeps every turn it returned, by (group, member), to compare with what the episodes
    stored (the test's 2 x 3 episodes all take every turn)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.turns = collections.defaultdict(list)

    def decoder(self, sampling):
        decoder = super().decoder(sampling)
        step = decoder.step

        def recorded():
            ended = step()
            for trajectory, generation in ended:
                self.turns[trajectory.group, trajectory.member].append(generation)
            return ended

        decoder.step = recorded
        return decoder

    def generate(self, prompts, sampling, **kwargs):  # lockstep: one call a turn, in order
        gens = super().generate(prompts, sampling, **kwargs)
        if len(prompts) == 6:
            for i, generation in enumerate(gens):
                self.turns[divmod(i, 3)].append(generation)
        return gens


def make_env():
    return agentenv.make("Calculator-v0", source="basic_arithmetic", num_tasks=50)


def rollout(model, tokenizer, dtype="float32", draft_tokens=None, **kwargs):
    sampling = kwargs.pop("sampling", SamplingConfig(max_new_tokens=12))
    config = RolloutConfig(
        group_size=3, max_turns=2, sampling=sampling, show_progress=False, **kwargs
    )
    policy = RecordingPolicy(model, tokenizer, dtype=dtype, draft_tokens=draft_tokens)
    groups, metrics = collect(make_env, [4, 9], policy, ChatFormat(tokenizer), config)
    return policy, groups, metrics


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_groups_share_task_and_store_generated_ids(tiny_model, tokenizer, batching):
    # (without drafts: a decode step is one token per row, as counted by hand below)
    policy, groups, metrics = rollout(tiny_model, tokenizer, batching=batching, draft_tokens=0)
    assert [len(g) for g in groups] == [3, 3]
    for b, group in enumerate(groups):
        prompts = {tuple(e.input_ids[: e.policy_spans()[0][0]]) for e in group}
        assert len(prompts) == 1  # same seed -> same task -> same prompt tokens
        assert all(e.seed == [4, 9][b] and e.group == b for e in group)
    episodes = [e for g in groups for e in g]
    for b, group in enumerate(groups):
        for m, ep in enumerate(group):
            gens = policy.turns[b, m]
            assert len(gens) == ep.num_turns == 2
            for (start, end), gen in zip(ep.policy_spans(), gens, strict=True):
                assert ep.input_ids[start:end] == gen.token_ids
                assert ep.sampler_logprobs[start:end] == pytest.approx(gen.sampler_logprobs)
    assert set(metrics) == {
        "rollout/generate_s",
        "rollout/env_s",
        "rollout/total_s",
        "rollout/tokens",
        "rollout/env_errors",
        "rollout/env_wait_s",
        "rollout/tokens_per_s",
        "rollout/rows_mean",
        "rollout/prefill_s",
        "rollout/prefill_tokens",
        "rollout/rows_per_slot",
        "rollout/tokens_per_step",
        "rollout/tool_calls_mean",
        "rollout/second_call_rate",
        "rollout/tool_calls/0",
        "rollout/tool_calls/1",
        "rollout/tool_calls/2",
        "rollout/tool_calls/3+",
    }
    assert metrics["rollout/env_errors"] == 0
    assert metrics["rollout/tokens"] == sum(e.num_policy_tokens for e in episodes)
    assert all(e.stop_reason == "max_turns" and e.num_turns == 2 for e in episodes)
    # Prefill by hand. Turn 1: the two groups' prompts, their common prefix once. Turn 2:
    # each episode continues its saved cache (its prompt and turn 1 but the last sampled
    # token, which was never fed back), so it reads that token and the env's reply.
    first = [group[0].input_ids[: group[0].policy_spans()[0][0]] for group in groups]
    common = next(i for i, (a, b) in enumerate(zip(*first, strict=False)) if a != b)
    prefix = min(common, *(len(p) - 1 for p in first))
    turn1 = prefix + sum(len(p) - prefix for p in first)
    spans = [e.policy_spans() for e in episodes]
    turn2 = sum(second[0] - (first_turn[1] - 1) for first_turn, second in spans)
    assert metrics["rollout/prefill_tokens"] == turn1 + turn2
    assert 0 < metrics["rollout/prefill_s"] < metrics["rollout/generate_s"]
    # Decode steps by hand: at a step, rows with the same prompt and tokens so far share a
    # slot (lock-step: a turn's rows all start together; the engine admits a turn-2 row
    # when its env answers, so there it is at least 1)
    rows = slots = 0
    for turn in range(2):
        seqs = []
        for e in episodes:
            start, end = e.policy_spans()[turn]
            seqs.append((tuple(e.input_ids[:start]), tuple(e.input_ids[start:end])))
        for t in range(max(len(tokens) for _, tokens in seqs)):
            alive = [(prompt, tokens[:t]) for prompt, tokens in seqs if len(tokens) > t]
            rows, slots = rows + len(alive), slots + len(set(alive))
    assert metrics["rollout/tokens_per_step"] == 1.0
    if batching == "lockstep":
        assert metrics["rollout/rows_per_slot"] == pytest.approx(rows / slots) and slots < rows
    else:
        assert 1 <= metrics["rollout/rows_per_slot"] <= rows / slots


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


class TurnRewardEnv(FlakyEnv):
    """Its k-th step (from 1) rewards 0.25 k and reports ``info["turn_reward"] = k``."""

    def step(self, action):
        obs, _, terminated, truncated, info = super().step(action)
        return obs, 0.25 * self.steps, terminated, truncated, {**info, "turn_reward": self.steps}


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_each_turn_records_its_span_step_reward_and_turn_reward(tiny_model, tokenizer, batching):
    """Per-turn records: the spans cover exactly the policy tokens, turn by turn; the step
    rewards add up to the episode's reward; a turn whose step raised gets 0 for both."""
    made = []

    def make():
        made.append(None)
        return TurnRewardEnv(make_env(), bad=len(made) == 2)

    config = RolloutConfig(
        group_size=3, max_turns=2, sampling=SamplingConfig(max_new_tokens=8),
        show_progress=False, batching=batching,
    )  # fmt: skip
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    groups, _ = collect(make, [4, 9], policy, ChatFormat(tokenizer), config)
    episodes = [e for g in groups for e in g]
    for e in episodes:
        covered = [i for s, t in e.turn_spans for i in range(s, t)]
        assert covered == [i for i, m in enumerate(e.action_mask) if m]
        assert len(e.turn_spans) == e.num_turns == len(e.step_rewards) == len(e.turn_rewards)
        assert sum(e.step_rewards) == e.reward
    failed = [e for e in episodes if e.failed]
    assert len(failed) == 1 and failed[0].step_rewards == [0.25, 0.0]
    assert failed[0].turn_rewards == [1.0, 0.0]
    others = [e for e in episodes if not e.failed]
    assert all(e.step_rewards == [0.25, 0.5] and e.turn_rewards == [1.0, 2.0] for e in others)


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_an_env_that_raises_ends_only_its_own_episode(tiny_model, tokenizer, batching):
    made = []

    def make_flaky():
        made.append(None)
        return FlakyEnv(make_env(), bad=len(made) == 2)  # group 0, member 1

    config = RolloutConfig(
        group_size=3,
        max_turns=3,
        sampling=SamplingConfig(max_new_tokens=8),
        show_progress=False,
        batching=batching,
    )
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
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


class ResetFails(gym.Wrapper):
    def reset(self, **kwargs):
        raise TimeoutError("sandbox did not start")


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_an_env_whose_reset_raises_fails_only_its_episode_and_grpo_skips_it(
    tiny_model, tokenizer, batching
):
    from algorithms.config import GRPOConfig
    from algorithms.grpo import GRPO

    made = []

    def make():
        made.append(None)
        return ResetFails(make_env()) if len(made) == 3 else make_env()  # group 1, member 0

    config = RolloutConfig(
        group_size=2,
        max_turns=2,
        sampling=SamplingConfig(max_new_tokens=6),
        show_progress=False,
        batching=batching,
    )
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    groups, metrics = collect(make, [4, 9], policy, ChatFormat(tokenizer), config)
    bad = groups[1][0]
    assert (bad.stop_reason, bad.failed, bad.input_ids, bad.num_turns) == ("env_error", True, [], 0)
    assert bad.info == {"env_error": "TimeoutError: sandbox did not start"} and bad.seed == 9
    assert metrics["rollout/env_errors"] == 1
    assert all(e.num_turns == 2 and not e.failed for e in groups[0] + groups[1][1:])
    sampling = SamplingConfig(max_new_tokens=6)
    trainer = GRPO(tiny_model, tokenizer, GRPOConfig(learning_rate=1e-3), sampling=sampling)
    out = trainer.learn(groups)  # the empty episode is left out, not rejected
    assert out["frac_failed"] == 0.25 and trainer.last_advantages[1].tolist() == [0.0, 0.0]


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


class SlowEnv(gym.Wrapper):
    """Sleeps a different time on each step, so env steps end in another order than they
    began."""

    def __init__(self, env, delays):
        super().__init__(env)
        self.delays = delays

    def step(self, action):
        time.sleep(self.delays.pop(0) if self.delays else 0.0)
        return self.env.step(action)


ENGINE_SAMPLING = SamplingConfig(max_new_tokens=10, stop_strings=[])


def engine_rollout(model, tokenizer, policy=None, make=make_env, **config):
    config = RolloutConfig(
        **{
            "group_size": 3,
            "max_turns": 3,
            "sampling": ENGINE_SAMPLING,
            "show_progress": False,
            "batching": "continuous",
            **config,
        }
    )
    policy = policy or TransformersPolicy(model, tokenizer, dtype="float32")
    return collect(make, [4, 9], policy, ChatFormat(tokenizer), config, sample_seed=7)


def same_episodes(a, b, model):
    """The episodes of two rollouts with the same seeds (float32), up to a draw that
    rounding may flip (tests/helpers/draws.py)."""
    assert_same_episode_draws(a, b, model=model, sampling=ENGINE_SAMPLING, sample_seed=7)


def test_the_engine_collects_the_lock_step_episodes_in_float32(tiny_model, tokenizer):
    lock_step, m0 = engine_rollout(tiny_model, tokenizer, batching="lockstep")
    engine, m1 = engine_rollout(tiny_model, tokenizer, max_concurrency=4)
    same_episodes(engine, lock_step, tiny_model)
    assert [e.num_turns for g in engine for e in g] == [3] * 6
    assert m1["rollout/rows_mean"] <= 4 < m0["rollout/rows_mean"]  # 6 rows a call in lock-step


def test_env_steps_that_end_out_of_order_change_no_episode(tiny_model, tokenizer):
    """Episodes rejoin the batch in whatever order their envs answer; each one's tokens
    come from its own seed, so the episodes are those of instant envs."""
    delays = iter([[0.2, 0.0], [0.0, 0.15], [0.05, 0.1], [0.1, 0.0], [0.0, 0.0], [0.15, 0.05]])

    def make_slow():
        return SlowEnv(make_env(), list(next(delays)))

    instant, _ = engine_rollout(tiny_model, tokenizer)
    slow, metrics = engine_rollout(tiny_model, tokenizer, make=make_slow)
    same_episodes(slow, instant, tiny_model)
    assert metrics["rollout/env_s"] >= 0.75  # the sleeps (0.8 s), summed over episodes


def test_an_episode_past_its_time_limit_ends_without_waiting_for_its_env(tiny_model, tokenizer):
    made = []

    def make_stuck():
        made.append(None)
        return SlowEnv(make_env(), [6.0] if len(made) == 1 else [])

    t0 = time.perf_counter()
    groups, _ = engine_rollout(
        tiny_model, tokenizer, make=make_stuck, max_turns=1, episode_timeout_s=2.0
    )
    assert time.perf_counter() - t0 < 5.0  # did not wait for the 6 s step
    stuck = groups[0][0]
    assert stuck.stop_reason == "timeout" and stuck.num_turns == 1
    others = [e.stop_reason for g in groups for e in g if e is not stuck]
    assert others == ["max_turns"] * 5, others


@pytest.mark.parametrize("engine", ["lockstep", "continuous", "reference"])
def test_each_turn_records_the_hidden_state_its_first_token_was_drawn_from(
    tiny_model, tokenizer, engine
):
    """``Episode.turn_hidden``: what the sampler's LM head read before each turn's first
    token is the learner's hidden state at that turn's start (``hidden_before``, float32),
    and not its neighbour's."""
    from algorithms.logprobs import hidden_before

    config = RolloutConfig(
        group_size=3, max_turns=3, sampling=ENGINE_SAMPLING, show_progress=False,
        batching="continuous" if engine == "continuous" else "lockstep",
    )  # fmt: skip
    cls = ReferencePolicy if engine == "reference" else TransformersPolicy
    off = cls(tiny_model, tokenizer, dtype="float32")  # the default: nothing recorded
    groups, _ = collect(make_env, [4, 9], off, ChatFormat(tokenizer), config, sample_seed=7)
    assert all(e.turn_hidden is None for g in groups for e in g)
    policy = cls(tiny_model, tokenizer, dtype="float32", record_hidden=True)
    groups, _ = collect(make_env, [4, 9], policy, ChatFormat(tokenizer), config, sample_seed=7)
    episodes = [e for g in groups for e in g]
    assert sum(e.num_turns for e in episodes) >= 12  # most episodes take several turns
    for e in episodes:
        assert e.turn_hidden is not None and len(e.turn_hidden) == e.num_turns
        ids = torch.tensor([e.input_ids])
        for shift, same in ((0, True), (1, False)):
            marked = torch.zeros(ids.shape, dtype=torch.bool)
            for start, _ in e.turn_spans:
                marked[0, start + shift] = True
            with torch.no_grad():
                expected = hidden_before(tiny_model, ids, torch.ones_like(ids), marked)
            close = torch.allclose(torch.stack(e.turn_hidden), expected, atol=1e-4, rtol=0)
            assert close == same, (shift, e.turn_spans)
