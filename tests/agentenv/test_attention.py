import pytest
import torch
import torch.nn.functional as F

from agentenv.attention import CPU_BF16_ATTENTION, grouped_attention, use_cpu_bf16_attention
from agentenv.models import tiny_model


def qkv(b=3, h=6, kv=2, q=5, length=9, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(b, h, q, d), make(b, kv, length, d), make(b, kv, length, d)


def reference(query, key, value, mask):
    """SDPA with every KV head repeated for its query group; out (b, q, h, d)."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask).transpose(1, 2)


def test_matches_sdpa_with_a_padding_mask_values_and_gradients():
    query, key, value = qkv()
    mask = torch.ones(3, 1, 5, 9, dtype=torch.bool).tril(4)  # (b, 1, q, L), causal
    mask[1, :, :, :3] = False  # row 1: a left gap of 3 masked slots
    out, _ = grouped_attention(torch.nn.Module(), query, key, value, mask)
    expected = reference(query, key, value, mask)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (query, key, value))
    expected_grads = torch.autograd.grad(expected.square().sum(), (query, key, value))
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_no_mask_means_causal_and_one_query_sees_every_key():
    query, key, value = qkv(q=9)  # a prefill without padding: transformers passes no mask
    out, _ = grouped_attention(torch.nn.Module(), query, key, value, None)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(out, reference(query, key, value, causal), atol=1e-6, rtol=1e-5)
    query, key, value = qkv(q=1)  # a decode step
    out, _ = grouped_attention(torch.nn.Module(), query, key, value, None)
    torch.testing.assert_close(out, reference(query, key, value, None), atol=1e-6, rtol=1e-5)


def test_bf16_stays_within_bf16_rounding_of_float32():
    query, key, value = qkv(dtype=torch.bfloat16)
    mask = torch.ones(3, 1, 5, 9, dtype=torch.bool).tril(4)
    out, _ = grouped_attention(torch.nn.Module(), query, key, value, mask)
    exact = reference(query.float(), key.float(), value.float(), mask)
    assert out.dtype == torch.bfloat16
    assert (out.float() - exact).abs().max() < 0.03  # bf16 keeps 8 bits: 2^-8 of |out| <= ~3


@pytest.mark.parametrize(("dtype", "expected"), [(torch.bfloat16, True), (torch.float32, False)])
def test_a_cpu_model_switches_only_for_a_bf16_compute_dtype(tokenizer, dtype, expected):
    model = tiny_model(tokenizer)
    assert use_cpu_bf16_attention(model, dtype) is expected
    assert (model.config._attn_implementation == CPU_BF16_ATTENTION) is expected
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=expected):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    model.config._attn_implementation = "sdpa"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=expected):
        sdpa = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert (logits.float() - sdpa.float()).abs().max() < 0.1
