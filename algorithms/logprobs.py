"""Per-token log-probs of sequences under a causal LM, without whole-vocabulary tensors.

A training forward over ``N`` sequences of ``T`` tokens would normally materialise float32
logits ``(N, T, V)`` (V = 49152 for SmolLM2: 0.8 GB for 4096 tokens) plus a softmax and a
gradient of the same size. Here the model runs up to its last hidden layer only; the LM
head is applied to chunks of at most ``chunk_tokens`` positions, each chunk's
``log p(token)`` is taken in float32, and, when gradients are needed, the chunk's logits
are recomputed in the backward pass (activation checkpointing of the head alone) instead of
being kept. Only scored positions get logits at all: with an action mask, the policy's
tokens (the shared prompt and the environment's tokens need none). Rows that share
prefixes run as their prefix tree (:mod:`algorithms.prefix_tree`), each shared token once.

Models whose head is not a plain ``nn.Linear`` (a LoRA-adapted head, logit soft-capping
or scaling) fall back to the model's own logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from agentenv.lm.attention import CPU_BF16_ATTENTION, cached_forward
from algorithms.prefix_tree import PrefixTree

CHUNK_TOKENS = 256  # LM-head positions per chunk: 256 x 49152 float32 logits = 50 MB (measured
# on a 2-core CPU: 256 is as fast as 1024 and 0.3 GB leaner in a GRPO step)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits).gather(-1, index)`` for logits ``(N, T, V)``, index ``(N, T)``.

    Computes ``logit[index] - logsumexp(logits)`` one row at a time in float32, so no
    ``(N, T, V)`` log-softmax copy is made. Returns float32 ``(N, T)``.
    """
    selected = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1).float()  # (N, T)
    logsumexp = torch.stack([torch.logsumexp(row.float(), dim=-1) for row in logits])  # (N, T)
    return selected - logsumexp


def _undistributed(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / accelerate wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForCausalLM`` inside distributed and peft wrappers."""
    model = _undistributed(model)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()  # peft
    return model


def _plain_head(model: torch.nn.Module) -> tuple[str, torch.nn.Linear] | None:
    """``(attribute name, head)`` when the LM head is a plain linear layer we may bypass."""
    lm = _unwrap(model)
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if get_head else None
    config = getattr(lm, "config", None)
    if type(head) is not torch.nn.Linear or any(
        getattr(config, key, None) not in (None, 1.0)
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")
    ):
        return None
    name = next((n for n, child in lm.named_children() if child is head), None)
    return (name, head) if name else None


@contextlib.contextmanager
def _hidden_states_out(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Make the model return its last hidden states in ``.logits`` (head -> identity)."""
    lm = _unwrap(model)
    head = getattr(lm, name)
    setattr(lm, name, torch.nn.Identity())
    try:
        yield
    finally:
        setattr(lm, name, head)


def _chunk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head + log-softmax of one chunk: hidden ``(c, H)`` -> log-probs, entropy ``(c,)``."""
    logits = F.linear(hidden, weight, bias).float()  # (c, V)
    if temperature != 1.0:
        logits = logits.div_(temperature)  # in place: .float()'s backward keeps nothing
    logsumexp = logits.logsumexp(-1)  # (c,)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logsumexp  # (c,)
    entropy = torch.zeros_like(logsumexp)
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(logits, dim=-1)  # H = logsumexp - sum p * logits
            entropy = logsumexp - (probs * logits).sum(-1)
    return logp, entropy


class _HeadLogprobs(torch.autograd.Function):
    """:func:`_chunk_logprobs` (entropy without gradient) with a hand-written backward.

    Autograd through ``logsumexp`` and ``gather`` makes about ten passes over the chunk's
    ``(c, V)`` float32 logits (each ~16 ms for 256 x 49152 on a 2-core CPU, memory-bound);
    this makes one exp pass forward and one backward, keeping only the hidden chunk (the
    logits are recomputed, as under checkpointing). The gradient of ``log p(target)``
    with respect to the logits is ``onehot(target) - softmax``, divided by the temperature.
    The head's matmuls run in the dtype autocast gave the forward (bfloat16 in a bf16 run).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,  # (c, H)
        weight: torch.Tensor,  # (V, H)
        bias: torch.Tensor | None,  # (V,)
        targets: torch.Tensor,  # (c,)
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        low = F.linear(hidden, weight, bias)  # (c, V) in the autocast dtype, if any
        compute, logits = low.dtype, low.float()  # logits: (c, V)
        del low
        if temperature != 1.0:
            logits.div_(temperature)
        top = logits.amax(-1, keepdim=True)  # (c, 1)
        exp = (logits - top).exp_()  # (c, V)
        total = exp.sum(-1)  # (c,)
        logsumexp = top.squeeze(-1) + total.log()  # (c,)
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logsumexp  # (c,)
        entropy = torch.zeros_like(logsumexp)
        if with_entropy:  # H = logsumexp - sum p * logits
            entropy = logsumexp - exp.mul_(logits).sum(-1) / total
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.compute = temperature, compute
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        dt = ctx.compute
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dt), weight.to(dt)
            b = bias.to(dt) if bias is not None else None
            probs = F.linear(h, w, b).float()  # (c, V): the logits again
            if ctx.temperature != 1.0:
                probs.div_(ctx.temperature)
            probs.sub_(probs.amax(-1, keepdim=True)).exp_()
            probs.div_(probs.sum(-1, keepdim=True))  # softmax
            g = grad_logp.float().unsqueeze(-1)  # (c, 1)
            grad = probs.mul_(-g)  # (c, V): g * (onehot - p)
            grad.scatter_add_(-1, targets.unsqueeze(-1), g)
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            grad = grad.to(dt)
            need = ctx.needs_input_grad
            grad_h = (grad @ w).to(hidden.dtype) if need[0] else None  # (c, H)
            grad_w = (grad.T @ h).to(weight.dtype) if need[1] else None  # (V, H)
            grad_b = grad.sum(0).to(bias.dtype) if bias is not None and need[2] else None
        return grad_h, grad_w, grad_b, None, None, None


def _head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``(P,)`` of ``targets`` ``(P,)`` from the last hidden states
    ``hidden`` ``(P, H)`` through the LM ``head``, ``chunk_tokens`` positions at a time."""
    parts = []
    for s in range(0, hidden.shape[0], chunk_tokens):
        args = (hidden[s : s + chunk_tokens], head.weight, head.bias, targets[s : s + chunk_tokens])
        if entropy_grad and torch.is_grad_enabled():  # an entropy bonus: autograd, keeping
            parts.append(  # only the hidden chunk (the logits are recomputed later)
                checkpoint(
                    _chunk_logprobs, *args, temperature, with_entropy, True, use_reentrant=False
                )
            )
        else:  # one fused softmax pass (no graph kept under no_grad)
            parts.append(_HeadLogprobs.apply(*args, temperature, with_entropy))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _logits_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_head_logprobs` for a model's own logits ``(P, V)`` (a head we do not bypass)."""
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_log_softmax(logits[None], targets[None])[0]  # (P,)
    entropy = torch.zeros_like(logp)
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            logprobs = logits.float().log_softmax(-1)  # (P, V)
            entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logp, entropy


MIN_SHARED_PREFIX = 16  # shorter common prefixes are not worth a second forward call
TREE_BELOW = 0.75  # run a prefix tree where it holds at most this share of the tokens
# the rows' common prefix alone leaves (not tuned: rows that share only a prompt make a
# tree of ~1.0, a RAG-v0 group's ~0.27, a quickstart group's ~0.5). One value for every
# device, by choice: on an H200 a RAG micro-batch ran 0.37 s as a tree against 0.27 s as
# rows, but in a quarter of the memory (2.5 vs 9.5 GB; docs/benchmarks.md, "On a GPU"),
# so a GPU keeps the tree too (micro_batch_tokens is the threshold chosen per device)


def tree_attention_applies(model: torch.nn.Module) -> bool:
    """Whether ``model`` attends as a prefix tree's mask says: its attention applies a
    4D mask as given (SDPA, eager, agentenv's CPU attention; flash attention does not)
    and every layer attends to the whole sequence (a sliding window would be dropped
    by the tree's mask)."""
    config = getattr(_unwrap(model), "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager", CPU_BF16_ATTENTION):
        return False
    layers = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    windowed = window is not None and getattr(config, "use_sliding_window", True)
    return not windowed and all(kind == "full_attention" for kind in layers)


def _common_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, limit: int) -> int:
    """Length of the run of tokens, at most ``limit``, that every row begins with
    (unpadded); 0 if shorter than :data:`MIN_SHARED_PREFIX` or for one row."""
    if input_ids.shape[0] < 2 or limit < MIN_SHARED_PREFIX:
        return 0
    same = (input_ids[:, :limit] == input_ids[:1, :limit]).all(0)
    same &= attention_mask[:, :limit].all(0).bool()
    prefix = int(same.long().cumprod(0).sum())
    return prefix if prefix >= MIN_SHARED_PREFIX else 0


def _forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: int,
    prefix: int,
) -> torch.Tensor:
    """``model(...).logits`` of the last ``keep`` positions, the rows' common ``prefix``
    (from :func:`_common_prefix`) prefilled once.

    The prefix runs with batch 1 through the model *without* its distributed wrapper,
    so a DDP model sees one forward per backward; its KV cache is repeated to every row
    and the rest of the rows runs through ``model`` itself with explicit positions.
    """
    n, t = input_ids.shape
    cache = None
    if prefix and keep <= t - prefix:
        _, cache = cached_forward(  # None under gradient checkpointing: rows run in full
            _undistributed(model), None, input_ids=input_ids[:1, :prefix], logits_to_keep=1
        )
    if cache is None:
        return model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep
        ).logits
    cache.batch_repeat_interleave(n)
    positions = torch.arange(prefix, t, device=input_ids.device).expand(n, -1)
    logits, _ = cached_forward(
        model,
        cache,
        input_ids=input_ids[:, prefix:],
        attention_mask=attention_mask,
        position_ids=positions,
        logits_to_keep=keep,
    )
    return logits


def forward_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    action_mask: torch.Tensor | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = CHUNK_TOKENS,
    share_prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward: per-token log-probs ``(N, T)`` and, optionally, entropies ``(N, T)``.

    Sequences are right-padded; ``logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``
    at temperature ``temperature``. Position 0 and padding get 0. With ``action_mask``, only
    policy tokens (mask 1) are scored; every other position gets 0 (no logits are made for
    it). Differentiable unless called under ``no_grad``; the entropy only with
    ``entropy_grad`` (an entropy bonus), from the same logits chunks (no second forward).

    With ``share_prefix``, what the rows have in common runs through the model once: the
    same values to float rounding, the same gradients (a shared token's gradient is the
    sum of its rows'), a fraction of the work. Where the rows share more than a common
    prefix (a GRPO group whose episodes go on alike after their prompt), they run as their
    :class:`~algorithms.prefix_tree.PrefixTree`: each distinct prefix once, as one
    sequence per tree with a tree attention mask, each row reading its log-probs from the
    tree's nodes. Otherwise (rows that share only their beginning, such as SFT's
    demonstrations of different tasks) the tokens every row begins with, before the first
    scored one, are prefilled once and the rows continue from that KV cache: the tree's
    attention, over all of its nodes at once, would cost more than it saves there
    (:data:`TREE_BELOW`); so do models whose attention cannot take the tree's mask
    (:func:`tree_attention_applies`). Without ``share_prefix`` the rows run side by side,
    each in full.
    """
    n, t = input_ids.shape
    head = _plain_head(model)
    start = 1
    if action_mask is not None and action_mask.any():
        start = max(1, int(action_mask.any(dim=0).float().argmax()))  # first scored token
    prefix = _common_prefix(input_ids, attention_mask, start - 1) if share_prefix else 0
    tree = None
    if share_prefix and n > 1 and tree_attention_applies(model):
        tree = PrefixTree.from_rows(input_ids, attention_mask, action_mask)
        if len(tree) > TREE_BELOW * (int(attention_mask.sum()) - (n - 1) * prefix):
            tree = None
    if tree is not None:
        scored = tree.scored.nonzero().squeeze(-1)  # (P,) nodes to score
        targets = tree.tokens[scored]  # (P,)
        inputs = tree.flat_index(tree.parents[scored])  # (P,): where each one's parent sits

        def run(m: torch.nn.Module) -> torch.Tensor:  # (R, W, H or V)
            return m(**tree.model_inputs(), use_cache=False).logits
    else:
        # scored positions: policy tokens when there is an action mask (environment tokens
        # in between need no logits), else every real token
        mask = (action_mask if action_mask is not None else attention_mask)[:, start:].bool()
        scored_rows = F.pad(mask, (start, 0))  # (N, T)
        targets = input_ids[scored_rows]  # (P,)

        def run(m: torch.nn.Module) -> torch.Tensor:  # (N, T - start + 1, H or V)
            return _forward(m, input_ids, attention_mask, t - start + 1, prefix)

    if head is None:
        out = run(model)
    else:
        name, linear = head
        with _hidden_states_out(model, name):
            out = run(model)  # the last hidden states
    if tree is not None:
        selected = out.flatten(0, 1)[inputs]  # (P, H or V): at each scored node's parent
    else:
        selected = out[:, :-1][mask]  # (P, H or V): at the position before each scored one
    if head is None:
        logp, entropy = _logits_logprobs(selected, targets, temperature, with_entropy, entropy_grad)
    else:
        logp, entropy = _head_logprobs(
            selected, linear, targets, temperature, with_entropy, entropy_grad, chunk_tokens
        )
    entropy = entropy if entropy_grad else entropy.detach()
    if tree is not None:  # each row reads its nodes; nodes not scored read 0
        nodes = out.new_zeros(len(tree) + 1, dtype=torch.float32)  # (L + 1,): the last is 0
        where = tree.node_of.masked_fill(tree.node_of < 0, len(tree))  # (N, T); padding: L
        logp_rows = nodes.index_put((scored,), logp)[where]
        entropy_rows = nodes.index_put((scored,), entropy)[where]
    else:
        zeros = out.new_zeros((n, t), dtype=torch.float32)
        logp_rows = zeros.masked_scatter(scored_rows, logp)
        entropy_rows = zeros.masked_scatter(scored_rows, entropy)
    if not len(targets):  # nothing scored (a padding micro-batch): zeros that still reach
        logp_rows = logp_rows + out.float().sum() * 0.0  # every weight, so DDP's backward runs
    return logp_rows, entropy_rows if with_entropy else None


def hidden_before(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    marked: torch.Tensor,
) -> torch.Tensor:
    """The last hidden state each marked token is predicted from: ``(M, H)`` float32 for
    the ``M`` True positions of ``marked`` ``(N, T)`` (row-major; never position 0), i.e.
    the hidden state at the position before each (the one the LM head turns into that
    token's logits). With the first token of each policy turn marked: the state the
    turn is taken from, which the ``gae`` critic reads.

    One forward without the LM head, sharing what the rows share as
    :func:`forward_logprobs` does (their prefix tree where it saves enough, else their
    common prefix prefilled once); call it under ``no_grad``. Needs a plain linear LM
    head (:func:`plain_head_width`).
    """
    head = _plain_head(model)
    if head is None:
        raise ValueError("hidden_before needs a plain linear LM head; see plain_head_width")
    n, t = input_ids.shape
    rows, cols = marked.nonzero(as_tuple=True)  # (M,)
    if not rows.numel():
        return torch.zeros(0, head[1].in_features)
    if int(cols.min()) < 1:
        raise ValueError("position 0 is predicted by no hidden state; mark tokens after it")
    start = int(cols.min())
    prefix = _common_prefix(input_ids, attention_mask, start - 1)
    tree = None
    if n > 1 and tree_attention_applies(model):
        tree = PrefixTree.from_rows(input_ids, attention_mask)
        if len(tree) > TREE_BELOW * (int(attention_mask.sum()) - (n - 1) * prefix):
            tree = None
    with _hidden_states_out(model, head[0]):
        if tree is not None:  # each marked token's parent node holds the hidden state
            out = model(**tree.model_inputs(), use_cache=False).logits  # (R, W, H)
            parents = tree.parents[tree.node_of[rows, cols]]  # (M,)
            return out.flatten(0, 1)[tree.flat_index(parents)].float()
        out = _forward(model, input_ids, attention_mask, t - start + 1, prefix)  # (N, ., H)
    return out[rows, cols - start].float()  # out[:, j] is position start - 1 + j


def plain_head_width(model: torch.nn.Module) -> int | None:
    """The width of the last hidden state, when the model's LM head is a plain linear
    layer over it (no LoRA on it, no logit soft-capping or scaling: what
    :func:`hidden_before` needs); else None."""
    head = _plain_head(model)
    return head[1].in_features if head is not None else None


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    action_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-prob of every token under ``model``, aligned to input positions: ``(N, T)``.

    Sequences must be right-padded (positions are counted from 0, as in ``collate``).
    Position 0 and padding get 0. With ``action_mask`` only positions from the first policy
    token on are scored (the rest are 0). Differentiable unless under ``no_grad``.
    """
    return forward_logprobs(model, input_ids, attention_mask, temperature, action_mask=action_mask)[
        0
    ]
