"""Collect groups of episodes: G isolated env instances per task, batched generation.

Each turn, one batched ``generate`` call (KV cache on, left padding) serves every
unfinished trajectory of the batch; then their environment steps run concurrently
in a thread pool (tool timeouts apply inside each env). A trajectory stops at
``terminated``, ``truncated``, ``max_turns`` or when its token budget is spent.

Policies are pluggable (:class:`PolicyBackend`); :class:`TransformersPolicy` runs a
local Hugging Face model and records the log-prob of every sampled token under
the exact distribution it was sampled from (after temperature / top-k / top-p).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium as gym
import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

from agentenv.episode import ChatFormat, Episode, EpisodeBuilder
from agentenv.errors import InvalidOptionError


@dataclass
class SamplingConfig:
    """How each policy turn is sampled.

    Attributes:
        max_new_tokens: Most tokens per policy turn.
        temperature: Sampling temperature; 0 means greedy decoding.
        top_p: Nucleus sampling threshold (1.0 = off).
        top_k: Keep the k most likely tokens (0 = off).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidOptionError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InvalidOptionError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidOptionError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    """One sampled policy turn: token ids exactly as sampled and their log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (sampled a stop token) or "length"


class PolicyBackend(Protocol):
    """Anything that continues a batch of token-id prompts."""

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        """One continuation per prompt, in order."""
        ...


class _RecordLogprobs(LogitsProcessor):
    """Applies temperature/top-k/top-p itself and records log p(sampled token).

    Runs as the last processor; ``generate`` is called with neutral sampling
    settings, so the distribution it samples from is exactly the one recorded.
    """

    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.temperature = temperature or 1.0
        self.warpers = [
            w
            for w in (
                TopKLogitsWarper(top_k) if top_k > 0 else None,
                TopPLogitsWarper(top_p) if top_p < 1 else None,
            )
            if w
        ]
        self.prev: torch.Tensor | None = None  # (B, V) log-probs of the previous step
        self.steps: list[torch.Tensor] = []  # each (B,)

    def _take(self, tokens: torch.Tensor) -> None:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, tokens[:, None]).squeeze(1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev is not None:
            self._take(input_ids[:, -1])
        scores = scores / self.temperature
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(B, steps) log-probs once generation is over."""
        self._take(last_tokens)
        self.prev = None
        return torch.stack(self.steps, dim=1).cpu()


class TransformersPolicy:
    """A local ``transformers`` causal LM as a batched policy.

    Args:
        model: The causal LM (a peft-wrapped model works too).
        tokenizer: Its tokenizer (pad token needed; prompts are left-padded).
        stop_token_ids: Ids that end a turn (default: the tokenizer's and
            generation config's EOS ids).
    """

    def __init__(self, model: Any, tokenizer: Any, *, stop_token_ids: Sequence[int] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        if stop_token_ids is None:
            eos = getattr(model.generation_config, "eos_token_id", None)
            eos = eos if isinstance(eos, list) else [eos]
            stop_token_ids = [i for i in {tokenizer.eos_token_id, *eos} if i is not None]
        self.stop_token_ids = list(stop_token_ids)
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        )

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        device = self.model.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention_mask[i, width - len(p) :] = 1
        recorder = _RecordLogprobs(sampling.temperature, sampling.top_k, sampling.top_p)
        was_training = self.model.training
        self.model.eval()
        out = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sampling.temperature > 0,
            temperature=1.0,
            top_k=None,
            top_p=None,
            logits_processor=LogitsProcessorList([recorder]),
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        self.model.train(was_training)
        new = out[:, width:].cpu()  # (B, steps)
        logprobs = recorder.finish(out[:, -1])
        return [self._cut(row, lp) for row, lp in zip(new.tolist(), logprobs.tolist(), strict=True)]

    def _cut(self, ids: list[int], logprobs: list[float]) -> Generation:
        """Cut at the first stop token (kept: the policy sampled it)."""
        stops = set(self.stop_token_ids)
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        ids, logprobs = ids[:end], logprobs[:end]
        reason = "stop" if ids and ids[-1] in stops else "length"
        return Generation(
            ids, logprobs, self.tokenizer.decode(ids, skip_special_tokens=True), reason
        )


@dataclass
class RolloutConfig:
    """How episodes are collected.

    Attributes:
        group_size: Episodes per task (G); all reset with the task's seed.
        max_turns: Policy turns per episode (the env's own limit may be lower).
        max_episode_tokens: Token budget per episode (prompt + all turns).
        sampling: Per-turn sampling settings.
        env_workers: Threads stepping environments concurrently.
        show_progress: Show a progress bar over the batch.
    """

    group_size: int = 8
    max_turns: int = 5
    max_episode_tokens: int = 2048
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    env_workers: int = 8
    show_progress: bool = True

    def __post_init__(self) -> None:
        for name in ("group_size", "max_turns", "max_episode_tokens", "env_workers"):
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class _Trajectory:
    env: gym.Env
    builder: EpisodeBuilder
    group: int
    seed: int
    done: bool = False
    reward: float = 0.0
    stop_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def collect(
    make_env: Callable[[], gym.Env],
    seeds: Sequence[int],
    policy: PolicyBackend,
    fmt: ChatFormat,
    config: RolloutConfig,
    *,
    options: Sequence[dict[str, Any] | None] | None = None,
) -> tuple[list[list[Episode]], dict[str, float]]:
    """Run ``len(seeds)`` groups of ``config.group_size`` episodes.

    Args:
        make_env: Builds one fresh env instance (called G times per task).
        seeds: One reset seed per task; every episode of group ``b`` uses ``seeds[b]``.
        policy: The policy backend.
        fmt: Chat format of the policy's tokenizer.
        config: Rollout settings.
        options: Optional reset options per task (e.g. ``{"task_id": i}``).

    Returns:
        The groups (``groups[b]`` has G episodes of task ``b``) and timing metrics:
        ``rollout/generate_s``, ``rollout/env_s``, ``rollout/total_s``, ``rollout/tokens``.
    """
    start = time.perf_counter()
    options = list(options) if options is not None else [None] * len(seeds)
    trajs: list[_Trajectory] = []
    for b, seed in enumerate(seeds):
        for _ in range(config.group_size):
            env = make_env()
            obs, info = env.reset(seed=seed, options=options[b])
            builder = EpisodeBuilder(fmt, obs, config.max_episode_tokens)
            trajs.append(_Trajectory(env, builder, b, seed, info=info))
    gen_s = env_s = 0.0
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
            sampling = config.sampling
            budget = min(t.builder.room for t in active)
            if budget < sampling.max_new_tokens:
                sampling = SamplingConfig(
                    budget, sampling.temperature, sampling.top_p, sampling.top_k
                )
            gens = policy.generate([t.builder.input_ids for t in active], sampling)
            t1 = time.perf_counter()
            for t, g in zip(active, gens, strict=True):
                t.builder.add_policy(g.token_ids, g.logprobs, g.text)
            results = list(pool.map(lambda t, g: t.env.step(g.text), active, gens))
            env_s += time.perf_counter() - t1
            gen_s += t1 - t0
            for t, (obs, reward, terminated, truncated, info) in zip(active, results, strict=True):
                t.reward += float(reward)
                t.info = info
                if terminated or truncated:
                    _finish(t, "terminated" if terminated else "truncated", bar)
                elif turn == config.max_turns - 1:
                    _finish(t, "max_turns", bar)
                elif not t.builder.add_env(obs):
                    _finish(t, "max_tokens", bar)
    bar.close()
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
    }
    return groups, metrics


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
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
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
