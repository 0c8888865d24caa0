"""Collect groups of episodes: G isolated env instances per task.

Two ways to batch (``RolloutConfig.batching``):

* ``lockstep`` (the default): every turn, one batched ``generate`` call serves every
  unfinished episode; then their env steps run concurrently in a thread pool; then the
  next turn starts. Every turn waits for its slowest row and its slowest env step.
* ``continuous``: each episode advances on its own. Its turn is generated in a running
  batch (:meth:`~agentenv.lm.sampler.TransformersPolicy.decoder`), its env steps in the
  pool while other episodes keep decoding, and its next turn joins the running batch
  as soon as the env has answered, KV cache continued, up to ``max_concurrency`` rows.
  No turn waits for the slowest row or env step of the batch; on a 2-core CPU it is as
  fast as lockstep for short contexts and slower for RAG's (``benchmarks/rollout.py``,
  docs/benchmarks.md). Which rows share a decode step depends on when env steps
  finish. A policy without ``decoder`` runs lockstep.

Either way a policy turn draws from the seed of (``sample_seed``, task seed, member,
turn), so an episode's tokens do not depend on which other episodes share its batch or on
timing (up to the float rounding of batched kernels). A trajectory stops at
``terminated``, ``truncated``, ``max_turns``, when its token budget is spent, or past its
wall-clock limit (``timeout``). An env step that raises ends only its own episode
(``stop_reason="env_error"``, the error in ``info["env_error"]``); an env whose ``reset``
raises gives an episode with no tokens and the same stop reason. Every episode records
each policy turn's token span, the env's step reward after it and the env's optional
per-turn reward (``info["turn_reward"]``): ``Episode.turn_spans``, ``step_rewards`` and
``turn_rewards``, for turn-level credit (``GRPOConfig.credit``).

:class:`~agentenv.lm.sampler.TransformersPolicy` records the log-prob of every sampled
token under the exact distribution it was sampled from (after temperature / top-k /
top-p). A turn ends at a stop token or, unless the sampling config says otherwise, at
one of the env's ``stop_strings``.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    Future,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from tqdm.auto import tqdm

from agentenv.lm.backend import Generation, PolicyBackend, SamplingConfig
from agentenv.rollout.config import RolloutConfig
from agentenv.rollout.episode import ChatFormat, Episode, EpisodeBuilder
from agentenv.rollout.stats import retrieval_stats, tool_call_stats


@dataclass
class _Trajectory:
    env: gym.Env
    builder: EpisodeBuilder | None  # None: the env's reset raised (a failed episode)
    group: int
    seed: int
    member: int  # index in its group
    turns: int = 0  # policy turns taken
    abandoned: Future | None = None  # an env step left running past the time limit
    done: bool = False
    reward: float = 0.0
    stop_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    step_rewards: list[float] = field(default_factory=list)  # per policy turn
    turn_rewards: list[float] = field(default_factory=list)  # info["turn_reward"] per turn


def trajectory_seed(sample_seed: int, task_seed: int, member: int, turn: int) -> int:
    """The sampling seed of one policy turn: a stable hash of its coordinates."""
    return random.Random(f"{sample_seed}-{task_seed}-{member}-{turn}").getrandbits(63)


def collect(
    make_env: Callable[[], gym.Env],
    seeds: Sequence[int],
    policy: PolicyBackend,
    fmt: ChatFormat,
    config: RolloutConfig,
    *,
    options: Sequence[dict[str, Any] | None] | None = None,
    sample_seed: int | None = None,
) -> tuple[list[list[Episode]], dict[str, float]]:
    """Run ``len(seeds)`` groups of ``config.group_size`` episodes.

    Args:
        make_env: Builds one fresh env instance (called G times per task).
        seeds: One reset seed per task; every episode of group ``b`` uses ``seeds[b]``.
        policy: The policy backend.
        fmt: Chat format of the policy's tokenizer.
        config: Rollout settings.
        options: Optional reset options per task (e.g. ``{"task_id": i}``).
        sample_seed: If set, each episode's turns draw their tokens from seeds of
            ``(sample_seed, task seed, member of the group, turn)``
            (:func:`trajectory_seed`), so an episode does not depend on which other
            episodes share its batch or process. None: the policy's global RNG.

    Returns:
        The groups (``groups[b]`` has G episodes of task ``b``) and metrics:
        ``rollout/generate_s`` (decoding), ``rollout/env_s`` (env steps, summed; they
        overlap decoding), ``rollout/env_wait_s`` (the env time not hidden: nothing was
        left to decode), ``rollout/total_s``, ``rollout/tokens`` (policy tokens),
        ``rollout/tokens_per_s`` (in the loop), ``rollout/rows_mean`` (rows per decode
        step) and ``rollout/env_errors``; with a policy that counts its prefills (the
        bundled sampler), ``rollout/prefill_s`` (the part of ``generate_s`` spent reading
        prompts and env replies), ``rollout/prefill_tokens`` (the tokens read) and
        ``rollout/rows_per_slot`` (rows decoded per sequence the model ran: rows whose
        tokens so far are the same share one, :mod:`agentenv.lm.decoding`) and
        ``rollout/tokens_per_step`` (tokens a row drew per decode step: above 1 where it
        took drafted tokens, :mod:`agentenv.lm.drafting`).
    """
    start = time.perf_counter()
    prefilled = _prefill_totals(policy)
    options = list(options) if options is not None else [None] * len(seeds)
    trajs: list[_Trajectory] = []
    for b, seed in enumerate(seeds):
        for member in range(config.group_size):
            env = make_env()
            try:
                obs, info = env.reset(seed=seed, options=options[b])
            except Exception as exc:  # noqa: BLE001 - a failed reset fails only this episode
                error = {"env_error": f"{type(exc).__name__}: {exc}"}
                failed = {"done": True, "stop_reason": "env_error", "info": error}
                trajs.append(_Trajectory(env, None, b, seed, member, **failed))
                continue
            builder = EpisodeBuilder(fmt, obs, config.max_episode_tokens)
            trajs.append(_Trajectory(env, builder, b, seed, member, info=info))
    sampling = config.sampling
    if sampling.stop_strings is None:  # the env's own turn-ending strings
        env = trajs[0].env.unwrapped if trajs else None
        stops = list(getattr(env, "stop_strings", None) or [])
        sampling = dataclasses.replace(sampling, stop_strings=stops)
    clock = _Clock()
    bar = tqdm(total=len(trajs), desc="rollout", disable=not config.show_progress, leave=False)
    ready = collections.deque(t for t in trajs if not t.done)  # waiting for a turn
    bar.update(len(trajs) - len(ready))
    clock.env_errors += len(trajs) - len(ready)  # resets that raised
    stepping: dict[Future, _Trajectory] = {}  # env steps in the pool
    continuous = config.batching == "continuous" and hasattr(policy, "decoder")
    decoder = policy.decoder(sampling) if continuous else None
    deadline = (
        {id(t): start + config.episode_timeout_s for t in trajs} if config.episode_timeout_s else {}
    )

    def turn_ready(t: _Trajectory) -> bool:
        """Finish ``t`` if it may not take another turn; else whether it may."""
        if deadline and time.perf_counter() > deadline[id(t)]:
            _finish(t, "timeout", bar)
        elif t.builder.room < 1:
            _finish(t, "max_tokens", bar)
        return not t.done

    def seed_of(t: _Trajectory) -> int | None:
        return (
            None if sample_seed is None else trajectory_seed(sample_seed, t.seed, t.member, t.turns)
        )

    def policy_turn(t: _Trajectory, g: Generation) -> None:
        t.builder.add_policy(g.token_ids, g.sampler_logprobs, g.text, g.hidden)
        t.turns += 1
        t.step_rewards.append(0.0)  # filled in when its step returns
        t.turn_rewards.append(0.0)
        stepping[pool.submit(_timed_step, t.env, g.text)] = t

    pool = ThreadPoolExecutor(max_workers=config.env_workers)
    try:
        while ready or stepping or (decoder is not None and len(decoder)):
            if decoder is not None:
                while ready and len(decoder) < config.max_concurrency:
                    t = ready.popleft()
                    if turn_ready(t):
                        room = min(sampling.max_new_tokens, t.builder.room)
                        decoder.add(t, t.builder.input_ids, seed=seed_of(t), max_new_tokens=room)
                if len(decoder):
                    t0 = time.perf_counter()
                    rows = len(decoder)
                    ended = decoder.step()
                    clock.decode(time.perf_counter() - t0, rows)
                    for t, g in ended:
                        policy_turn(t, g)
            elif ready and not stepping:  # lock-step: all waiting episodes at once
                batch = [t for t in ready if turn_ready(t)]  # the others just finished
                ready.clear()
                if batch:
                    budget = min(sampling.max_new_tokens, *(t.builder.room for t in batch))
                    turn = dataclasses.replace(sampling, max_new_tokens=budget)
                    prompts = [t.builder.input_ids for t in batch]
                    seeds_ = [seed_of(t) for t in batch]
                    t0 = time.perf_counter()
                    if sample_seed is None:
                        gens = policy.generate(prompts, turn)
                    else:
                        gens = policy.generate(prompts, turn, seeds=seeds_)
                    clock.decode(time.perf_counter() - t0, len(batch))
                    for t, g in zip(batch, gens, strict=True):
                        policy_turn(t, g)
            decoding = decoder is not None and len(decoder) > 0
            done = [f for f in stepping if f.done()]
            if decoder is None and stepping:  # lockstep: the whole turn's env steps
                done = []
            if not done and stepping and not decoding and not (ready and decoder is not None):
                t0 = time.perf_counter()  # nothing to decode: wait for an env
                limit = None
                if deadline:
                    limit = max(0.0, min(deadline[id(t)] for t in stepping.values()) - t0)
                until = FIRST_COMPLETED if decoder is not None else ALL_COMPLETED
                wait(stepping, timeout=limit, return_when=until)
                done = [f for f in stepping if f.done()]  # in the order the steps began
                clock.env_wait_s += time.perf_counter() - t0
                if not done:  # an episode's wall-clock limit passed inside its env step
                    now = time.perf_counter()
                    for f, t in list(stepping.items()):
                        if now > deadline[id(t)]:
                            del stepping[f]
                            _finish(t, "timeout", bar)
                            t.abandoned = f  # its env closes once the step returns
            for f in done:
                t = stepping.pop(f)
                result, seconds = f.result()
                clock.env_s += seconds
                if isinstance(result, str):  # the env raised: this episode ends here
                    t.info = {**t.info, "env_error": result}
                    clock.env_errors += 1
                    _finish(t, "env_error", bar)
                    continue
                obs, reward, terminated, truncated, info = result
                t.reward += float(reward)
                t.step_rewards[-1] = float(reward)
                t.turn_rewards[-1] = float(info.get("turn_reward", 0.0))
                t.info = info
                if terminated or truncated:
                    _finish(t, "terminated" if terminated else "truncated", bar)
                elif t.turns >= config.max_turns:
                    _finish(t, "max_turns", bar)
                elif not t.builder.add_env(obs):
                    _finish(t, "max_tokens", bar)
                else:
                    ready.append(t)
    finally:  # a step left running past its time limit is not waited for
        pool.shutdown(wait=False, cancel_futures=True)
    bar.close()
    if hasattr(policy, "clear_cache"):  # no episode of this batch will be continued
        policy.clear_cache()
    for t in trajs:
        if not t.done:
            _finish(t, "max_turns", bar)
        if t.abandoned is None:
            t.env.close()
        else:  # still inside a step past its time limit: close it when the step returns
            t.abandoned.add_done_callback(lambda _, env=t.env: env.close())
    groups: list[list[Episode]] = [[] for _ in seeds]
    for t in trajs:
        outcome = {"reward": t.reward, "stop_reason": t.stop_reason, "info": t.info}
        outcome |= {"step_rewards": t.step_rewards, "turn_rewards": t.turn_rewards}
        groups[t.group].append(
            Episode([], [], [], group=t.group, seed=t.seed, **outcome)  # no reset, no tokens
            if t.builder is None
            else t.builder.build(group=t.group, seed=t.seed, **outcome)
        )
    tokens = sum(e.num_policy_tokens for g in groups for e in g)
    episodes = [e for g in groups for e in g]
    calls = {**tool_call_stats(episodes), **retrieval_stats(episodes)}
    metrics = {
        "rollout/generate_s": clock.generate_s,
        "rollout/env_s": clock.env_s,
        "rollout/env_wait_s": clock.env_wait_s,
        "rollout/total_s": time.perf_counter() - start,
        "rollout/tokens": float(tokens),
        "rollout/tokens_per_s": tokens / clock.generate_s if clock.generate_s else 0.0,
        "rollout/rows_mean": clock.rows / clock.steps if clock.steps else 0.0,
        "rollout/env_errors": float(clock.env_errors),
        **{f"rollout/{k}": v for k, v in calls.items()},
    }
    if prefilled is not None:
        seconds, read, rows, slots, drawn = _prefill_totals(policy)
        metrics["rollout/prefill_s"] = seconds - prefilled[0]
        metrics["rollout/prefill_tokens"] = float(read - prefilled[1])
        if slots > prefilled[3]:
            metrics["rollout/rows_per_slot"] = (rows - prefilled[2]) / (slots - prefilled[3])
            metrics["rollout/tokens_per_step"] = (drawn - prefilled[4]) / (rows - prefilled[2])
    return groups, metrics


def _prefill_totals(policy: PolicyBackend) -> tuple[float, int, int, int, int] | None:
    """The policy's prefill seconds and tokens, rows decoded, slots run and tokens drawn
    so far (None: it does not count them)."""
    names = ("prefill_s", "prefill_tokens", "decoded_rows", "decoded_slots", "decoded_tokens")
    totals = [getattr(policy, name, None) for name in names]
    return None if any(t is None for t in totals) else tuple(totals)  # type: ignore[return-value]


@dataclass
class _Clock:
    """Where a collection's time went."""

    generate_s: float = 0.0  # in decode steps / generate calls
    env_s: float = 0.0  # summed over env steps (they overlap each other and generation)
    env_wait_s: float = 0.0  # the loop had nothing to decode and waited for an env
    steps: int = 0  # decode steps (generate calls for a plain backend)
    rows: int = 0  # rows summed over them
    env_errors: int = 0

    def decode(self, seconds: float, rows: int) -> None:
        self.generate_s += seconds
        self.steps += 1
        self.rows += rows


def _timed_step(env: gym.Env, action: str) -> tuple[tuple[Any, ...] | str, float]:
    t0 = time.perf_counter()
    result = _step(env, action)
    return result, time.perf_counter() - t0


def _step(env: gym.Env, action: str) -> tuple[Any, ...] | str:
    """``env.step(action)``, or the error it raised as ``"Type: message"``.

    A bug or an outage in one env instance (a crashed tool server, a malformed task) ends
    that episode instead of the whole batch. ``KeyboardInterrupt`` still stops the run.
    """
    try:
        return env.step(action)
    except Exception as exc:  # noqa: BLE001 - any env failure ends only its own episode
        return f"{type(exc).__name__}: {exc}"


def _finish(t: _Trajectory, reason: str, bar: Any) -> None:
    t.done = True
    t.stop_reason = reason
    bar.update(1)


class ScriptedPolicy:
    """A deterministic policy backend for tests and demos: ``respond(prompt_text) -> text``.

    The reply is tokenized once and ended with the first stop token, then returned as
    if sampled (log-prob 0.0). ``self.generated`` keeps every id list it returned.

    Args:
        tokenizer: The tokenizer whose ids the episodes use.
        respond: Maps the decoded prompt (the whole episode so far) to the next reply.
    """

    def __init__(self, tokenizer: Any, respond: Callable[[str], str]):
        self.tokenizer = tokenizer
        self.respond = respond
        self.generated: list[list[int]] = []

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,  # scripted: nothing random
    ) -> list[Generation]:
        out = []
        for prompt in prompts:
            text = self.respond(self.tokenizer.decode(list(prompt), skip_special_tokens=False))
            ids = self.tokenizer.encode(text, add_special_tokens=False)[
                : sampling.max_new_tokens - 1
            ]
            ids.append(self.tokenizer.eos_token_id)
            self.generated.append(ids)
            out.append(Generation(ids, [0.0] * len(ids), self.tokenizer.decode(ids[:-1]), "stop"))
        return out
