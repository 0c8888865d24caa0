"""Collect groups of episodes: G isolated env instances per task, batched generation.

Each turn, one batched ``generate`` call (KV cache on, left padding) serves every
unfinished trajectory of the batch; then their environment steps run concurrently
in a thread pool (tool timeouts apply inside each env). A trajectory stops at
``terminated``, ``truncated``, ``max_turns`` or when its token budget is spent. An env
step that raises ends only its own episode (``stop_reason="env_error"``, the error in
``info["env_error"]``, counted in ``rollout/env_errors``); the rest of the batch goes on.

Policies are pluggable (:class:`~agentenv.lm.engine.PolicyBackend`);
:class:`~agentenv.lm.sampler.TransformersPolicy` runs a local Hugging Face model and
records the log-prob of every sampled token under the exact distribution it was
sampled from (after temperature / top-k / top-p). A turn ends at a stop token or, unless
the sampling config says otherwise, at one of the env's ``stop_strings``.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from tqdm.auto import tqdm

from agentenv.lm.engine import Generation, PolicyBackend, SamplingConfig
from agentenv.rollout.config import RolloutConfig
from agentenv.rollout.episode import ChatFormat, Episode, EpisodeBuilder


@dataclass
class _Trajectory:
    env: gym.Env
    builder: EpisodeBuilder
    group: int
    seed: int
    member: int  # index in its group
    done: bool = False
    reward: float = 0.0
    stop_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)


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
        The groups (``groups[b]`` has G episodes of task ``b``) and timing metrics:
        ``rollout/generate_s``, ``rollout/env_s``, ``rollout/total_s``, ``rollout/tokens``.
    """
    start = time.perf_counter()
    options = list(options) if options is not None else [None] * len(seeds)
    trajs: list[_Trajectory] = []
    for b, seed in enumerate(seeds):
        for member in range(config.group_size):
            env = make_env()
            obs, info = env.reset(seed=seed, options=options[b])
            builder = EpisodeBuilder(fmt, obs, config.max_episode_tokens)
            trajs.append(_Trajectory(env, builder, b, seed, member, info=info))
    sampling = config.sampling
    if sampling.stop_strings is None:  # the env's own turn-ending strings
        env = trajs[0].env.unwrapped if trajs else None
        stops = list(getattr(env, "stop_strings", None) or [])
        sampling = dataclasses.replace(sampling, stop_strings=stops)
    gen_s = env_s = 0.0
    env_errors = 0
    bar = tqdm(total=len(trajs), desc="rollout", disable=not config.show_progress, leave=False)
    with ThreadPoolExecutor(max_workers=config.env_workers) as pool:
        for turn in range(config.max_turns):
            active = [t for t in trajs if not t.done]
            for t in active:  # budget: stop those with no room for a turn
                if t.builder.room < 1:
                    _finish(t, "max_tokens", bar)
            active = [t for t in active if not t.done]
            if not active:
                break
            t0 = time.perf_counter()
            budget = min(t.builder.room for t in active)
            turn_sampling = sampling
            if budget < sampling.max_new_tokens:
                turn_sampling = dataclasses.replace(sampling, max_new_tokens=budget)
            prompts = [t.builder.input_ids for t in active]
            if sample_seed is None:
                gens = policy.generate(prompts, turn_sampling)
            else:
                turn_seeds = [trajectory_seed(sample_seed, t.seed, t.member, turn) for t in active]
                gens = policy.generate(prompts, turn_sampling, seeds=turn_seeds)
            t1 = time.perf_counter()
            for t, g in zip(active, gens, strict=True):
                t.builder.add_policy(g.token_ids, g.sampler_logprobs, g.text)
            results = list(pool.map(lambda t, g: _step(t.env, g.text), active, gens))
            env_s += time.perf_counter() - t1
            gen_s += t1 - t0
            for t, result in zip(active, results, strict=True):
                if isinstance(result, str):  # the env raised: this episode ends here
                    t.info = {**t.info, "env_error": result}
                    env_errors += 1
                    _finish(t, "env_error", bar)
                    continue
                obs, reward, terminated, truncated, info = result
                t.reward += float(reward)
                t.info = info
                if terminated or truncated:
                    _finish(t, "terminated" if terminated else "truncated", bar)
                elif turn == config.max_turns - 1:
                    _finish(t, "max_turns", bar)
                elif not t.builder.add_env(obs):
                    _finish(t, "max_tokens", bar)
    bar.close()
    if hasattr(policy, "clear_cache"):  # no episode of this batch will be continued
        policy.clear_cache()
    for t in trajs:
        if not t.done:
            _finish(t, "max_turns", bar)
        t.env.close()
    groups: list[list[Episode]] = [[] for _ in seeds]
    for t in trajs:
        groups[t.group].append(
            t.builder.build(
                reward=t.reward, stop_reason=t.stop_reason, info=t.info, group=t.group, seed=t.seed
            )
        )
    tokens = sum(e.num_policy_tokens for g in groups for e in g)
    metrics = {
        "rollout/generate_s": gen_s,
        "rollout/env_s": env_s,
        "rollout/total_s": time.perf_counter() - start,
        "rollout/tokens": float(tokens),
        "rollout/env_errors": float(env_errors),
    }
    return groups, metrics


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
