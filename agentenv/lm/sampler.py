"""The sampler: how we decode, the bundled generation engine of rollouts and evaluation.

:class:`TransformersPolicy` continues a batch of token-id prompts with a local causal LM
and records, for every sampled token, its log-prob under the exact distribution it was
drawn from (after temperature / top-k / top-p). It runs its own decode loop over the
model's forward pass instead of ``model.generate``, because that lets it:

* **sample from a plain copy in the compute dtype**, bfloat16 where the hardware supports
  it (:func:`agentenv.lm.precision.resolve_dtype`), refreshed after every optimizer step
  (:meth:`TransformersPolicy.sync`, also done automatically when the trained weights
  changed) -- the way TRL syncs weights into vLLM. What the copy is (LoRA unmerged,
  FSDP2 gathered, linear layers pre-packed for oneDNN) is :mod:`agentenv.lm.weights`.
* **prefill each distinct prompt once.** Identical prompts (a GRPO group's first turn)
  are prefilled once, their rows decoding from that one KV cache (a copy per row where
  rows do not share slots, below); the prefix common to every prompt (the system prompt
  and tool specs) runs once with batch 1.
* **decode rows that have drawn the same tokens once** (on a CPU): rows whose tokens so far
  are the same (a group's episodes writing the same search call) share one sequence of
  the batch until they draw different tokens (:mod:`agentenv.lm.decoding`).
* **take several tokens a step where a row copies its context** (on a CPU): tokens that
  followed the row's last few tokens earlier in its context (a tool call's JSON, the
  question, a passage) are drafted and verified in the same forward; a row keeps those it
  draws itself, so its tokens are those of drawing one at a time
  (:mod:`agentenv.lm.drafting`).
* **continue an episode from its cache.** The KV cache of every sequence a call returns
  is kept until the next call; a prompt that extends one (the same episode's next turn:
  its last turn plus the environment's reply) starts from it, so only the new tokens are
  prefilled. Rows sit right-aligned after a masked gap (``[cached][pad...][new]``);
  positions come from the attention mask, so every row sees exactly its own tokens.
  On a CPU, continued rows whose new tokens differ much in length (a 250-token search
  result beside a 20-token tool error) are prefilled in groups of similar length and
  merged into one batch (:func:`length_groups`): padding the short rows to the longest
  would compute slots for nothing.
* **stop on strings** (``</tool_call>``, ``</answer>``: the env ignores the rest of a turn)
  as well as on stop tokens. The recorded tokens are exactly those sampled, up to and
  including the one that completed the stop string.
* **drop finished rows** from the batch (and their KV cache) at once, so a trajectory
  that ends early stops costing compute.
* **draw each row from its own seed** when given ``seeds``: a row's tokens then do not
  depend on the rest of its batch (nor on how many processes split the work).
* **attend with grouped matmuls** on a CPU in bfloat16 (:mod:`agentenv.lm.attention`).
* **decode without transformers' per-call work** for Llama-architecture models
  (:mod:`agentenv.lm.decode_step`: the same operations, bitwise the same logits; q, k, v
  from one packed matrix where that is exact), in inference mode, the draw's
  vocabulary-sized buffers kept from step to step.

On a 2-core CPU with avx512_bf16 this runs SmolLM2-135M at 2.0-3.1x the tok/s of plain
``generate`` in float32 (runs vary), and 1.5-1.9x that of ``generate`` in bfloat16 with a
static cache (``python benchmarks/generation.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers.models.llama import modeling_llama as llama

from agentenv.errors import InvalidOptionError
from agentenv.lm.attention import (
    CACHE_ATTENTION,
    CPU_BF16_ATTENTION,
    append_cache,
    cached_forward,
    sampler_attention,
)
from agentenv.lm.backend import (
    FAST_PATHS,
    Generation,
    SamplingConfig,
    check_batch,
    stop_and_pad_ids,
)
from agentenv.lm.decoding import Decoder, drain, merge_caches, plain_layers
from agentenv.lm.hidden import recording_head_input
from agentenv.lm.models import limit_onednn_cache
from agentenv.lm.precision import resolve_dtype
from agentenv.lm.weights import (
    PACKED_DTYPES,
    is_peft,
    release_packed,
    sampling_copy,
    sync_weights,
    trainable_version,
    why_not_packed,
)

logger = logging.getLogger(__name__)


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
        split_prefill: Prefill continued rows in groups of similar new lengths when that
            computes fewer padded slots (:func:`length_groups`), then merge them into one
            batch. None: on a CPU, where a prefill is compute-bound and padding costs its
            share (env replies of 50 and 250 tokens side by side: 2.4x faster); not on a
            GPU, where a prefill is launch-bound and each new shape costs.
        share_slots: Decode rows whose tokens so far are the same as one sequence of the
            batch (:mod:`agentenv.lm.decoding`). None: on a CPU, where a decode step's
            time grows with its rows; not on a GPU, where it barely does and each split
            of a shared sequence costs launches and host-device copies.
        draft_tokens: At most this many tokens a decode step drafts for each sequence
            from its own context and verifies in the same forward
            (:mod:`agentenv.lm.drafting`): a sequence takes several tokens a step where
            it copies its prompt, and exactly the tokens it would draw one at a time.
            Each step drafts as many as are expected to pay for the longer forward, from
            how often rows drew the looked-up token (``Decoder._draft_length``); caches
            of full-attention layers only. None: 4 on a CPU, 0 on a GPU (not measured
            there).
        pack_weights: On a CPU, run the sampling copy's linear layers from weights
            pre-packed for oneDNN (:func:`~agentenv.lm.weights.packs_linears`); off: plain
            ``F.linear``, and neither of the next two.
        pack_qkv: Give each attention layer its q, k, v projections as one packed matrix
            where that computes them bit for bit (:class:`~agentenv.lm.weights.PackedConcat`).
        fold_lora: In float32, fold LoRA updates into the packed weights (off: the update
            runs unmerged beside them, as in bfloat16).
        llama_step: Decode Llama-architecture models with
            :mod:`agentenv.lm.decode_step` (bitwise the model's logits, without
            transformers' per-call work); off: the model's forward.
        inplace_attention: Decode over KV caches that grow in place, with the attention
            of :func:`~agentenv.lm.attention.sampler_attention` (grouped matmuls on a CPU
            in bfloat16); off: the model's own attention and transformers' cache.

    Every fast path switch above (and ``draft_tokens=0``) keeps the tokens those of
    drawing one at a time, up to float rounding: tests/agentenv/lm/test_fast_paths.py
    holds each one, turned off, to the reference path (:mod:`agentenv.lm.reference`).

    Attributes:
        prefill_s: Seconds spent prefilling since construction (prompts, and the
            environment's replies of continued episodes, run through the model).
        prefill_tokens: Tokens those prefills computed (a shared prefix counts once,
            a continued episode's cached tokens not again). ``collect`` reports both for
            its batch: what generation spent on reading rather than on sampling.
        decoded_rows: Rows decoded, summed over decode steps since construction.
        decoded_slots: Sequences the model ran for them: rows whose tokens so far are the
            same share one (:mod:`agentenv.lm.decoding`).
        decoded_tokens: Tokens those rows drew: more than ``decoded_rows`` where drafts
            were taken.
        fast_paths: Each fast path's name -> None where it runs, else why not
            (:func:`fast_path_status`); said in one log line at construction, a warning
            where a precondition turned one off (``fast_paths_missing``).
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
        split_prefill: bool | None = None,
        share_slots: bool | None = None,
        draft_tokens: int | None = None,
        pack_weights: bool = True,
        pack_qkv: bool = True,
        fold_lora: bool = True,
        llama_step: bool = True,
        inplace_attention: bool = True,
        record_hidden: bool = False,
    ):
        limit_onednn_cache()  # before the sampling copy's first bfloat16 product
        self.trained = model
        self.record_hidden = record_hidden  # Generation.hidden (agentenv.lm.hidden)
        self.llama_step = llama_step
        self.inplace_attention = inplace_attention
        self.reuse_cache = reuse_cache
        self._saved: dict[tuple[int, ...], list[Any]] = {}
        self._saved_by: dict[tuple[int, ...], int] = {}  # rows that left each saved cache
        self._token_text: dict[int, str] = {}  # token id -> its text alone (stop checks)
        self.tokenizer = tokenizer
        self.share_prefix = share_prefix
        param = next(model.parameters())
        self.device = param.device
        self.dtype = resolve_dtype(dtype, self.device)
        self.split_prefill = self.device.type == "cpu" if split_prefill is None else split_prefill
        self.share_slots = self.device.type == "cpu" if share_slots is None else share_slots
        if draft_tokens is None:
            draft_tokens = 4 if self.device.type == "cpu" else 0
        if draft_tokens < 0:
            raise InvalidOptionError(
                f"draft_tokens must be >= 0 (0 turns drafting off, None picks by device), "
                f"got {draft_tokens}"
            )
        self.draft_tokens = draft_tokens
        self.stop_token_ids, self.pad_token_id = stop_and_pad_ids(model, tokenizer, stop_token_ids)
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self.model = sampling_copy(  # what we sample from
            model, self.dtype, self.device, pack=pack_weights, pack_qkv=pack_qkv, fold=fold_lora
        )
        self._version = trainable_version(self._trainable)
        self.prefill_s, self.prefill_tokens = 0.0, 0
        self.decoded_rows = self.decoded_slots = self.decoded_tokens = 0
        switches = {
            "pack_weights": pack_weights,
            "pack_qkv": pack_qkv,
            "fold_lora": fold_lora,
            "llama_step": llama_step,
            "inplace_attention": inplace_attention,
            "share_prefix": share_prefix,
            "share_slots": self.share_slots,
            "split_prefill": self.split_prefill,
            "reuse_cache": reuse_cache,
        }
        self.fast_paths, self.fast_paths_missing = fast_path_status(
            self.model, model, self.dtype, self.device, switches, draft_tokens
        )
        _log_fast_paths(self.fast_paths, self.fast_paths_missing)

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the trained weights into the sampling copy
        (:func:`agentenv.lm.weights.sync_weights`).

        Called automatically by :meth:`generate` when a trainable parameter changed since
        the last copy; call it yourself after changing weights outside an optimizer.
        """
        self._version = trainable_version(self._trainable)
        self._saved, self._saved_by = {}, {}  # KV caches of the old weights
        sync_weights(self.model, self.trained)

    def clear_cache(self) -> None:
        """Drop the KV caches kept for continuations (``collect`` calls it after a batch)."""
        self._saved, self._saved_by = {}, {}

    def release_weights(self) -> int:
        """Free the sampling copy's packed weights
        (:func:`~agentenv.lm.weights.release_packed`): the trainer calls it before each
        learn phase, which then has that memory for its activations (0.30 GB for SmolLM2
        in bfloat16, 0.60 GB with LoRA in float32). Returns the bytes freed. The next
        generation packs them again (about 0.15 s for SmolLM2), from the synced weights:
        the same tokens as without the release."""
        return release_packed(self.model)

    def may_end(self, token: int, finals: frozenset[str] | None) -> bool:
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
        if self._version != trainable_version(self._trainable):
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
        check_batch(prompts, seeds)
        self.refresh()
        decoder = Decoder(self, sampling, keep_saved=False, dead_fraction=0.0)
        for i, prompt in enumerate(prompts):
            decoder.add(i, prompt, seed=None if seeds is None else seeds[i])
        out: list[Generation | None] = [None] * len(prompts)
        for i, generation in drain(decoder):
            out[i] = generation
        return out  # type: ignore[return-value]

    def decoder(self, sampling: SamplingConfig) -> Decoder:
        """A running batch for the rollout engine: rows are added at any time and leave
        when their turn ends (:class:`~agentenv.lm.decoding.Decoder`). Saved KV caches
        stay until :meth:`clear_cache`."""
        self.refresh()
        return Decoder(self, sampling, keep_saved=True)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """While decoding: inference mode (no autograd, and no version counters or views
        tracked for it: 5-7% of a decode step of 8 rows on a CPU), the CPU attention over
        in-place KV caches where it pays (:func:`~agentenv.lm.attention.sampler_attention`)
        and a contiguous LM-head input. The KV caches made here are inference tensors: only
        code inside this context may use them."""
        config = self.model.config
        attention = config._attn_implementation
        chosen = sampler_attention(self.model, self.dtype) if self.inplace_attention else None
        if chosen is not None:
            config._attn_implementation = chosen
        head = self.model.get_output_embeddings()
        hook = head.register_forward_pre_hook(_contiguous_input) if head is not None else None
        try:
            with torch.inference_mode():
                yield
        finally:
            config._attn_implementation = attention
            if hook is not None:
                hook.remove()

    def prefill(
        self, prompts: Sequence[Sequence[int]], *, keep_saved: bool = False
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, list[int], torch.Tensor | None]:
        """Run every distinct prompt through the model once; return the KV cache, the
        attention mask ``(u, L)`` over its slots, the next-token logits ``(u, V)`` and next
        positions ``(u,)`` of the ``u`` distinct prompts, for each prompt the row that
        holds it (identical prompts, a GRPO group's first turn, share one), and the last
        hidden states ``(u, H)`` (float32, CPU) the logits came from
        (:mod:`agentenv.lm.hidden`; None for a model without an output embedding).

        A prompt that
        extends a sequence this policy generated in its previous call (the same episode's
        next turn) continues from that sequence's saved KV cache; otherwise the prefix
        common to all prompts runs once. Each row's tokens sit right-aligned after a masked
        gap, with positions counted by the mask, so every row sees exactly its own prompt.
        With ``split_prefill``, continued rows run in groups of similar new lengths
        (:func:`length_groups`) merged into one batch afterwards. Saved caches this call
        does not continue are dropped unless ``keep_saved``; a cache saved by several rows
        (identical turns) stays until as many prompts have continued it.
        """
        start, model, dev = time.perf_counter(), self.model, self.device
        unique: dict[tuple[int, ...], int] = {}
        index = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        firsts = list(unique)
        u = len(firsts)
        reused = [self._lookup(p) for p in firsts]
        if keep_saved:
            for r in (reused[i] for i in index):  # each prompt continues its saved row
                if r is not None and self._saved_by.get(r[0], 0) > 1:
                    self._saved_by[r[0]] -= 1
                elif r is not None:
                    self._saved.pop(r[0], None)
                    self._saved_by.pop(r[0], None)
        else:
            self._saved, self._saved_by = {}, {}
        cache, done = None, [0] * u  # done[i]: tokens of prompt i already in the cache
        shared = 0  # tokens of a common prefix computed once
        mask = torch.ones((u, 0), dtype=torch.long)
        groups = [list(range(u))]
        if any(r is not None for r in reused):
            done = [0 if r is None else len(r[0]) for r in reused]
            if self.split_prefill:
                groups = length_groups([len(p) - k for p, k in zip(firsts, done, strict=True)])
            if len(groups) == 1:
                cache, mask = _cache_from(reused, append_cache(model))
        elif self.share_prefix and u > 1:
            prefix = min(_common_prefix(firsts), min(len(p) for p in firsts) - 1)
            if prefix > 0:
                ids = torch.tensor([list(firsts[0][:prefix])], device=dev)
                _, cache = cached_forward(
                    model, append_cache(model), input_ids=ids, logits_to_keep=1
                )
                cache.batch_repeat_interleave(u)
                mask = torch.ones((u, prefix), dtype=torch.long)
                done, shared = [prefix] * u, prefix
        rest = [list(p[k:]) for p, k in zip(firsts, done, strict=True)]
        if len(groups) == 1:
            cache, mask, logits, next_pos, hidden = self._forward_rest(cache, mask, rest)
        else:  # each group from its own saved caches, then one batch in the prompts' order
            parts = [
                self._forward_rest(
                    *_cache_from([reused[i] for i in g], append_cache(model)),
                    [rest[i] for i in g],
                )
                for g in groups
            ]
            row_of = {i: j for j, i in enumerate(i for g in groups for i in g)}
            order = [row_of[i] for i in range(u)]  # prompt -> its row among the groups' rows
            cache, mask = merge_caches(model, [(c, m, None) for c, m, *_ in parts], order)
            logits = torch.cat([part[2] for part in parts])[torch.tensor(order, device=dev)]
            next_pos = torch.cat([part[3] for part in parts])[order]
            states = [part[4] for part in parts]
            hidden = None if any(h is None for h in states) else torch.cat(states)[order]
        if dev.type == "cuda":  # the kernels finished, so the time is theirs
            torch.cuda.synchronize(dev)
        self.prefill_s += time.perf_counter() - start
        self.prefill_tokens += shared + sum(len(r) for r in rest)
        return cache, mask, logits, next_pos, index, hidden

    def _forward_rest(
        self, cache: Any, mask: torch.Tensor, rest: list[list[int]]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run each row's new tokens ``rest`` after its cached ones (``cache`` with ``mask``
        ``(n, cached)``; None: nothing cached), left-padded into the gap after the cached
        part; return the cache, its mask ``(n, cached + width)``, the next-token logits
        ``(n, V)``, next positions ``(n,)`` and the last hidden states ``(n, H)``."""
        n, width = len(rest), max(len(r) for r in rest)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        new = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(rest):  # left-padded into the gap after the cached part
            ids[i, width - len(r) :] = torch.tensor(r)
            new[i, width - len(r) :] = 1
        mask = torch.cat([mask, new], dim=1)  # (n, cached + width)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with recording_head_input(self.model, self.record_hidden) as hidden:
            logits, cache = cached_forward(
                self.model,
                cache if cache is not None else append_cache(self.model),
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions[:, -width:].to(self.device),
                logits_to_keep=1,
            )
        return cache, mask, logits[:, -1], positions[:, -1] + 1, hidden[-1] if hidden else None

    def _lookup(self, prompt: tuple[int, ...]) -> tuple[tuple[int, ...], list[Any]] | None:
        """The longest saved sequence that ``prompt`` extends (by at least one token)."""
        best = None
        for key, layers in self._saved.items():
            if len(key) < len(prompt) and prompt[: len(key)] == key:
                if best is None or len(key) > len(best[0]):
                    best = (key, layers)
        return best

    def save(
        self, cache: Any, j: int, mask: torch.Tensor, key: tuple[int, ...], rows: int = 1
    ) -> None:
        """Keep row ``j``'s KV cache (its real slots only) for a continuation of ``key`` by
        ``rows`` rows (each of which a later prompt continues once)."""
        if not self.reuse_cache or not plain_layers(cache):
            return
        if key in self._saved:  # the same sequence, left by another row
            self._saved_by[key] = self._saved_by.get(key, 1) + rows
            return
        # the slot indices once, from the mask (on the CPU): a boolean index per layer
        # would sync with a GPU 60 times per row (SmolLM2), and find them 60 times
        real = mask.nonzero().squeeze(1)
        if not cache.layers or len(real) != len(key):
            return
        real = real.to(self.device)
        self._saved[key] = [
            (layer.keys[j].index_select(1, real), layer.values[j].index_select(1, real))
            for layer in cache.layers
        ]
        self._saved_by[key] = rows


# What one more prefill call and the merge of its rows are counted as, in token slots of a
# prefill: a group is split off only when it saves more. Not tuned: about a quarter of a
# second of SmolLM2 in bf16 on a 2-core CPU, where a 20-row prefill costs ~1 ms a slot.
PREFILL_CALL_SLOTS = 256


def length_groups(lengths: Sequence[int], call_slots: int = PREFILL_CALL_SLOTS) -> list[list[int]]:
    """Rows of a prefill grouped by their new tokens' ``lengths`` so that, with every group
    padded to its longest row, the fewest token slots are computed, counting
    ``call_slots`` for each group after the first. Returns lists of row indices (each in
    order, the groups longest first); ``[[0, 1, ..., n-1]]`` when one batch is best.

    Groups are runs of the rows sorted by length (any other grouping pads at least as
    much): ``best[j]``, the least cost of the ``j`` longest rows, is found for every ``j``
    from the ones before it, O(n^2) for n rows.
    """
    n = len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i])  # longest first
    widths = [lengths[i] for i in order]
    best, start = [0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group: sorted rows i .. j-1, padded to widths[i]
            cost = best[i] + (j - i) * widths[i] + (call_slots if i else 0)
            if cost < best[j]:
                best[j], start[j] = cost, i
    groups, j = [], n
    while j:
        groups.append(sorted(order[start[j] : j]))
        j = start[j]
    return [list(range(n))] if len(groups) == 1 else groups[::-1]


def _contiguous_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook of the LM head: make its input contiguous.

    ``logits_to_keep=1`` hands the head the last position of every row, a strided
    ``(n, 1, H)`` view. For a strided 3-D input a linear layer outside autocast falls back
    to a batched matmul that first copies the ``(H, V)`` weight once per row: 1.7 GB and
    1.6 s for a 32-row prefill of SmolLM2 in bfloat16 on the CPU, instead of a 2 MB copy.
    """
    return (args[0].contiguous(), *args[1:])


def _cache_from(
    reused: list[tuple[tuple[int, ...], list[Any]] | None], cache: Any | None
) -> tuple[Any, torch.Tensor]:
    """A batch cache of saved rows, right-aligned after a masked gap; rows without one
    are all gap. Fills ``cache`` (an empty one; None: a new ``DynamicCache``). Returns
    the cache (None when no row has one) and its ``(rows, slots)`` attention mask."""
    from transformers import DynamicCache

    lengths = [0 if r is None else len(r[0]) for r in reused]
    width = max(lengths)
    if not width:  # none saved: nothing cached yet
        return None, torch.zeros((len(reused), 0), dtype=torch.long)
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


def fast_path_status(
    sampled: torch.nn.Module,
    trained: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    switches: dict[str, bool],
    draft_tokens: int,
) -> tuple[dict[str, str | None], dict[str, str]]:
    """Which fast paths (:data:`~agentenv.lm.backend.FAST_PATHS`, and ``draft_tokens``)
    a :class:`TransformersPolicy` runs: ``{name: None}`` for a path that runs, else why it
    does not. The second dict holds the paths off for a precondition this model or torch
    build fails (no oneDNN, another architecture, another attention), not by a switch or
    by design on this device: the reference path's code runs in their place."""
    status: dict[str, str | None] = {}
    missing: dict[str, str] = {}
    attention = getattr(getattr(sampled, "config", None), "_attn_implementation", None)
    own_attention = attention not in ("sdpa", CPU_BF16_ATTENTION, CACHE_ATTENTION)
    for name in FAST_PATHS:
        if not switches[name]:
            by_device = name in ("share_slots", "split_prefill") and device.type != "cpu"
            status[name] = "off by default on a GPU" if by_device else "switched off"
            continue
        why, failed = None, False
        if name == "pack_weights":
            why = why_not_packed(device, dtype)  # on a CPU in bf16 / fp32: this build
            failed = why is not None and device.type == "cpu" and dtype in PACKED_DTYPES
        elif name in ("pack_qkv", "fold_lora") and status["pack_weights"] is not None:
            why = "needs pack_weights"
        elif name == "fold_lora" and dtype != torch.float32:
            why = "float32 only (in bfloat16 the update would round away)"
        elif name == "fold_lora" and not is_peft(trained):
            why = "no LoRA adapter"
        elif name == "inplace_attention" and own_attention:
            why, failed = f"the model's attention is {attention!r}, not SDPA", True
        elif name == "llama_step" and type(sampled) is not llama.LlamaForCausalLM:
            why, failed = f"{type(sampled).__name__} is not a Llama model", True
        elif name == "llama_step" and not switches["inplace_attention"]:
            why = "needs inplace_attention"
        status[name] = why
        if failed:
            missing[name] = why
    status["drafting"] = None if draft_tokens > 0 else "draft_tokens=0"
    return status, missing


def _log_fast_paths(status: dict[str, str | None], missing: dict[str, str]) -> None:
    """One log line: a warning naming the paths a precondition turned off (the plain
    code runs instead), else which paths run (info)."""
    off = "; ".join(f"{name} ({why})" for name, why in status.items() if why is not None)
    if missing:
        logger.warning(
            "sampler: fast paths off here, the plain code runs in their place: %s "
            "(docs/how-it-works.md#generation)",
            "; ".join(f"{name}: {why}" for name, why in missing.items()),
        )
    else:
        on = ", ".join(name for name, why in status.items() if why is None)
        logger.info("sampler: fast paths on: %s; off: %s", on or "none", off or "none")
