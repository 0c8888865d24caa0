"""The sampler's bfloat16 attention on a CPU: grouped matmuls against PyTorch's fused kernel.

    python benchmarks/attention.py                 # SmolLM2's heads at a RAG step's shapes
    python benchmarks/attention.py --repeats 50

On a CPU in bfloat16 the sampler attends with :func:`grouped_attention` (two grouped
matmuls), where PyTorch's fused kernel was 8x slower at a decode step (an AMD EPYC with
avx512_bf16); in float32 it runs the fused kernel over its in-place KV caches
(:func:`sdpa_over_buffers`). On a CPU with AMX the fused kernel runs bf16 products on
the AMX tiles, and the choice is open again. This times both in bfloat16, one layer's
attention per call, on the same random queries, keys and values: decode steps (one
query per row, or a token and four drafted ones), 16 queries a row (where the fused
kernel starts to win), a first-turn prefill after a shared prefix and continued rows'
prefill after their cached turns (SmolLM2-135M's 9 query and 3 KV heads of 64; a masked
gap in every row); then the learner's forward and backward (grouped, as training runs
it up to 2**22 scores, against the fused kernel). Medians of ``--repeats`` calls after
a warm-up; the two alternate call by call, so a machine's drift reaches both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import torch_threads

from agentenv.lm.attention import grouped_attention, sdpa_over_buffers

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# (rows, queries per row, key slots): decode steps, 16 queries, prefills (RAG-v0's recipe)
SAMPLER_SHAPES = [
    (8, 1, 400),
    (32, 1, 400),
    (8, 5, 400),
    (8, 16, 400),
    (32, 16, 400),
    (4, 107, 557),
    (8, 250, 400),
]
# (rows, tokens): micro-batches, causal, within what grouped attention computes itself
# with gradients (above 2**22 scores it hands the fused kernel the work)
LEARNER_SHAPES = [(8, 160), (4, 300)]


class _Layer(torch.nn.Module):
    """What the attention functions read from an attention layer."""

    num_key_value_groups, is_causal = HEADS // KV_HEADS, True


def _inputs(rows: int, queries: int, slots: int, grad: bool = False) -> tuple:
    g = torch.Generator().manual_seed(rows * queries + slots)
    make = lambda *s: torch.randn(*s, generator=g).bfloat16().requires_grad_(grad)  # noqa: E731
    q = make(rows, HEADS, queries, HEAD_DIM)
    k, v = make(rows, KV_HEADS, slots, HEAD_DIM), make(rows, KV_HEADS, slots, HEAD_DIM)
    mask = torch.ones(rows, 1, queries, slots, dtype=torch.bool).tril(slots - queries)
    mask[..., 10:30] = False  # a masked gap (padding before a row's new tokens)
    return q, k, v, mask


def _amx() -> bool:
    """Whether this CPU has AMX tiles (torch's own check)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def _time(calls: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each call, alternating them."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _sampler_calls(rows: int, queries: int, slots: int) -> dict:
    layer, (q, k, v, mask) = _Layer(), _inputs(rows, queries, slots)
    return {
        "grouped": lambda: grouped_attention(layer, q, k, v, mask, scaling=0.125),
        "fused": lambda: sdpa_over_buffers(layer, q, k, v, mask, scaling=0.125),
    }


def _learner_calls(rows: int, tokens: int) -> dict:
    layer, (q, k, v, mask) = _Layer(), _inputs(rows, tokens, tokens, grad=True)

    def grouped() -> None:
        grouped_attention(layer, q, k, v, mask, scaling=0.125)[0].sum().backward()

    def fused() -> None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
        out.sum().backward()

    return {"grouped": grouped, "fused": fused}


def _row(label: str, ms: dict[str, float]) -> str:
    ratio = ms["grouped"] / ms["fused"]
    return f"{label:<36}{ms['grouped']:>11.3f}{ms['fused']:>10.3f}{ratio:>7.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="Timed calls of each.")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch_threads()} threads, bfloat16, AMX: {_amx()}")
    header = f"{'grouped ms':>11}{'fused ms':>10}{'ratio':>8}"
    print(f"\n{'sampler: rows x queries, slots':<36}{header}")
    with torch.inference_mode():
        for rows, queries, slots in SAMPLER_SHAPES:
            ms = _time(_sampler_calls(rows, queries, slots), args.repeats)
            print(_row(f"{rows} x {queries}, {slots}", ms))
    print(f"\n{'learner fwd + bwd: rows x tokens':<36}{header}")
    for rows, tokens in LEARNER_SHAPES:
        ms = _time(_learner_calls(rows, tokens), max(3, args.repeats // 4))
        print(_row(f"{rows} x {tokens}", ms))


if __name__ == "__main__":
    main()
