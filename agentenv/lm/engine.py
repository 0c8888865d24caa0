"""What every generation engine takes and returns (torch-free).

An engine continues token-id prompts: :class:`PolicyBackend` is its one method,
:class:`SamplingConfig` how a turn is sampled, :class:`Generation` one sampled turn. The
rollout loop, evaluation and the trainer depend on these only; :class:`TransformersPolicy`
(:mod:`agentenv.lm.sampler`) is the bundled engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agentenv.config import option
from agentenv.errors import InvalidOptionError


@dataclass
class SamplingConfig:
    """How each policy turn is sampled. A training run's trainer reads ``temperature`` from
    this same object (its log-probs divide logits by it, as the sampler did)."""

    max_new_tokens: int = option(256, "Most tokens per policy turn.")
    temperature: float = option(1.0, "Sampling temperature; 0 means greedy decoding.")
    top_p: float = option(1.0, "Nucleus sampling threshold (1.0 = off).")
    top_k: int = option(0, "Keep the k most likely tokens (0 = off).")
    stop_strings: list[str] | None = option(
        None,
        "A turn ends once its text holds one of these (the token completing it is kept). "
        "None: the env's own (e.g. </tool_call>, </answer>); empty: stop tokens only.",
    )

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidOptionError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InvalidOptionError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidOptionError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidOptionError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.stop_strings is not None and not all(
            isinstance(s, str) and s for s in self.stop_strings
        ):
            raise InvalidOptionError(
                f"stop_strings must be non-empty strings, got {self.stop_strings!r}"
            )


@dataclass
class Generation:
    """One sampled policy turn: token ids exactly as sampled and their log-probs."""

    token_ids: list[int]
    sampler_logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (stop token), "stop_string" or "length"


class PolicyBackend(Protocol):
    """Anything that continues a batch of token-id prompts."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """One continuation per prompt, in order. With ``seeds`` (one per prompt), each
        row's random draws come from its own seed, so a row's result does not depend on
        the other rows of the batch (``collect`` passes them when given a ``sample_seed``;
        a backend that cannot honour them should raise)."""
        ...
