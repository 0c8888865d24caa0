"""The sampler's decode step: the direct Llama path computes the model's own logits."""

import copy

import pytest
import torch
from devices import DEVICES, on

from agentenv.lm import decode_step, weights
from agentenv.lm.attention import cached_forward
from agentenv.lm.backend import SamplingConfig
from agentenv.lm.decode_step import decode_logits
from agentenv.lm.sampler import TransformersPolicy

TEXTS = ["What is 2 + 2?", "Name a colour.", "Spell the word 'calculator' backwards, please."]


def rows(tokenizer):
    """Three prompts of different lengths (the batch gets masked gaps)."""
    return [tokenizer.encode(t) for t in TEXTS]


def lora_copy(model):
    """A copy of ``model`` with a LoRA adapter whose update is not zero."""
    from algorithms.lora import apply_lora

    peft_model = apply_lora(copy.deepcopy(model), 4, 8, 0.0, ["q_proj", "v_proj", "up_proj"], 0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                g = torch.Generator().manual_seed(len(name))  # on the CPU: any device's model
                param.copy_(torch.empty(param.shape).normal_(0, 0.5, generator=g))
    return peft_model


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
def test_direct_step_gives_the_forwards_logits_bitwise(
    sharp_model, tokenizer, device, dtype, lora, packed, monkeypatch
):
    """Step after step, with rows leaving the batch, the direct path's logits and KV cache
    equal those of the model's forward bit for bit (CPU bf16: grouped attention; float32
    and a GPU: SDPA over the in-place cache; LoRA: the sampler's unmerged or folded adapter;
    q, k, v from one packed matrix where it is exact, or from each projection)."""
    model = on(sharp_model, device)
    policy = TransformersPolicy(lora_copy(model) if lora else model, tokenizer, dtype=dtype)
    model = policy.model
    calls = []
    forward = weights.PackedConcat.forward
    monkeypatch.setattr(
        weights.PackedConcat, "forward", lambda self, x: calls.append(1) or forward(self, x)
    )
    if not packed:
        monkeypatch.setattr(weights.PackedConcat, "exact", lambda self, rows: False)
    dev = policy.device
    with policy.decoding():
        cache, mask, logits, pos, *_ = policy.prefill(rows(tokenizer))  # mask, pos on the CPU
        ref_cache = copy.deepcopy(cache)
        assert mask.shape[0] == 3 and not mask.all()  # gaps before the shorter prompts
        fused = getattr(model.model.layers[0].self_attn, "packed_qkv", None)
        used = packed and fused is not None and fused.exact(3) and fused.exact(2)
        calls.clear()  # (the exactness checks' own calls)
        for step in range(6):
            if step == 3:  # the middle row leaves: both caches drop it
                keep = torch.tensor([0, 2])
                cache.batch_select_indices(keep.to(dev))
                ref_cache.batch_select_indices(keep.to(dev))
                mask, pos, logits = mask[keep], pos[keep], logits[keep.to(dev)]
            token = logits.float().argmax(-1)[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            m, p = mask.to(dev), pos[:, None].to(dev)
            assert decode_step._direct(model, cache, token, m)
            logits, cache = decode_logits(model, cache, token, m, p)
            ref, ref_cache = cached_forward(
                model, ref_cache, input_ids=token, attention_mask=m, position_ids=p
            )
            pos = pos + 1
            assert logits.shape == (len(mask), 1, model.config.vocab_size)
            assert torch.equal(logits, ref)
            logits = logits[:, -1]
    for layer, ref_layer in zip(cache.layers, ref_cache.layers, strict=True):
        assert torch.equal(layer.keys, ref_layer.keys) and torch.equal(
            layer.values, ref_layer.values
        )
    assert (fused is not None) == weights.packs_linears(device, model.dtype)
    assert len(calls) == (6 * len(model.model.layers) if used else 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
def test_direct_step_of_several_tokens_gives_the_forwards_logits_bitwise(
    sharp_model, tokenizer, device, dtype
):
    """Several tokens per row (a token and drafted ones to verify), causal among them,
    after masked gaps and a masked slot among an earlier step's tokens (a rejected
    draft): the direct path's logits ``(b, q, V)`` and cache are the forward's, bitwise."""
    policy = TransformersPolicy(on(sharp_model, device), tokenizer, dtype=dtype)
    model, dev = policy.model, policy.device
    with policy.decoding():
        cache, mask, logits, pos, *_ = policy.prefill(rows(tokenizer))
        ref_cache = copy.deepcopy(cache)
        for q in (3, 4):
            token = torch.randint(0, 100, (3, q), generator=torch.Generator().manual_seed(q))
            mask = torch.cat([mask, torch.ones((3, q), dtype=torch.long)], dim=1)
            p = pos[:, None] + torch.arange(q)
            m, p, token = mask.to(dev), p.to(dev), token.to(dev)
            assert decode_step._direct(model, cache, token, m)
            logits, cache = decode_logits(model, cache, token, m, p)
            ref, ref_cache = cached_forward(
                model, ref_cache, input_ids=token, attention_mask=m, position_ids=p
            )
            assert logits.shape == (3, q, model.config.vocab_size)
            assert torch.equal(logits, ref)
            mask[1, -1] = 0  # row 1's last token is dropped: later steps must not see it
            pos = pos + q - torch.tensor([0, 1, 0])
    for layer, ref_layer in zip(cache.layers, ref_cache.layers, strict=True):
        assert torch.equal(layer.keys, ref_layer.keys)


@pytest.mark.parametrize("hooked", ["q_proj", "q_proj.base_layer"])
def test_a_hooked_projection_is_called_not_packed(sharp_model, tokenizer, hooked):
    """A hook on the query projection (a LoRA layer, or its base layer): the direct path
    computes q, k, v one projection at a time (the hook fires every step) and still gives
    the forward's logits."""
    policy = TransformersPolicy(lora_copy(sharp_model), tokenizer, dtype="bfloat16")
    calls = []
    module = policy.model.model.layers[0].self_attn.get_submodule(hooked)
    handle = module.register_forward_hook(lambda *args: calls.append(1))
    try:
        with policy.decoding():
            cache, mask, logits, pos, *_ = policy.prefill(rows(tokenizer))
            ref_cache = copy.deepcopy(cache)
            calls.clear()
            for _ in range(3):
                token = logits.float().argmax(-1)[:, None]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                assert decode_step._direct(policy.model, cache, token, mask)
                logits, cache = decode_logits(policy.model, cache, token, mask, pos[:, None])
                ref, ref_cache = cached_forward(
                    policy.model,
                    ref_cache,
                    input_ids=token,
                    attention_mask=mask,
                    position_ids=pos[:, None],
                )
                pos = pos + 1
                assert torch.equal(logits, ref)
                logits = logits[:, -1]
    finally:
        handle.remove()
    assert len(calls) == 6  # three steps, ours and the reference's


def test_a_hooked_model_runs_its_own_forward(sharp_model, tokenizer):
    """A hook on a layer the direct path would skip: the step runs the model's forward
    (the hook fires once per step) and gives the same logits."""
    policy = TransformersPolicy(sharp_model, tokenizer, dtype="float32")
    calls = []
    layer = policy.model.model.layers[1]
    handle = layer.register_forward_hook(lambda *args: calls.append(1))
    try:
        with policy.decoding():
            cache, mask, logits, pos, *_ = policy.prefill(rows(tokenizer))
            calls.clear()
            token = logits.argmax(-1)[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            assert not decode_step._direct(policy.model, cache, token, mask)
            ref, _ = cached_forward(
                policy.model,
                copy.deepcopy(cache),
                input_ids=token,
                attention_mask=mask,
                position_ids=pos[:, None],
            )
            got, _ = decode_logits(policy.model, cache, token, mask, pos[:, None])
            handle.remove()
            # unhooked, the next step takes the direct path
            assert decode_step._direct(
                policy.model, cache, token, torch.cat([mask, mask[:, :1]], 1)
            )
    finally:
        handle.remove()
    assert torch.equal(got, ref) and len(calls) == 2  # the reference's call and ours


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
def test_continuous_batching_samples_the_same_with_and_without_the_direct_path(
    sharp_model, tokenizer, device, dtype, monkeypatch
):
    """Rows joining, ending and continuing a running batch: the same tokens and log-probs
    whether decode steps take the direct path or the model's forward."""
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0, stop_strings=[])
    model = on(sharp_model, device)

    def run():
        policy = TransformersPolicy(model, tokenizer, dtype=dtype)
        decoder = policy.decoder(sampling)
        ps = rows(tokenizer)
        decoder.add(0, ps[0], seed=1, max_new_tokens=10)
        got = {}
        for step in range(40):
            if step == 1:
                decoder.add(1, ps[1], seed=2, max_new_tokens=4)
            if step == 3:
                decoder.add(2, ps[2], seed=3, max_new_tokens=7)
            if step == 8:  # row 1's next turn continues its saved cache
                decoder.add(3, [*ps[1], *got[1].token_ids, *ps[0]], seed=4, max_new_tokens=5)
            got.update(decoder.step())
            if len(got) == 4:
                break
        return {k: (g.token_ids, g.sampler_logprobs) for k, g in got.items()}

    direct = run()
    monkeypatch.setattr(decode_step, "_direct", lambda *args: False)
    assert run() == direct and sorted(direct) == [0, 1, 2, 3]
    assert [len(direct[k][0]) for k in range(4)] == [10, 4, 7, 5]
