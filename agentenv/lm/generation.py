"""Fast local generation: the Hugging Face policy backend of rollouts and evaluation.

:class:`TransformersPolicy` continues a batch of token-id prompts with a local causal LM
and records, for every sampled token, its log-prob under the exact distribution it was
drawn from (after temperature / top-k / top-p). It runs its own decode loop over the
model's forward pass instead of ``model.generate``, because that lets it:

* **sample from a plain copy in the compute dtype**, bfloat16 where the hardware supports
  it (:func:`resolve_dtype`), refreshed after every optimizer step
  (:meth:`TransformersPolicy.sync`, also done automatically when the trained weights
  changed) -- the way TRL syncs weights into vLLM. A LoRA adapter stays *unmerged* in the
  copy (the base weights are shared with the trained model when they already are in the
  sampling dtype): merged into bfloat16 weights, most of a small update rounds away and
  the sampler would draw from another policy than the one trained. A model that already
  is plain and in the sampling dtype is used as is (no copy). Parameters sharded by
  FSDP2 (``fully_shard``, accelerate's ``fsdp_version: 2``) are gathered whole into the
  copy, so every process samples from the full policy.
* **prefill each distinct prompt once.** Identical prompts (a GRPO group's first turn)
  are prefilled once and their KV cache copied to every row; the prefix common to every
  prompt (the system prompt and tool specs) runs once with batch 1.
* **continue an episode from its cache.** The KV cache of every sequence a call returns
  is kept until the next call; a prompt that extends one (the same episode's next turn:
  its last turn plus the environment's reply) starts from it, so only the new tokens are
  prefilled. Rows sit right-aligned after a masked gap (``[cached][pad...][new]``);
  positions come from the attention mask, so every row sees exactly its own tokens.
* **stop on strings** (``</tool_call>``, ``</answer>``: the env ignores the rest of a turn)
  as well as on stop tokens. The recorded tokens are exactly those sampled, up to and
  including the one that completed the stop string.
* **drop finished rows** from the batch (and their KV cache) at once, so a trajectory
  that ends early stops costing compute.
* **draw each row from its own seed** when given ``seeds``: a row's tokens then do not
  depend on the rest of its batch (nor on how many processes split the work).
* **attend with grouped matmuls** on a CPU in bfloat16 (:mod:`agentenv.lm.attention`).
* **pre-pack the linear layers' weights** for oneDNN on a CPU (:class:`_PackedLinear`):
  a plain CPU linear layer lays its weight out again on every call, which in a decode
  step of a few rows costs about as much as the product. Bit-identical outputs in
  bfloat16; float32 equal to rounding. The packed copies cost memory (one more copy of
  the linear weights: 0.27 GB for SmolLM2 in bfloat16) and are packed again when a
  sync changes the weights (full fine-tuning; a LoRA run's base never changes).

On a 2-core CPU with avx512_bf16 this runs SmolLM2-135M at about 2.7x the tok/s of plain
``generate`` in float32, and 1.6x that of ``generate`` in bfloat16 with a static cache
(``python benchmarks/generation.py``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import TopKLogitsWarper, TopPLogitsWarper

from agentenv.config import option
from agentenv.errors import InvalidOptionError
from agentenv.lm.attention import append_cache, cached_forward, wants_grouped
from agentenv.lm.attention import register as register_grouped_attention

DTYPES = ("auto", "float32", "bfloat16", "float16")


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


@functools.cache
def cpu_supports_bf16() -> bool:
    """True if this CPU has native bfloat16 arithmetic (avx512_bf16 or AMX-BF16).

    Without it PyTorch emulates bfloat16 on the CPU, slower than float32.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:  # not Linux: Apple silicon and others; stay with float32
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The compute dtype for ``dtype`` on ``device``.

    ``"auto"``: bfloat16 on a CUDA device that supports it and on a CPU with native
    bfloat16 (:func:`cpu_supports_bf16`), else float32.

    Raises:
        InvalidOptionError: ``dtype`` is not one of :data:`DTYPES` or a float ``torch.dtype``.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise InvalidOptionError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise InvalidOptionError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    kind = torch.device(device).type
    if dtype == "float16" and kind == "cpu":
        raise InvalidOptionError(
            "dtype='float16' needs a GPU (CPUs compute it slowly and autocast refuses it); "
            "use 'bfloat16', 'float32' or 'auto' on the CPU"
        )
    if dtype != "auto":
        return getattr(torch, dtype)
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if kind == "cpu" and cpu_supports_bf16() else torch.float32


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def _check_sharding(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards ``model``'s parameters (they are ``DTensor`` s); raise for the
    shardings the sampler cannot gather (FSDP1's flat parameters, DeepSpeed ZeRO-3)."""
    from torch.distributed.tensor import DTensor

    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        raise InvalidOptionError(
            "FSDP1 (FullyShardedDataParallel) flattens the parameters, which the sampler "
            "cannot gather; use FSDP2 (accelerate config: fsdp_version: 2)"
        )
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        raise InvalidOptionError(
            "DeepSpeed ZeRO-3 partitions the parameters, which the sampler cannot gather "
            "yet; use ZeRO-2 (zero_stage: 2) or FSDP2 (fsdp_version: 2)"
        )
    return any(isinstance(p, DTensor) for p in params)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` gathered whole if FSDP2 shards it (a collective), else ``t`` itself."""
    full = getattr(t, "full_tensor", None)
    return full().detach() if full is not None else t


def _is_lora_layer(name: str, module: torch.nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer the sampler can compute unmerged."""
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
        return False
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    if any(module.use_dora.get(a, False) for a in adapters) or getattr(
        module, "lora_embedding_A", None
    ):
        raise InvalidOptionError(
            f"{name} is a DoRA or embedding LoRA layer, which the sampler does not "
            "implement; train plain LoRA on linear layers (use_dora=False)"
        )
    return bool(adapters)


def _unmerge_lora(
    model: torch.nn.Module,
    base: torch.nn.Module,
    frozen: Callable[[torch.nn.Module], torch.nn.Module],
) -> None:
    """Put a :class:`_LoRALinear` in ``model`` wherever ``base`` (the trained peft base
    model) has a LoRA layer; ``frozen`` picks the frozen linear layer out of ``model``'s
    module at that path."""
    for name, layer in base.named_modules():
        if _is_lora_layer(name, layer):
            parent, _, child = name.rpartition(".")
            linear = frozen(model.get_submodule(name))
            setattr(model.get_submodule(parent), child, _LoRALinear(linear, layer))


def _trainable_version(params: Sequence[torch.Tensor]) -> int:
    """A number that changes whenever one of ``params`` is modified in place."""
    return sum(getattr(p, "_version", 0) for p in params)


class TransformersPolicy:
    """A local ``transformers`` causal LM as a batched policy (see the module docstring).

    Args:
        model: The causal LM being trained or evaluated (a peft ``PeftModel`` works too).
        tokenizer: Its tokenizer (decodes turns and stop strings; pad id for gaps).
        dtype: Compute dtype of sampling: ``"auto"`` (bfloat16 where supported, see
            :func:`resolve_dtype`), ``"float32"``, ``"bfloat16"``, ``"float16"``.
        stop_token_ids: Ids that end a turn (default: the tokenizer's and generation
            config's EOS ids).
        share_prefix: Prefill the prompts' common prefix once (off: every row prefills
            its whole prompt; the results agree to float rounding).
        reuse_cache: Keep each returned sequence's KV cache until the next call, and
            continue from it when a prompt extends it (the same episode's next turn):
            only the environment's new tokens are prefilled.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        dtype: str | torch.dtype = "auto",
        stop_token_ids: Sequence[int] | None = None,
        share_prefix: bool = True,
        reuse_cache: bool = True,
    ):
        self.trained = model
        self.reuse_cache = reuse_cache
        self._saved: dict[tuple[int, ...], list[Any]] = {}
        self._token_text: dict[int, str] = {}  # token id -> its text alone (stop checks)
        self.tokenizer = tokenizer
        self.share_prefix = share_prefix
        param = next(model.parameters())
        self.device = param.device
        self.dtype = resolve_dtype(dtype, self.device)
        if stop_token_ids is None:
            gen_cfg = getattr(model, "generation_config", None)
            eos = getattr(gen_cfg, "eos_token_id", None)
            eos = eos if isinstance(eos, list) else [eos]
            stop_token_ids = [i for i in {tokenizer.eos_token_id, *eos} if i is not None]
        self.stop_token_ids = list(stop_token_ids)
        pad = tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.stop_token_ids[0]
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._version: int | None = None
        self._sharded = _check_sharding(model)
        self._pack = packs_linears(self.device, self.dtype)
        if self._sharded or _is_peft(model) or param.dtype != self.dtype or self._pack:
            self.model = self._plain_copy()
        else:  # already what we sample from: share it
            self.model = model
        self._version = _trainable_version(self._trainable)

    # ---- the sampling copy ----------------------------------------------------------

    def _plain_copy(self) -> torch.nn.Module:
        """The model sampled from: a plain model in the sampling dtype.

        A LoRA model keeps its adapters *unmerged* (:class:`_LoRALinear`): folding a small
        update into bfloat16 weights rounds most of it away (72% of an SFT adapter's
        update, by norm, on SmolLM2), so the sampler would draw from another policy than
        the one being trained. Frozen weights already in the sampling dtype (a LoRA run's
        base) are shared with the trained model, not copied.
        """
        if self._sharded:
            model = self._gathered_copy()
        else:
            base = self.trained.get_base_model() if _is_peft(self.trained) else self.trained
            tensors = [*base.parameters(), *base.buffers()]
            # already in the sampling dtype: shared, not copied (trained ones too, e.g. a
            # float32 model sampled in float32: sync then has nothing to copy)
            shared = {id(t): t for t in tensors if t.dtype == self.dtype}
            # adapters: not copied either, their layers are replaced by _LoRALinear below
            shared |= {id(p): p for n, p in base.named_parameters() if ".lora_" in n}
            model = copy.deepcopy(base, memo=shared)
            if _is_peft(self.trained):
                _unmerge_lora(model, base, lambda copied: copied.base_layer)
            model = model.to(self.dtype).eval()
            for param in model.parameters():  # the copy's own; shared ones keep their flag
                if id(param) not in shared:
                    param.requires_grad_(False)
        if self._pack:
            _pack_linears(model)
        return model

    @torch.no_grad()
    def _gathered_copy(self) -> torch.nn.Module:
        """The sampling copy of a model whose parameters FSDP2 shards: a fresh model of
        the same config holding every parameter gathered whole (a collective: every
        process builds its copy at the same time), LoRA layers unmerged as above."""
        from transformers import AutoModelForCausalLM

        base = self.trained.get_base_model() if _is_peft(self.trained) else self.trained
        with torch.device(self.device):  # initialised where it runs, then overwritten
            model = AutoModelForCausalLM.from_config(base.config, dtype=self.dtype)
        state = {
            name.replace(".base_layer.", "."): _whole(p)
            for name, p in base.named_parameters()
            if ".lora_" not in name
        }
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {n for n in missing if n in (getattr(model, "_tied_weights_keys", None) or ())}
        if unexpected or set(missing) - tied:
            raise InvalidOptionError(
                f"the sampler cannot rebuild this sharded model as a plain "
                f"{type(model).__name__}: missing {sorted(set(missing) - tied)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}; train it unsharded or with LoRA"
            )
        model.tie_weights()
        _unmerge_lora(model, base, lambda plain: plain)  # a plain rebuild: no base_layer
        return model.eval().requires_grad_(False)  # packed by _plain_copy where that pays

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the trained weights into the sampling copy.

        Called automatically by :meth:`generate` when a trainable parameter changed since
        the last copy; call it yourself after changing weights outside an optimizer.
        """
        self._version = _trainable_version(self._trainable)
        self._saved = {}  # KV caches of the old weights
        if self.model is self.trained:
            return
        trained = self.trained.get_base_model() if _is_peft(self.trained) else self.trained
        target = dict(self.model.named_parameters())
        for name, module in self.model.named_modules():
            if isinstance(module, _LoRALinear):
                module.load(trained.get_submodule(name))
        changed = False
        for name, p in trained.named_parameters():
            if p.requires_grad and name in target:  # full fine-tuning, modules_to_save
                if target[name] is not p:  # (a shared tensor is up to date)
                    target[name].copy_(_whole(p))
                changed = True
        if changed:  # packed weights are copies: pack the new values
            for module in self.model.modules():
                if isinstance(module, _PackedLinear):
                    module.pack()

    def clear_cache(self) -> None:
        """Drop the KV caches kept for continuations (``collect`` calls it after a batch)."""
        self._saved = {}

    def _may_end(self, token: int, finals: frozenset[str] | None) -> bool:
        """False if ``token`` cannot complete a stop string: its own text has none of the
        stop strings' last characters ``finals`` (None: always check). Saves decoding a
        window of the turn for most tokens."""
        if finals is None:
            return True
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return any(c in text for c in finals)

    def refresh(self) -> None:
        """:meth:`sync` if a trainable parameter changed since the last copy (
        :meth:`generate` does it first). With FSDP2-sharded weights this is a collective:
        every process calls it together, e.g. before only the main process evaluates."""
        if self._version != _trainable_version(self._trainable):
            self.sync()

    # ---- decoding -------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """One continuation per prompt, in order (see the module docstring).

        With ``seeds``, row ``i`` draws its tokens from a generator seeded with
        ``seeds[i]``: the same prompt and seed give the same tokens in any batch (up to
        float rounding of batched kernels), in one process or split over several.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidOptionError("generate needs at least one prompt, each non-empty")
        if seeds is not None and len(seeds) != len(prompts):
            raise InvalidOptionError(
                f"seeds must give one seed per prompt: {len(seeds)} seeds, {len(prompts)} prompts"
            )
        self.refresh()
        config = self.model.config
        attention = config._attn_implementation
        if wants_grouped(self.model, self.dtype):  # see agentenv.lm.attention
            config._attn_implementation = register_grouped_attention()
        head = self.model.get_output_embeddings()
        hook = head.register_forward_pre_hook(_contiguous_input) if head is not None else None
        try:
            return self._generate(prompts, sampling, seeds)
        finally:
            config._attn_implementation = attention
            if hook is not None:
                hook.remove()

    def _prefill(
        self, prompts: Sequence[Sequence[int]]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run every prompt through the model; return the KV cache, the attention mask
        ``(n, L)`` over its slots, the next-token logits ``(n, V)`` and next positions ``(n,)``.

        Identical prompts (a GRPO group's first turn) are computed once. A prompt that
        extends a sequence this policy generated in its previous call (the same episode's
        next turn) continues from that sequence's saved KV cache; otherwise the prefix
        common to all prompts runs once. Each row's tokens sit right-aligned after a masked
        gap, with positions counted by the mask, so every row sees exactly its own prompt.
        """
        model, dev = self.model, self.device
        unique: dict[tuple[int, ...], int] = {}
        index = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        firsts = list(unique)
        u = len(firsts)
        reused = [self._lookup(p) for p in firsts]
        self._saved = {}
        cache, done = None, [0] * u  # done[i]: tokens of prompt i already in the cache
        mask = torch.ones((u, 0), dtype=torch.long)
        if any(r is not None for r in reused):
            cache, mask = _cache_from(reused, append_cache(model))
            done = [0 if r is None else len(r[0]) for r in reused]
        elif self.share_prefix and u > 1:
            prefix = min(_common_prefix(firsts), min(len(p) for p in firsts) - 1)
            if prefix > 0:
                ids = torch.tensor([list(firsts[0][:prefix])], device=dev)
                _, cache = cached_forward(
                    model, append_cache(model), input_ids=ids, logits_to_keep=1
                )
                cache.batch_repeat_interleave(u)
                mask = torch.ones((u, prefix), dtype=torch.long)
                done = [prefix] * u
        rest = [list(p[k:]) for p, k in zip(firsts, done, strict=True)]
        width = max(len(r) for r in rest)
        ids = torch.full((u, width), self.pad_token_id, dtype=torch.long)
        new = torch.zeros((u, width), dtype=torch.long)
        for i, r in enumerate(rest):  # left-padded into the gap after the cached part
            ids[i, width - len(r) :] = torch.tensor(r)
            new[i, width - len(r) :] = 1
        mask = torch.cat([mask, new], dim=1)  # (u, cached + width)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = cached_forward(
            model,
            cache if cache is not None else append_cache(model),
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=positions[:, -width:].to(dev),
            logits_to_keep=1,
        )
        logits, next_pos = logits[:, -1], positions[:, -1] + 1
        if u < len(prompts):  # copies of identical prompts share one prefill
            rows = torch.tensor(index)
            cache.batch_select_indices(rows.to(dev))
            logits, mask, next_pos = logits[rows.to(logits.device)], mask[rows], next_pos[rows]
        return cache, mask, logits, next_pos

    def _lookup(self, prompt: tuple[int, ...]) -> tuple[tuple[int, ...], list[Any]] | None:
        """The longest saved sequence that ``prompt`` extends (by at least one token)."""
        best = None
        for key, layers in self._saved.items():
            if len(key) < len(prompt) and prompt[: len(key)] == key:
                if best is None or len(key) > len(best[0]):
                    best = (key, layers)
        return best

    def _save(self, cache: Any, j: int, mask: torch.Tensor, key: tuple[int, ...]) -> None:
        """Keep row ``j``'s KV cache (its real slots only) for a continuation of ``key``."""
        if not self.reuse_cache or not _plain_layers(cache):
            return
        real = mask.bool().to(self.device)
        layers = [(layer.keys[j][:, real], layer.values[j][:, real]) for layer in cache.layers]
        if layers and layers[0][0].shape[1] == len(key):
            self._saved[key] = layers

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seeds: Sequence[int] | None,
    ) -> list[Generation]:
        model, dev = self.model, self.device
        n = len(prompts)
        generators = None if seeds is None else [torch.Generator().manual_seed(s) for s in seeds]
        cache, mask, logits, next_pos = self._prefill(prompts)
        warpers = _warpers(sampling)
        stops = set(self.stop_token_ids)
        stop_strings = list(sampling.stop_strings or [])
        # Stop strings ending in whitespace or a non-ASCII character are always checked:
        # a token's text alone may drop a leading space, or hold part of a character.
        finals: frozenset[str] | None = frozenset(s[-1] for s in stop_strings)
        if any(not c.isascii() or c.isspace() for c in finals):
            finals = None
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        rows = list(range(n))  # prompt index of each row still in the batch

        def save(j: int) -> None:
            i = rows[j]
            self._save(cache, j, mask[j], tuple(prompts[i]) + tuple(tokens[i][:-1]))

        for step in range(sampling.max_new_tokens):
            rngs = None if generators is None else [generators[i] for i in rows]
            token, logp = _sample(logits, sampling.temperature, warpers, rngs)  # (r,), (r,)
            keep = []
            for j, (t, lp) in enumerate(zip(token.tolist(), logp.tolist(), strict=True)):
                i = rows[j]
                tokens[i].append(t)
                logps[i].append(lp)
                if t in stops:
                    reasons[i] = "stop"
                elif (
                    stop_strings
                    and self._may_end(t, finals)
                    and _has_stop(self.tokenizer, tokens[i], stop_strings)
                ):
                    reasons[i] = "stop_string"
                else:
                    keep.append(j)
            if not keep or step == sampling.max_new_tokens - 1:
                for j in range(len(rows)):
                    save(j)
                break
            if len(keep) < len(rows):  # drop finished rows and their cache
                for j in sorted(set(range(len(rows))) - set(keep)):
                    save(j)
                index = torch.tensor(keep)
                cache.batch_select_indices(index.to(dev))
                mask, next_pos, token = mask[index], next_pos[index], token[index]
                rows = [rows[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            logits, cache = cached_forward(
                model,
                cache,
                input_ids=token[:, None].to(dev),
                attention_mask=mask.to(dev),
                position_ids=next_pos[:, None].to(dev),
            )
            logits = logits[:, -1]
            next_pos = next_pos + 1
        return [
            Generation(
                tokens[i],
                logps[i],
                self.tokenizer.decode(tokens[i], skip_special_tokens=True),
                reasons[i],
            )
            for i in range(n)
        ]


class _LoRALinear(torch.nn.Module):
    """A frozen layer plus its LoRA updates, unmerged, for sampling.

    ``y = base(x) + x A^T B^T`` with ``A`` the active adapters' ``lora_A`` weights stacked
    ``(r, in)`` and ``B`` their ``scaling * lora_B`` side by side ``(out, r)``: peft's
    LoRA layer in eval mode (dropout off). The low-rank path runs in float32 whatever the
    base's dtype: its matmuls are tiny, and on a CPU float32 ones cost a third of bfloat16
    ones. (The learner's bf16 autocast runs them in bfloat16; the two differ by that
    rounding of the update only.)
    :meth:`load` copies the trained layer's current adapter weights.
    """

    def __init__(self, base_layer: torch.nn.Module, lora_layer: torch.nn.Module):
        super().__init__()
        self.base_layer = base_layer
        self.names = [a for a in lora_layer.active_adapters if a in lora_layer.lora_A]
        self.load(lora_layer)

    @torch.no_grad()
    def load(self, lora_layer: torch.nn.Module) -> None:
        """Copy the adapter weights of ``lora_layer`` (the trained peft layer)."""
        pairs = [
            (lora_layer.lora_A[a], lora_layer.lora_B[a], lora_layer.scaling[a]) for a in self.names
        ]
        self.a = torch.cat([_whole(lora_a.weight).float() for lora_a, _, _ in pairs])
        self.b = torch.cat([_whole(lora_b.weight).float() * s for _, lora_b, s in pairs], dim=1)
        biases = [_whole(b.bias).float() * s for _, b, s in pairs if b.bias is not None]
        self.bias = torch.stack(biases).sum(0) if biases else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x.float(), self.a), self.b, self.bias)
        return self.base_layer(x).add_(update)


@functools.cache
def _onednn_linear() -> bool:
    """Whether this torch has oneDNN's pre-packed linear ops (CPU builds with mkldnn)."""
    try:
        return torch.backends.mkldnn.is_available() and all(
            hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def packs_linears(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether the sampler runs its linear layers from pre-packed weights
    (:class:`_PackedLinear`): on a CPU, in bfloat16 or float32, with oneDNN present."""
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and _onednn_linear()
    )


class _PackedLinear(torch.nn.Module):
    """A frozen ``nn.Linear`` whose weight is pre-packed once for oneDNN (CPU sampling).

    A plain CPU linear layer re-lays out its weight for oneDNN's kernel on every call;
    in a decode step (a few rows) that costs as much as the product itself: 41 -> 30 us
    for SmolLM2's 576 x 576 at 8 rows, 4.1 -> 2.1 ms for its LM head, in bfloat16 on a
    2-core CPU. Packing once makes the same kernel skip it: in bfloat16 the outputs are
    bit-identical to ``F.linear`` (the same kernel and accumulation order); in float32
    oneDNN replaces MKL's sgemm, equal to float rounding. ``weight`` and ``bias`` stay
    the layer's own parameters (shared, so syncs copy into them); the packed copy is
    made again by :meth:`pack`.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pack()

    @torch.no_grad()
    def pack(self) -> None:
        """Pack the current ``weight`` (after it changed)."""
        # the batch-size hint does not change the layout's speed here (1 to 128 rows)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _pack_linears(model: torch.nn.Module) -> None:
    """Replace every plain ``nn.Linear`` of ``model`` (the sampling copy) with a
    :class:`_PackedLinear` of the same weights (a LoRA layer's base layer included)."""
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _PackedLinear(module))


def _contiguous_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook of the LM head: make its input contiguous.

    ``logits_to_keep=1`` hands the head the last position of every row, a strided
    ``(n, 1, H)`` view. For a strided 3-D input a linear layer outside autocast falls back
    to a batched matmul that first copies the ``(H, V)`` weight once per row: 1.7 GB and
    1.6 s for a 32-row prefill of SmolLM2 in bfloat16 on the CPU, instead of a 2 MB copy.
    """
    return (args[0].contiguous(), *args[1:])


def _plain_layers(cache: Any) -> bool:
    """True for a cache of full-attention ``DynamicLayer`` s (what continuation supports)."""
    layers = getattr(cache, "layers", None)
    plain = ("DynamicLayer", "AppendCacheLayer")
    return bool(layers) and all(type(layer).__name__ in plain for layer in layers)


def _cache_from(
    reused: list[tuple[tuple[int, ...], list[Any]] | None], cache: Any | None
) -> tuple[Any, torch.Tensor]:
    """A batch cache of saved rows, right-aligned after a masked gap; rows without one
    are all gap. Fills ``cache`` (an empty one; None: a new ``DynamicCache``). Returns
    the cache and its ``(rows, slots)`` attention mask."""
    from transformers import DynamicCache

    lengths = [0 if r is None else len(r[0]) for r in reused]
    width = max(lengths)
    sample = next(r[1] for r in reused if r is not None)
    cache = cache if cache is not None else DynamicCache()
    for layer, (k0, v0) in enumerate(sample):
        keys = k0.new_zeros((len(reused), k0.shape[0], width, k0.shape[2]))
        values = v0.new_zeros((len(reused), v0.shape[0], width, v0.shape[2]))
        for i, r in enumerate(reused):
            if r is not None:
                keys[i, :, width - lengths[i] :] = r[1][layer][0]
                values[i, :, width - lengths[i] :] = r[1][layer][1]
        cache.update(keys, values, layer)
    mask = torch.zeros((len(reused), width), dtype=torch.long)
    for i, k in enumerate(lengths):
        mask[i, width - k :] = 1  # k == 0: an empty slice
    return cache, mask


def _common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix shared by every prompt."""
    first, length = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        k = 0
        while k < length and p[k] == first[k]:
            k += 1
        length = k
    return length


def _warpers(sampling: SamplingConfig) -> list[Any]:
    warpers = []
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def _sample(
    logits: torch.Tensor,
    temperature: float,
    warpers: list[Any],
    generators: list[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` (r, V); return it and its log-prob, on the CPU.

    The log-prob is taken under the distribution sampled from: logits / temperature, then
    top-k, then top-p, in float32. Greedy decoding (temperature 0) takes the argmax and
    records its log-prob at temperature 1. With ``generators`` (CPU, one per row), row
    ``j`` draws from ``generators[j]`` instead of the global RNG.
    """
    scores = logits.float() / (temperature or 1.0)  # (r, V)
    for warp in warpers:
        scores = warp(None, scores)
    logp = torch.log_softmax(scores, dim=-1)  # (r, V)
    if temperature > 0:  # inverse-CDF draw: torch.multinomial spends ~8 ms/step on CPU RNG
        cdf = logp.double().exp().cumsum(dim=-1)  # (r, V), float64: no drift over the vocab
        if generators is None:
            u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device)
        else:
            u = torch.cat([torch.rand(1, 1, dtype=torch.float64, generator=g) for g in generators])
        u = 1 - u.to(cdf.device)  # (r, 1) in (0, 1]
        u = u * cdf[:, -1:]  # first index with cdf >= u > 0: never a zero-probability token
        token = torch.searchsorted(cdf, u).squeeze(1).clamp(max=cdf.shape[1] - 1)  # (r,)
    else:
        token = scores.argmax(dim=-1)
    return token.cpu(), logp.gather(1, token[:, None]).squeeze(1).cpu()


def _has_stop(tokenizer: Any, ids: list[int], stop_strings: list[str]) -> bool:
    """True if a stop string ends in the text of the newest token of ``ids``.

    Called as each token arrives, so an earlier match was already caught: only the last
    ``len(longest stop) + 1`` tokens (each decodes to at least one character) are decoded,
    not the whole turn at every step.
    """
    window = max(len(s) for s in stop_strings) + 1
    text = tokenizer.decode(ids[-window:], skip_special_tokens=False)
    return any(s in text for s in stop_strings)
