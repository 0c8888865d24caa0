import math

import pytest
import torch
import torch.nn.functional as F
from devices import DEVICES, on
from draws import assert_same_draws

from agentenv.lm.attention import (
    CACHE_ATTENTION,
    CPU_BF16_ATTENTION,
    AppendCacheLayer,
    grouped_attention,
    sdpa_over_buffers,
    use_cpu_bf16_attention,
)
from agentenv.lm.models import tiny_model


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


def _fused_calls(monkeypatch) -> list[tuple[int, ...]]:
    """Record the query shapes grouped_attention hands to the fused kernel."""
    from transformers.integrations import sdpa_attention

    calls, fused = [], sdpa_attention.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return fused(module, query, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy)
    return calls


@pytest.mark.parametrize("masked", [True, False])
def test_without_grad_a_large_batch_runs_in_row_chunks_each_row_as_alone(monkeypatch, masked):
    from agentenv.lm import attention

    b, h, kv, q, length = 5, 6, 2, 5, 9
    monkeypatch.setattr(attention, "SCORES", 2 * h * q * length)  # chunks of 2 rows
    calls = _fused_calls(monkeypatch)
    query, key, value = (t.detach() for t in qkv(b, h, kv, q, length, dtype=torch.bfloat16))
    mask = torch.ones(b, 1, q, length, dtype=torch.bool).tril(length - q)
    for i in range(b):
        mask[i, :, :, :i] = False  # a left gap of i slots
    mask = mask if masked else None  # None: causal, one mask for every row
    with torch.no_grad():
        out, _ = grouped_attention(torch.nn.Module(), query, key, value, mask)
        alone = [
            grouped_attention(
                torch.nn.Module(),
                query[i : i + 1],
                key[i : i + 1],
                value[i : i + 1],
                mask if mask is None else mask[i : i + 1],
            )[0]
            for i in range(b)
        ]
    assert calls == [] and out.shape == (b, q, h, 8)
    for i in range(b):
        assert torch.equal(out[i : i + 1], alone[i])  # bitwise: its batch does not matter
    causal = torch.ones(q, length, dtype=torch.bool).tril(length - q)
    exact = reference(query.float(), key.float(), value.float(), causal if mask is None else mask)
    assert (out.float() - exact).abs().max() < 0.03


def test_a_row_over_the_limit_and_a_large_batch_with_grad_go_to_the_fused_kernel(monkeypatch):
    from agentenv.lm import attention

    b, h, kv, q, length = 3, 6, 2, 5, 9
    calls = _fused_calls(monkeypatch)
    module = torch.nn.Module()
    module.num_key_value_groups = h // kv  # the fused path repeats KV heads by it
    query, key, value = qkv(b, h, kv, q, length)
    mask = torch.ones(b, 1, q, length, dtype=torch.bool).tril(length - q)
    monkeypatch.setattr(attention, "SCORES", h * q * length - 1)  # one row is too many
    with torch.no_grad():
        grouped_attention(module, query, key, value, mask)
    monkeypatch.setattr(attention, "SCORES", h * q * length)  # a row fits: chunks of one
    with torch.no_grad():
        grouped_attention(module, query, key, value, mask)
    assert calls == [(b, h, q, 8)]
    monkeypatch.setattr(attention, "GRAD_SCORES", b * h * q * length - 1)  # the batch's, kept
    out, _ = grouped_attention(module, query, key, value, mask)
    assert calls == [(b, h, q, 8)] * 2 and out.requires_grad
    torch.testing.assert_close(out, reference(query, key, value, mask), atol=1e-6, rtol=1e-5)


def test_sdpa_over_buffers_decodes_each_kv_heads_group_without_copying_the_cache(monkeypatch):
    """A decode step (one query per row) over buffers with 3 spare slots: the values of
    SDPA over repeated KV heads, whatever this transformers does for grouped heads
    (< 5.24 repeated the whole cache every step); a prefill (5 queries) as well."""
    import transformers.integrations.sdpa_attention as sdpa

    module = torch.nn.Module()
    module.num_key_value_groups = 3
    query, key, value = (t.detach() for t in qkv(q=1, length=12))  # 9 slots + 3 spare
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., :4] = False  # row 1: a left gap
    full = F.pad(mask, (0, 3))  # the spare slots, masked
    monkeypatch.setattr(sdpa, "repeat_kv", lambda *a: pytest.fail("repeated the KV cache"))
    out, _ = sdpa_over_buffers(module, query, key, value, mask)
    assert out.shape == (3, 1, 6, 8)
    torch.testing.assert_close(out, reference(query, key, value, full), atol=1e-6, rtol=1e-5)
    query, key, value = (t.detach() for t in qkv(q=5, length=12))
    mask = torch.ones(3, 1, 5, 9, dtype=torch.bool).tril(4)
    out, _ = sdpa_over_buffers(module, query, key, value, mask)
    expected = reference(query, key, value, F.pad(mask, (0, 3)))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_over_buffers_prefills_grouped_heads_bitwise_as_transformers_does(monkeypatch, dtype):
    """Several queries per row (a prefill after a cached part, drafted tokens verified)
    on a CPU: the kernel reads each KV head for its query group (``enable_gqa``), where
    transformers' call copies the KV heads once per query head first: bitwise its
    outputs, without the copies."""
    import transformers.integrations.sdpa_attention as sdpa

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    query, key, value = (t.detach() for t in qkv(b=4, h=9, kv=3, q=7, length=40, d=16, dtype=dtype))
    mask = torch.ones(4, 1, 7, 36, dtype=torch.bool).tril(29)  # 36 slots + 4 spare
    mask[1, ..., 3:20] = False  # row 1: a gap after its cached part
    mask[2, ..., :29] = False  # row 2: nothing cached, left-padded: a query sees no key
    mask[2, ..., 0, :] = False
    expected, _ = sdpa.sdpa_attention_forward(module, query, key, value, F.pad(mask, (0, 4)))
    monkeypatch.setattr(sdpa, "repeat_kv", lambda *a: pytest.fail("repeated the KV cache"))
    out, _ = sdpa_over_buffers(module, query, key, value, mask)
    assert out.shape == (4, 7, 9, 16) and out.dtype == dtype
    assert torch.equal(out, expected)
    assert not out.isnan().any()


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 1e-2), ("float32", 1e-5)])
def test_append_cache_decodes_what_a_dynamic_cache_does(
    tiny_model, tokenizer, monkeypatch, dtype, tolerance, device
):
    """Sampling with in-place KV appends (small spare room: several regrowths, rows
    dropped, a continued turn) gives the tokens and log-probs of transformers' cache:
    on a CPU grouped attention in bf16, SDPA over the buffers in float32; SDPA over the
    buffers on a GPU."""
    tiny_model = on(tiny_model, device)
    import agentenv.lm.attention as attention
    from agentenv.lm import sampler
    from agentenv.lm.backend import SamplingConfig
    from agentenv.lm.sampler import TransformersPolicy

    monkeypatch.setattr(attention.AppendCacheLayer, "SPARE", 3)
    prompts = [tokenizer.encode(t) for t in ("What is 2 + 2?", "Name a colour.", "Hi")]
    sampling = SamplingConfig(12, temperature=1.0, stop_strings=[])

    def run(use_append: bool):
        """Both turns' prompts and generations."""
        if not use_append:
            monkeypatch.setattr(sampler, "append_cache", lambda model: None)
        policy = TransformersPolicy(tiny_model, tokenizer, dtype=dtype)
        first = policy.generate(prompts, sampling, seeds=[1, 2, 3])
        stop = first[0].token_ids[4]  # ends row 0 early the second time: a row is dropped
        policy.stop_token_ids = [stop]
        nxt = [p + g.token_ids + [5, 6] for p, g in zip(prompts, first, strict=True)]
        return prompts + nxt, first + policy.generate(nxt, sampling, seeds=[4, 5, 6])

    (asked, appended), (asked_dynamic, dynamic) = run(True), run(False)
    # the second turn compared where the first agreed (all unless a draw parted at a tie)
    rows = [i for i in range(6) if asked[i] == asked_dynamic[i]]
    if asked[3] != asked_dynamic[3]:  # row 0 set the second turn's stop token
        rows = rows[:3]
    assert rows[:3] == [0, 1, 2]
    assert_same_draws(
        [appended[i] for i in rows],
        [dynamic[i] for i in rows],
        model=tiny_model,
        prompts=[asked[i] for i in rows],
        sampling=sampling,
        seeds=[[1, 2, 3, 4, 5, 6][i] for i in rows],
        atol=tolerance,
        dtype=dtype,
    )


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.bfloat16, CPU_BF16_ATTENTION), (torch.float32, CACHE_ATTENTION)],
)
def test_the_sampler_decodes_over_in_place_caches_in_both_cpu_dtypes(tokenizer, dtype, expected):
    from agentenv.lm.attention import append_cache, sampler_attention

    model = tiny_model(tokenizer)
    assert sampler_attention(model, dtype) == expected
    model.config._attn_implementation = expected
    assert all(type(layer) is AppendCacheLayer for layer in append_cache(model).layers)
    model.config._attn_implementation = "eager"  # a model that asked for its own attention
    assert sampler_attention(model, dtype) is None and append_cache(model) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_off_the_cpu_the_sampler_decodes_sdpa_over_in_place_caches_in_every_dtype(tokenizer, dtype):
    from agentenv.lm.attention import sampler_attention

    model = tiny_model(tokenizer).to("meta")  # shapes only: stands in for a GPU's model
    assert sampler_attention(model, dtype) == CACHE_ATTENTION


def test_append_cache_layer_grows_in_place_and_reports_valid_slots():
    layer = AppendCacheLayer()
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    keys, values = layer.update(k, -k)
    assert keys.shape[-2] == 3 and layer.get_seq_length() == 3  # a prefill: no spare room
    keys, _ = layer.update(k[:, :, :1] + 100, -k[:, :, :1])
    assert keys.shape[-2] == 4 + AppendCacheLayer.SPARE and layer.get_seq_length() == 4
    assert torch.equal(layer.keys[:, :, :3], k) and (keys[:, :, 4:] == 0).all()
    buffer = keys.data_ptr()
    keys, _ = layer.update(k[:, :, :1], k[:, :, :1])
    assert keys.data_ptr() == buffer and layer.keys.shape[-2] == 5  # written in place
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape == (1, 1, 5, 2) and torch.equal(layer.keys[0, :, :3], k[1])


def test_append_cache_layer_appends_copies_of_rows_into_kept_room():
    layer = AppendCacheLayer()
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    layer.update(k, -k)
    layer.update(k[:, :, :1] + 100, -k[:, :, :1])  # a decode step: spare slots after 4
    before = layer._k.clone()
    layer.batch_append(torch.tensor([1]), capacity=4)
    assert layer.keys.shape == (3, 1, 4, 2) and layer._k.is_contiguous()
    assert torch.equal(layer._k[:2], before) and torch.equal(layer._k[2], before[1])
    assert torch.equal(layer._v[2], layer._v[1])
    buffer = layer._k.data_ptr()
    layer.batch_append(torch.tensor([0]), capacity=4)  # into the room kept: no new buffer
    assert layer._k.data_ptr() == buffer and torch.equal(layer._k[3], before[0])
    new = torch.full((4, 1, 1, 2), 7.0)
    keys, _ = layer.update(new, new)  # the next step writes every row, copies included
    assert keys.shape[0] == 4 and layer.get_seq_length() == 5
    assert (layer.keys[:, :, 4] == 7).all() and torch.equal(layer.keys[3, :, :4], before[0, :, :4])
    layer.batch_append(torch.tensor([3, 3]), capacity=4)  # past the room: a larger buffer
    assert layer.keys.shape[0] == 6 and torch.equal(layer.keys[5], layer.keys[0])


def test_rows_of_different_lengths_without_a_shared_prefix_have_no_nans(tiny_model, tokenizer):
    """Left-padding queries see no key at all; they must not turn the cache into NaNs."""
    from agentenv.lm.backend import SamplingConfig
    from agentenv.lm.sampler import TransformersPolicy

    prompts = [tokenizer.encode(t) for t in ("What is 2 + 2?", "Name a colour.", "Hi")]
    sampling = SamplingConfig(6, temperature=1.0, stop_strings=[])
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="bfloat16", share_prefix=False)
    batch = policy.generate(prompts, sampling, seeds=[1, 2, 3])
    alone = [policy.generate([p], sampling, seeds=[i + 1])[0] for i, p in enumerate(prompts)]
    for a in batch:
        assert not any(math.isnan(x) for x in a.sampler_logprobs)
    same = {"prompts": prompts, "sampling": sampling, "seeds": [1, 2, 3], "dtype": "bfloat16"}
    assert_same_draws(batch, alone, model=tiny_model, atol=0.05, **same)


def test_cached_forward_continues_a_prefix_and_uses_the_current_argument_name(tiny_model):
    import warnings

    from peft import LoraConfig, get_peft_model

    from agentenv.lm.attention import cached_forward

    ids = torch.tensor([[5, 17, 300, 42, 9, 77, 1000]])
    full = tiny_model(input_ids=ids).logits
    model = get_peft_model(tiny_model, LoraConfig(r=2, target_modules=["q_proj"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated argument name would raise here
        _, cache = cached_forward(model, None, input_ids=ids[:, :4])
        logits, cache = cached_forward(
            model, cache, input_ids=ids[:, 4:], position_ids=torch.arange(4, 7)[None]
        )
    assert cache.get_seq_length() == 7
    torch.testing.assert_close(logits, full[:, 4:], atol=1e-5, rtol=1e-4)
