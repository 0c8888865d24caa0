"""A running batch that rows join and leave between decode steps (continuous batching).

:class:`Decoder` is how :class:`~agentenv.lm.sampler.TransformersPolicy` decodes, both for
one ``generate`` call (every prompt added at once, stepped until all are done) and for the
rollout engine (:mod:`agentenv.rollout.collect`), which adds an episode's next turn as soon
as its environment has answered, while other rows keep decoding::

    decoder = policy.decoder(sampling)
    decoder.add(key, prompt_ids, seed=..., max_new_tokens=...)   # any time
    for key, generation in decoder.step():   # admit queued rows, a token (or more) a row
        ...                                   # rows whose turn ended this step

A row's tokens depend only on its prompt, its seed and the weights: rows that join are
prefilled together, then merged into the running batch (KV caches right-aligned after a
masked gap, positions counted by the attention mask, as in one ``generate`` call), so a
row sees exactly its own tokens whatever else is in the batch, up to the float rounding of
batched kernels. A row that ends keeps its KV cache in the policy until its episode's next
turn continues it (only the environment's new tokens are prefilled then).

Rows whose tokens so far are the same (a GRPO group's episodes: one prompt, and often
the same first words, such as a search call that copies the question) share one sequence
of the batch, a *slot*: the model runs each slot once a step, and each row draws its
token from the slot's logits with its own generator. Where the rows of a slot draw
different tokens, the slot splits: each further token gets a copy of the slot's KV cache.
In the RAG-v0 recipe's saved episodes, a first turn's decode steps have 5.4 rows per
slot (3.4 over all turns). Where the policy's ``share_slots`` is off (by default on a
GPU, where a step's time barely grows with its rows) every row has a slot of its own.

A step may also verify drafted tokens (:mod:`agentenv.lm.drafting`): each slot's next
token goes through the model with the tokens that followed its last few tokens earlier in
its context, and each row draws position after position with its own generator while its
draws equal the drafts. A row thus takes as many tokens as it drew (the drafts it drew
and one more), exactly those of drawing one at a time; the drafts it did not draw are
masked out of the cache. How many tokens a step drafts follows how often rows drew the
looked-up token, against what a longer forward costs (:meth:`Decoder._draft_length`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from agentenv.errors import InvalidOptionError
from agentenv.lm.attention import AppendCacheLayer, append_cache
from agentenv.lm.backend import Generation, SamplingConfig
from agentenv.lm.decode_step import decode_logits
from agentenv.lm.drafting import lookup
from agentenv.lm.draw import Buffers, has_stop, sample, warpers


class DecodingPolicy(Protocol):
    """What a :class:`Decoder` uses of its policy, and all it uses
    (:class:`~agentenv.lm.sampler.TransformersPolicy` is one)."""

    model: torch.nn.Module  # the sampling copy the decode steps run
    tokenizer: Any  # decodes tokens for the stop strings
    device: torch.device
    stop_token_ids: list[int]
    pad_token_id: int
    share_slots: bool  # rows that drew the same tokens share a slot
    draft_tokens: int  # most tokens drafted a step (0: none)
    llama_step: bool  # decode_logits may run its direct Llama step
    decoded_rows: int  # counters the decoder adds to
    decoded_slots: int
    decoded_tokens: int

    def decoding(self) -> AbstractContextManager[None]:
        """The context every model call of the decoder runs in."""
        ...

    def prefill(
        self, prompts: Sequence[Sequence[int]], *, keep_saved: bool = False
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, list[int], torch.Tensor | None]:
        """KV cache, mask ``(u, L)``, next-token logits ``(u, V)``, next positions ``(u,)``
        of the distinct prompts, each prompt's row among them, and the last hidden states
        ``(u, H)`` the logits came from (None where not recorded)."""
        ...

    def save(
        self, cache: Any, j: int, mask: torch.Tensor, key: tuple[int, ...], rows: int = 1
    ) -> None:
        """Keep row ``j``'s KV cache for the continuation of ``key`` by ``rows`` rows."""
        ...

    def may_end(self, token: int, finals: frozenset[str] | None) -> bool:
        """False if ``token`` cannot complete a stop string."""
        ...


@dataclass
class _Row:
    key: Any  # the caller's handle
    prompt: tuple[int, ...]
    max_new_tokens: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # (H,): the state its first token is drawn from


class Decoder:
    """Rows decoded together, one token per row per :meth:`step` (see the module docstring).

    Args:
        policy: What it decodes with (:class:`DecodingPolicy`: the model, tokenizer,
            stop tokens, the prefill and the saved KV caches).
        sampling: How every row samples; ``max_new_tokens`` is the most a row may take.
        keep_saved: Keep saved KV caches that this decoder's rows do not continue (the
            rollout engine: other episodes' turns arrive later). False: a prefill drops
            them (one ``generate`` call continues only the previous call's rows).
        dead_fraction: A slot whose rows have all ended stays in the batch (masked, its
            outputs ignored) until more than this share of the slots are such: removing
            one copies the whole KV cache, so the rollout engine drops ended slots in
            bulk, or for free when rows join. 0: at once (one ``generate`` call).
    """

    def __init__(
        self,
        policy: DecodingPolicy,
        sampling: SamplingConfig,
        *,
        keep_saved: bool = True,
        dead_fraction: float = 0.5,
    ):
        self.policy, self.sampling, self.keep_saved = policy, sampling, keep_saved
        self.dead_fraction = dead_fraction
        self.warpers = warpers(sampling)
        self.stop_ids = set(policy.stop_token_ids)
        self.stop_strings = list(sampling.stop_strings or [])
        # Stop strings ending in whitespace or a non-ASCII character are always checked:
        # a token's text alone may drop a leading space, or hold part of a character.
        finals: frozenset[str] | None = frozenset(s[-1] for s in self.stop_strings)
        if any(not c.isascii() or c.isspace() for c in finals):
            finals = None
        self.finals = finals
        self.queued: list[_Row] = []
        # the running batch's slots, in order: the rows sharing each ([]: ended)
        self.slots: list[list[_Row]] = []
        self.live = 0  # rows still decoding
        self.mergeable = True  # False once a prefill gives a cache rows cannot join
        self._waited = 0  # steps the oldest queued row has waited
        self._cache: Any = None
        # per slot: the mask over the cache, logits after each token of the last forward
        # (slots, width, V), the next token's position, the tokens looked up to follow
        # (the first ``_fed`` of them went through that forward, to be verified)
        self._mask = self._logits = self._next_pos = torch.empty(0)
        self._drafts: list[list[int]] = []
        self._width, self._fed = 1, 0  # tokens per slot in the last forward, drafts fed
        # how often a row's next token was its slot's first looked-up token (decayed
        # counts): what drafting more tokens is expected to gain
        self._seen = self._agreed = 0.0
        self._buffers = Buffers()  # the draw's, reused step after step

    def __len__(self) -> int:
        """Rows in flight: running plus queued."""
        return self.live + len(self.queued)

    def add(
        self,
        key: Any,
        prompt: Sequence[int],
        *,
        seed: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """Queue a row; the next :meth:`step` prefills it and it joins the running batch.

        Args:
            key: Returned with the row's :class:`Generation` when its turn ends.
            prompt: Token ids (a continuation of a row this policy decoded before starts
                from that row's KV cache).
            seed: The row draws its tokens from a generator with this seed (None: the
                global RNG).
            max_new_tokens: The row's own limit (at most ``sampling.max_new_tokens``).
        """
        limit = self.sampling.max_new_tokens
        limit = limit if max_new_tokens is None else min(limit, max_new_tokens)
        if not prompt or limit < 1:
            raise InvalidOptionError(
                f"a row needs a non-empty prompt and max_new_tokens >= 1, got {len(prompt)} "
                f"prompt tokens and max_new_tokens={limit}"
            )
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.queued.append(_Row(key, tuple(prompt), limit, generator))

    def step(self) -> list[tuple[Any, Generation]]:
        """Admit the queued rows when it is time (one batched prefill), draw a token for
        every running row (and the drafted tokens it draws after it), and return ``(key,
        Generation)`` for each row whose turn ended.

        Joining copies the running batch's KV cache once, so queued rows join together: at
        once into an empty batch, else when they are a quarter of the running rows or the
        first of them has waited ``ADMIT_AFTER`` steps.
        """
        with self.policy.decoding():
            if self.queued and self._time_to_admit():
                self._admit()
            if self.queued:
                self._waited += 1
            return self._decode() if self.live else []

    ADMIT_AFTER = 8

    def _time_to_admit(self) -> bool:
        if not self.live:
            return True
        if not self.mergeable:
            return False
        return 4 * len(self.queued) >= self.live or self._waited >= self.ADMIT_AFTER

    def _admit(self) -> None:
        new, self.queued, self._waited = self.queued, [], 0
        cache, mask, logits, next_pos, index, hidden = self.policy.prefill(
            [r.prompt for r in new], keep_saved=self.keep_saved
        )
        if hidden is not None:
            for row, i in zip(new, index, strict=True):
                row.hidden = hidden[i]
        logits = logits[:, None]  # (u, 1, V): nothing drafted
        # identical prompts share a slot, unless slots cannot be copied when they split
        # (a cache of sliding windows or recurrent states: every row keeps its own)
        if self.policy.share_slots and plain_layers(cache):
            slots: list[list[_Row]] = [[] for _ in range(len(logits))]
            for row, i in zip(new, index, strict=True):
                slots[i].append(row)
        else:  # a slot per row
            if len(index) > len(logits):
                rows = torch.tensor(index)
                at = rows.to(logits.device)
                cache.batch_select_indices(at)
                logits, mask, next_pos = logits[at], mask[rows], next_pos[rows]
            slots = [[row] for row in new]
        if self.live:  # ended slots are left out of the merged batch
            alive = torch.tensor([j for j, rows in enumerate(self.slots) if rows])
            cache, mask = merge_caches(
                self.policy.model, [(self._cache, self._mask, alive), (cache, mask, None)]
            )
            running = self._logits[alive.to(self._logits.device)]  # (n, width, V)
            logits = torch.cat([running, F.pad(logits, (0, 0, 0, running.shape[1] - 1))])
            next_pos = torch.cat([self._next_pos[alive], next_pos])
            drafts = [d for d, rows in zip(self._drafts, self.slots, strict=True) if rows]
            slots = [rows for rows in self.slots if rows] + slots
        else:
            drafts, self._width, self._fed = [], 1, 0
        self.mergeable = plain_layers(cache)
        self._cache, self._mask, self._logits, self._next_pos = cache, mask, logits, next_pos
        self._drafts = drafts + [[] for _ in range(len(slots) - len(drafts))]
        self.slots, self.live = slots, self.live + len(new)

    def _decode(self) -> list[tuple[Any, Generation]]:
        policy, slots = self.policy, self.slots
        out = []
        # slot -> (drafts taken, token) -> its rows going on with that token
        going: dict[int, dict[tuple[int, int], list[_Row]]] = {}
        ended: dict[tuple[int, ...], list[int]] = {}  # saved key -> [slot, rows, drafts taken]
        drawing = [(j, row) for j, rows in enumerate(slots) for row in rows]
        policy.decoded_rows += len(drawing)
        policy.decoded_slots += sum(1 for rows in slots if rows)
        at = 0  # the position drawn: after the slot's fed token, then after each draft
        while drawing:  # rows whose draws so far were their slot's drafts
            token, logp = self._draw(drawing, at)
            policy.decoded_tokens += len(drawing)
            taking = []
            for (j, row), t, lp in zip(drawing, token.tolist(), logp.tolist(), strict=True):
                row.tokens.append(t)
                row.logps.append(lp)
                drafts = self._drafts[j]
                if at == 0 and drafts:  # drafted or not: was the lookup right?
                    self._seen, self._agreed = self._seen + 1, self._agreed + (t == drafts[0])
                reason = self._end_reason(row, t)
                if reason is not None:
                    ended.setdefault(row.prompt + tuple(row.tokens[:-1]), [j, 0, at])[1] += 1
                    text = policy.tokenizer.decode(row.tokens, skip_special_tokens=True)
                    out.append(
                        (row.key, Generation(row.tokens, row.logps, text, reason, row.hidden))
                    )
                    self.live -= 1
                elif at < min(self._fed, len(drafts)) and t == drafts[at]:
                    taking.append((j, row))  # the draft's key and value are in the cache
                else:
                    going.setdefault(j, {}).setdefault((at, t), []).append(row)
            drawing, at = taking, at + 1
        for key, (j, n, taken) in ended.items():  # kept for the episodes' next turns
            policy.save(self._cache, j, self._taken_mask(j, taken), key, rows=n)
        if not self.live:
            self.slots, self._cache = [], None
            return out
        # each slot goes on with its first (drafts taken, token)'s rows; others get copies
        feed = [self.policy.pad_token_id] * len(slots)
        taken, parents = [0] * len(slots), []
        for j in range(len(slots)):
            slots[j] = []
            for (k, t), group in going.get(j, {}).items():
                if not slots[j]:
                    slots[j], feed[j], taken[j] = group, t, k
                else:  # (only with policy.share_slots: else a slot has one row)
                    parents.append(j)
                    slots.append(group)
                    feed.append(t)
                    taken.append(k)
        if parents:  # room for every row going on to have a slot of its own
            self._add_slots(parents, len(slots) + self.live - len(going) - len(parents))
        for s, j in enumerate(list(range(len(slots) - len(parents))) + parents):
            if taken[s] < min(self._fed, len(self._drafts[j])):  # drafts not taken: masked
                self._mask[s] = self._taken_mask(j, taken[s], self._mask[s])
        self._next_pos = self._next_pos + torch.tensor(taken)
        token = torch.tensor(feed)
        alive = torch.tensor([bool(rows) for rows in slots])
        if len(slots) - int(alive.sum()) > self.dead_fraction * len(slots):
            index = alive.nonzero().squeeze(1)  # ended slots dropped
            self._cache.batch_select_indices(index.to(policy.device))
            self._mask, self._next_pos = self._mask[index], self._next_pos[index]
            token, alive = token[index], alive[index]
            self.slots = slots = [rows for rows in slots if rows]
        self._drafts, self._fed = self._new_drafts(slots, int(alive.sum()))
        fed = [d[: self._fed] for d in self._drafts]
        width = 1 + max(len(d) for d in fed)
        ids = torch.full((len(slots), width), self.policy.pad_token_id)
        new = torch.zeros((len(slots), width), dtype=torch.long)  # the new tokens' mask
        ids[:, 0], new[:, 0] = token, alive.long()
        for s, drafts in enumerate(fed):
            if drafts:
                ids[s, 1 : 1 + len(drafts)], new[s, 1 : 1 + len(drafts)] = torch.tensor(drafts), 1
        self._mask = torch.cat([self._mask, new], dim=1)
        positions = self._next_pos[:, None] + torch.arange(width)
        self._logits, self._cache = decode_logits(  # (slots, width, V)
            policy.model,
            self._cache,
            ids.to(policy.device),
            self._mask.to(policy.device),
            positions.to(policy.device),
            direct=policy.llama_step,
        )
        self._next_pos, self._width = self._next_pos + 1, width
        return out

    def _draw(self, drawing: list[tuple[int, _Row]], at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A token and its log-prob for each ``(slot, row)`` of ``drawing``, from the slot's
        logits after its ``at``-th token of the last forward, with the row's generator."""
        of_row = [j for j, _ in drawing]
        logits = self._logits[:, at]  # (slots, V)
        if of_row != list(range(len(logits))):  # not one row per slot, each drawing
            logits = logits[torch.tensor(of_row, device=logits.device)]
        rows = [row for _, row in drawing]
        seeded = any(r.generator is not None for r in rows)
        rngs = [r.generator for r in rows] if seeded else None
        return sample(logits, self.sampling.temperature, self.warpers, rngs, self._buffers)

    def _end_reason(self, row: _Row, token: int) -> str | None:
        """Why ``row``'s turn ends with ``token`` (just appended), or None."""
        if token in self.stop_ids:
            return "stop"
        if (
            self.stop_strings
            and self.policy.may_end(token, self.finals)
            and has_stop(self.policy.tokenizer, row.tokens, self.stop_strings)
        ):
            return "stop_string"
        if len(row.tokens) >= row.max_new_tokens:
            return "length"
        return None

    def _taken_mask(self, j: int, taken: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Slot ``j``'s mask (or ``mask``, a copy of it) with the drafts after the first
        ``taken`` of the last forward masked out: the slot's rows drew other tokens there."""
        mask = self._mask[j] if mask is None else mask
        drafts = min(self._fed, len(self._drafts[j]))
        if taken >= drafts:
            return mask
        mask = mask.clone()
        first = mask.shape[0] - self._width + 1  # the slot's first draft
        mask[first + taken : first + drafts] = 0
        return mask

    def _new_drafts(self, slots: list[list[_Row]], running: int) -> tuple[list[list[int]], int]:
        """Each slot's looked-up tokens (:func:`~agentenv.lm.drafting.lookup`), never more
        than a row of the slot may still take, and how many of them the next forward
        verifies (:meth:`_draft_length`). Without drafts, a token is looked up for the
        first ``LOOKED_UP`` slots: whether rows then draw it is what drafting would gain."""
        self._seen, self._agreed = self._seen * self.DECAY, self._agreed * self.DECAY
        drafts: list[list[int]] = [[] for _ in slots]
        if not self.policy.draft_tokens or not self.mergeable:
            return drafts, 0  # (a sliding window would count rejected drafts' slots)
        k, looked = self._draft_length(running), 0
        for s, rows in enumerate(slots):
            if rows and (k or looked < self.LOOKED_UP):
                room = min(r.max_new_tokens - len(r.tokens) for r in rows) - 1
                drafts[s] = lookup(rows[0].prompt + tuple(rows[0].tokens), min(max(k, 1), room))
                looked += 1
        return drafts, k

    def _draft_length(self, running: int) -> int:
        """Drafts per slot (0 to ``policy.draft_tokens``) that give the most tokens per unit
        of a forward's cost, for ``running`` slots, if that is ``DRAFT_GAIN`` times what no
        drafts give: a forward of ``T`` tokens costs ``1 + T / STEP_TOKENS``, and a slot
        with ``k`` drafts takes ``1 + a + ... + a^k`` tokens, ``a`` the share of rows whose
        next token was their slot's first looked-up one."""
        a = (self._agreed + 1) / (self._seen + 2)  # (a prior of 1/2, worth 2 rows)
        best, length = self.DRAFT_GAIN * running / (1 + running / self.STEP_TOKENS), 0
        for k in range(1, self.policy.draft_tokens + 1):
            tokens = running * sum(a**i for i in range(k + 1))
            rate = tokens / (1 + running * (1 + k) / self.STEP_TOKENS)
            if rate > best:
                best, length = rate, k
        return length

    # A forward of SmolLM2 in bf16 on a 2-core CPU over ~700 cached tokens costs ~28 ms
    # (reading the weights) plus ~1.15-1.5 ms a token (its linear layers' compute) and
    # ~0.6 ms a slot (its cache): 1 x 5 tokens 29.5 ms as 1 x 1 29.3; 8 x 1 38.1, 8 x 2
    # 45.6, 8 x 5 72.8; 32 x 1 85.5, 32 x 2 122.8 (medians of 9). At 8 slots of fixed work
    # (the lookup right for a third of the rows) a draft each cost more than it gained, so
    # drafts must be expected to gain 15%, at a cost counted on the high side.
    STEP_TOKENS = 16
    DRAFT_GAIN = 1.15
    DECAY = 0.9  # per step, of the counts behind the lookup's hit rate: ~10 steps' worth
    LOOKED_UP = 16

    def _add_slots(self, parents: list[int], room: int) -> None:
        """Append a copy of each slot in ``parents`` (its KV cache, mask and position) to
        the batch; in-place caches keep ``room`` slots' room for later copies."""
        index = torch.tensor(parents)
        at = index.to(self.policy.device)
        for layer in self._cache.layers:
            if isinstance(layer, AppendCacheLayer):
                layer.batch_append(at, capacity=room)
            else:
                layer.keys = torch.cat([layer.keys, layer.keys[at]])
                layer.values = torch.cat([layer.values, layer.values[at]])
        self._mask = torch.cat([self._mask, self._mask[index]])
        self._next_pos = torch.cat([self._next_pos, self._next_pos[index]])


def plain_layers(cache: Any) -> bool:
    """True for a cache of full-attention ``DynamicLayer`` s: rows of such caches can be
    saved, continued and merged (sliding-window and other layers cannot)."""
    layers = getattr(cache, "layers", None)
    plain = ("DynamicLayer", "AppendCacheLayer")
    return bool(layers) and all(type(layer).__name__ in plain for layer in layers)


def merge_caches(
    model: torch.nn.Module,
    parts: Sequence[tuple[Any, torch.Tensor, torch.Tensor | None]],
    order: Sequence[int] | None = None,
) -> tuple[Any, torch.Tensor]:
    """One batch from several ``(cache, mask (rows, slots), rows to keep or None)``
    batches: the parts' rows in turn, or ``order[j]``-th of them as row ``j`` (a row may
    be taken more than once).

    Each part's leading slots that no row uses are dropped; the narrower parts get a masked
    gap on the left, so every row stays right-aligned (its positions come from its mask).
    Every key and value is copied once, into buffers with room for the next decode steps
    where the cache appends in place (:class:`~agentenv.lm.attention.AppendCacheLayer`).
    """
    trimmed = []
    for cache, mask, index in parts:
        mask = mask if index is None else mask[index]
        used = mask.sum(0).nonzero()
        first = int(used[0]) if len(used) else mask.shape[1]
        trimmed.append((cache, mask[:, first:], first, index))
    width = max(m.shape[1] for _, m, _, _ in trimmed)
    total = sum(m.shape[0] for _, m, _, _ in trimmed)
    order = list(range(total)) if order is None else list(order)
    rows = len(order)
    # per part: which of its rows (None: all, in turn) go to which merged rows (a slice
    # for a run of them), or None when the part gives no row
    plans: list[tuple[torch.Tensor | None, slice | torch.Tensor] | None] = []
    start = 0
    for _, m, _, _ in trimmed:
        n = m.shape[0]
        fill = [(j, src - start) for j, src in enumerate(order) if start <= src < start + n]
        start += n
        if not fill:
            plans.append(None)
            continue
        dest, src = [j for j, _ in fill], [k for _, k in fill]
        picked = None if src == list(range(n)) else torch.tensor(src)  # some left or twice
        run = dest == list(range(dest[0], dest[0] + len(dest)))
        plans.append((picked, slice(dest[0], dest[0] + len(dest)) if run else torch.tensor(dest)))
    merged = append_cache(model)
    if merged is None:
        from transformers import DynamicCache

        merged = DynamicCache()
    for i in range(len(trimmed[0][0].layers)):
        sample = trimmed[0][0].layers[i].keys
        appends = i < len(merged.layers) and isinstance(merged.layers[i], AppendCacheLayer)
        spare = AppendCacheLayer.SPARE if appends else 0
        shape = (rows, sample.shape[1], width + spare, sample.shape[-1])
        keys, values = sample.new_zeros(shape), sample.new_zeros(shape)
        for (cache, mask, first, index), plan in zip(trimmed, plans, strict=True):
            if plan is None:
                continue
            layer, w = cache.layers[i], mask.shape[1]
            k, v = layer.keys[:, :, first:], layer.values[:, :, first:]
            if index is not None:
                k, v = k[index.to(k.device)], v[index.to(v.device)]
            picked, at = plan
            if picked is not None:
                k, v = k[picked.to(k.device)], v[picked.to(v.device)]
            at = at if isinstance(at, slice) else at.to(k.device)
            keys[at, :, width - w : width] = k
            values[at, :, width - w : width] = v
        if spare:
            merged.layers[i].adopt(keys, values, width)
        else:
            merged.update(keys, values, i)
    masks = torch.cat([F.pad(m, (width - m.shape[1], 0)) for _, m, _, _ in trimmed])
    return merged, masks[order]


def drain(decoder: Decoder) -> Iterator[tuple[Any, Generation]]:
    """Step ``decoder`` until no row is left; yield each row as its turn ends."""
    while len(decoder):
        yield from decoder.step()
