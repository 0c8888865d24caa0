"""The learn-phase benchmark's bookkeeping: turn shapes, which part an operator's time
belongs to, and a matmul's operation count (the figures in docs/benchmarks.md rest on them)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import learn_phase  # noqa: E402

SMOLLM2 = SimpleNamespace(vocab=49152, rank=16, head_dim=64)


def test_turns_parse_and_bad_ones_name_the_format() -> None:
    assert learn_phase.parse_turns("20:277,33:0") == [(20, 277), (33, 0)]
    for bad in ("20", "0:5", "a:b", "20:-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="POLICY:ENV"):
            learn_phase.parse_turns(bad)


@pytest.mark.parametrize(
    ("name", "shapes", "part"),
    [
        ("aten::mm", [[662, 576], [576, 1536]], "linear layers"),
        ("aten::mm", [[662, 1536], [1536, 576]], "linear layers"),
        ("aten::mm", [[662, 576], [576, 16]], "LoRA"),
        ("aten::mm", [[16, 662], [662, 576]], "LoRA"),
        ("aten::mm", [[106, 576], [576, 49152]], "LM head"),
        ("aten::bmm", [[6, 993, 64], [6, 64, 436]], "attention matmuls"),
        (
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            [[8, 9, 2640, 64]],
            "attention matmuls",
        ),
        ("aten::_softmax", [[2, 3, 993, 436], [], []], "attention scores' elementwise"),
        (
            "aten::masked_fill_",
            [[2, 3, 3, 331, 436], [2, 1, 1, 331, 436], []],
            "attention scores' elementwise",
        ),
        ("aten::mul", [[2, 9, 331, 64], [2, 1, 331, 64]], "other"),  # rotary on queries
        ("aten::add", [[2, 331, 576], [2, 331, 576], []], "other"),
    ],
)
def test_each_operator_lands_in_its_part(name: str, shapes: list[list[int]], part: str) -> None:
    assert learn_phase.part_of(name, shapes, SMOLLM2) == part


def test_matmul_flops_count_two_per_multiply_add() -> None:
    assert learn_phase.matmul_flops("aten::mm", [[662, 576], [576, 1536]]) == 2 * 662 * 576 * 1536
    assert (
        learn_phase.matmul_flops("aten::bmm", [[6, 993, 64], [6, 64, 436]])
        == 2 * 6 * 993 * 64 * 436
    )
    bias = [1536]
    assert (
        learn_phase.matmul_flops("aten::addmm", [bias, [10, 576], [576, 1536]])
        == 2 * 10 * 576 * 1536
    )


@pytest.mark.parametrize("shared_turns", [0, 1])
def test_the_batch_has_the_asked_shapes_and_each_group_shares_its_prompt(shared_turns) -> None:
    """A group's episodes share the prompt and their first ``shared_turns`` turns (policy
    and env tokens), then differ; groups share nothing."""
    args = SimpleNamespace(
        groups=2, group_size=3, prompt=5, turns=[(2, 4), (3, 0)], shared_turns=shared_turns
    )
    groups = learn_phase.make_batch(args, 5000, random.Random(0))
    assert [len(g) for g in groups] == [3, 3]
    common = 5 + 6 * shared_turns  # the prompt, then the 2 + 4 tokens of the first turn
    for group in groups:
        for ep in group:
            assert ep.action_mask == [0] * 5 + [1] * 2 + [0] * 4 + [1] * 3
            assert len(ep.input_ids) == len(ep.sampler_logprobs) == 14
            assert ep.input_ids[:common] == group[0].input_ids[:common]
            assert [lp != 0 for lp in ep.sampler_logprobs] == [bool(m) for m in ep.action_mask]
        assert group[1].input_ids[common:] != group[0].input_ids[common:]
    assert groups[0][0].input_ids[:5] != groups[1][0].input_ids[:5]
