"""The sampling copy's attention projections packed as one matrix (``PackedConcat``)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from devices import DEVICES

from agentenv.lm import weights
from agentenv.lm.sampler import TransformersPolicy


def packed_layers(dtype, bias=False, seed=0):
    """A query, key and value projection of one 64-wide input (64, 16, 16 outputs), packed."""
    torch.manual_seed(seed)
    return [
        weights._PackedLinear(torch.nn.Linear(64, n, bias=bias, dtype=dtype)) for n in (64, 16, 16)
    ]


def skip_unless_packed(dtype):
    if not weights.packs_linears("cpu", dtype):
        pytest.skip(f"oneDNN packs no {dtype} linear on this CPU (bf16 needs avx512bw/vl/dq)")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_concat_gives_its_layers_outputs_side_by_side(dtype, bias):
    """Bitwise where :meth:`exact` says so (the decode step uses it only there); equal to
    float rounding anywhere."""
    skip_unless_packed(dtype)
    layers = packed_layers(dtype, bias)
    concat = weights.PackedConcat(layers)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for rows in (1, 3, 8):
            x = torch.randn(rows, 1, 64, generator=gen).to(dtype)
            out = concat(x)
            expected = torch.cat([layer(x) for layer in layers], -1)
            assert out.shape == (rows, 1, 96) and out.dtype == dtype
            if concat.exact(rows):
                assert torch.equal(out, expected)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_is_false_when_the_concatenation_differs_in_one_last_bit(dtype, monkeypatch):
    """The check is sharp: one weight of the packed concatenation one unit in the last
    place off (a change smaller than most outputs' rounding) is caught, for one row and
    for many."""
    skip_unless_packed(dtype)
    monkeypatch.setattr(weights, "_CONCAT_EXACT", {})
    layers = packed_layers(dtype)
    concat = weights.PackedConcat(layers)
    weight = torch.cat([layer.weight.detach() for layer in layers])
    bits = weight.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    bits[70, 5] += 1  # key row 6, one weight: the next representable value
    concat.packed = weights._reorder(weight)
    with torch.no_grad():
        assert not concat.exact(1) and not concat.exact(8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_concat_follows_its_layers_when_they_are_packed_again(dtype):
    """A sync copies new weights into the layers and packs them again (full fine-tuning):
    the concatenation packs itself again at its next call."""
    skip_unless_packed(dtype)
    layers = packed_layers(dtype)
    concat = weights.PackedConcat(layers)
    x = torch.randn(4, 1, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        before = concat(x)
        for layer in layers:
            layer.weight.mul_(-2.0)
            layer.pack()
        assert concat.stale
        after = concat(x)
        assert not concat.stale
        expected = torch.cat([layer(x) for layer in layers], -1)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, -2.0 * before, atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(
    not weights.packs_linears("cpu", torch.bfloat16),
    reason="oneDNN packs no bfloat16 linear on this CPU (needs avx512bw/vl/dq)",
)
def test_sampling_copy_packs_each_attention_layers_projections_as_one(tiny_model, tokenizer):
    """Every attention layer gets its q, k, v packed as one; for a LoRA projection, its
    base layer (the caller adds the unmerged update)."""
    from algorithms.lora import apply_lora

    model = TransformersPolicy(tiny_model, tokenizer, dtype="bfloat16").model
    for layer in model.model.layers:
        att = layer.self_attn
        assert att.packed_qkv.layers == (att.q_proj, att.k_proj, att.v_proj)
    assert "packed_qkv" not in dict(model.named_parameters())  # no parameters of its own
    peft_model = apply_lora(copy.deepcopy(tiny_model), 4, 8, 0.0, ["q_proj"], 0)
    lora = TransformersPolicy(peft_model, tokenizer, dtype="bfloat16").model
    for layer in lora.model.layers:
        att = layer.self_attn
        assert isinstance(att.q_proj, weights._LoRALinear) and not att.q_proj.folded
        assert att.packed_qkv.layers == (att.q_proj.base_layer, att.k_proj, att.v_proj)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize(
    ("rows", "out", "rank"), [(1, 48, 4), (3, 576, 16), (139, 192, 8), (4608, 1536, 16)]
)
def test_add_product_gives_the_values_of_adding_the_update_after(
    dtype, view, rows, out, rank, device
):
    """The update's product added into the output by the matmul itself (``addmm_``):
    bit for bit what computing the update and then adding it gives (``add_update``),
    from a decode step's row to a 32-row RAG prefill's MLP (4,608 x 1,536), also into a
    column slice. Fails if the BLAS summed the product onto the output instead."""
    generator = torch.Generator().manual_seed(rows)
    y = (torch.randn((1, rows, out + 16), generator=generator) * 3).to(device, dtype)
    h = torch.randn((1, rows, rank), generator=generator).to(device)
    b = (torch.randn((out, rank), generator=generator) * 1e-2).to(device)
    y = y[..., 8 : 8 + out] if view else y[..., :out].contiguous()
    before = y.clone()
    expected = weights.add_update(y.clone(), F.linear(h, b))
    got = weights.add_product(y, h, b)
    assert got is y and got.dtype == dtype
    assert torch.equal(got, expected)
    assert (got != before).float().mean() > 0.5  # the update is not rounded away


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("float_add_from", [1, weights.ADD_IN_FLOAT32])
def test_add_update_gives_the_values_of_an_in_place_add(dtype, view, float_add_from, monkeypatch):
    """A LoRA update (float32) added into a layer's output: bit for bit what
    ``y.add_(delta)`` gives, also into a column slice (the decode step's packed q, k, v),
    at rounding ties and with infinities and NaNs; by the float32 add (from 1 element)
    and by ``add_`` itself (this small a tensor, by default)."""
    monkeypatch.setattr(weights, "ADD_IN_FLOAT32", float_add_from)
    generator = torch.Generator().manual_seed(0)
    y = (torch.randn((4, 7, 48), generator=generator) * 3).to(dtype)
    delta = torch.randn((4, 7, 48), generator=generator) * 1e-2
    # exact ties of y's rounding (half the gap after 1), either sign; a tiny update
    tie = torch.finfo(dtype).eps / 2
    y[0, 0, 8:12] = torch.tensor([1.0, 1.0, -1.0, 3.0], dtype=dtype)
    delta[0, 0, 8:12] = torch.tensor([tie, 3 * tie, -tie, 1e-30])
    delta[0, 1, 8:11] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    if view:  # columns 8 to 39: not contiguous
        y, delta = y[..., 8:40], delta[..., 8:40]
    expected = y.clone().add_(delta)
    out = weights.add_update(y, delta)
    assert out is y and out.dtype == dtype
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan) and nan.sum() == 1
    assert torch.equal(out[~nan], expected[~nan])
