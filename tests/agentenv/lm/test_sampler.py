"""The generation backend: exact log-probs, shared prefixes, stop strings, weight sync.

Where two decoding paths are compared (batched against alone, shared slots against one a
row, a saved cache against a fresh prefill), their rows may part at a draw that float
rounding flips: ``assert_same_draws`` (tests/helpers/draws.py) allows exactly that."""

import dataclasses

import pytest
import torch
from devices import DEVICES, on
from draws import assert_same_draws

from agentenv.errors import InvalidOptionError
from agentenv.lm import precision, weights
from agentenv.lm.backend import SamplingConfig
from agentenv.lm.precision import resolve_dtype
from agentenv.lm.sampler import TransformersPolicy
from algorithms.logprobs import token_logprobs

# float32 sampler vs the trainer's forward, mean |log-prob difference|: the sampler's
# packed oneDNN kernels sum in another order than the trainer's MKL ones. Measured 8e-5
# on the tiny random model (9e-6 on SmolLM2-135M); the bound for float32 is 1e-3.
FP32_GAP = 5e-4
GREEDY = SamplingConfig(max_new_tokens=10, temperature=0.0, stop_strings=[])


def prompts(tokenizer):
    """Three prompts with a common 2-message prefix and suffixes of different lengths."""
    system = {"role": "system", "content": "You are a careful assistant. " * 4}
    users = ["What is 2 + 2?", "Name a colour.", "Spell the word 'calculator' backwards please."]
    return [
        tokenizer.apply_chat_template(
            [system, {"role": "user", "content": u}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for u in users
    ]


def recompute(model, prompt, gen, temperature=1.0):
    """log p(token) of a generation's tokens under a plain forward pass of ``model``."""
    ids = torch.tensor([list(prompt) + gen.token_ids])
    with torch.no_grad():
        logp = token_logprobs(model, ids, torch.ones_like(ids), temperature)
    return logp[0, len(prompt) :]


def test_resolve_dtype(monkeypatch):
    monkeypatch.setattr(precision, "cpu_prefers_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_prefers_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(InvalidOptionError, match="float16.*needs a GPU.*bfloat16"):
        resolve_dtype("float16", "cpu")
    with pytest.raises(InvalidOptionError, match="'fp8'"):
        resolve_dtype("fp8")


@pytest.mark.parametrize(("bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_a_gpu_is_bfloat16_or_float32_never_float16(monkeypatch, bf16, expected):
    """A GPU without bf16 (T4, V100) computes in float32 under ``auto``: float16 would
    train without the loss scaling its small gradients need."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_dtype("auto", "cuda") == expected
    assert resolve_dtype("float16", "cuda") == torch.float16  # by name, it is what was asked


def test_sampling_config_validation():
    with pytest.raises(InvalidOptionError, match="top_k"):
        SamplingConfig(top_k=-1)
    with pytest.raises(InvalidOptionError, match="stop_strings"):
        SamplingConfig(stop_strings=[""])


def test_fp32_logprobs_match_a_forward_pass(tiny_model, tokenizer):
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    shared = {p.data_ptr() for p in tiny_model.parameters()}  # plain and already float32:
    assert {p.data_ptr() for p in policy.model.parameters()} == shared  # no weight is copied
    torch.manual_seed(0)
    ps = prompts(tokenizer)
    gens = policy.generate(ps, SamplingConfig(12, temperature=1.0, stop_strings=[]))
    for p, g in zip(ps, gens, strict=True):
        assert len(g.token_ids) == len(g.sampler_logprobs) >= 1
        expected = recompute(tiny_model, p, g)
        assert (expected - torch.tensor(g.sampler_logprobs)).abs().mean() < FP32_GAP


def test_lm_head_gets_contiguous_rows_and_the_model_is_left_unhooked(tiny_model, tokenizer):
    seen = []
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    head = policy.model.get_output_embeddings()  # the sampling copy's head (packed on a CPU)
    probe = head.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        policy.generate(prompts(tokenizer), SamplingConfig(3, temperature=0.0, stop_strings=[]))
    finally:
        probe.remove()
    assert seen and all(x.is_contiguous() for x in seen)  # the prefill's last rows too
    assert any(x.shape[:2] == (3, 1) for x in seen)  # (rows, logits_to_keep=1)
    assert not head._forward_pre_hooks  # our hook lives only inside generate()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_prefix_and_batching_do_not_change_results(tiny_model, tokenizer, dtype):
    ps = prompts(tokenizer)
    shared = TransformersPolicy(tiny_model, tokenizer, dtype=dtype).generate(ps, GREEDY)
    alone = [
        TransformersPolicy(tiny_model, tokenizer, dtype=dtype, share_prefix=False).generate(
            [p], GREEDY
        )[0]
        for p in ps
    ]
    tol = 1e-5 if dtype == "float32" else 0.05  # bf16: other batch shapes, other rounding
    assert_same_draws(
        shared, alone, model=tiny_model, prompts=ps, sampling=GREEDY, atol=tol, dtype=dtype
    )


def test_seeded_rows_sample_the_same_alone_or_in_any_batch(tiny_model, tokenizer):
    ps = prompts(tokenizer)
    sampling = SamplingConfig(10, temperature=1.0, stop_strings=[])
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    batch = policy.generate(ps, sampling, seeds=[11, 12, 13])
    torch.manual_seed(123)  # the global RNG plays no part
    alone = [policy.generate([p], sampling, seeds=[11 + i])[0] for i, p in enumerate(ps)]
    swapped = policy.generate(ps[::-1], sampling, seeds=[13, 12, 11])[::-1]
    for other in (alone, swapped):
        assert_same_draws(
            other, batch, model=tiny_model, prompts=ps, sampling=sampling, seeds=[11, 12, 13]
        )
    other = policy.generate(ps, sampling, seeds=[21, 22, 23])
    assert [g.token_ids for g in other] != [g.token_ids for g in batch]  # the seed matters
    with pytest.raises(InvalidOptionError, match="one seed per prompt"):
        policy.generate(ps, sampling, seeds=[1])


def test_stop_string_cuts_the_turn_without_changing_earlier_tokens(tiny_model, tokenizer):
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    p = prompts(tokenizer)[:1]
    full = policy.generate(p, GREEDY)[0]
    assert len(full.token_ids) == 10 and full.finish_reason == "length"
    stop = tokenizer.decode(full.token_ids[3:5])  # text that appears after token 5 at the latest
    cut = policy.generate(p, SamplingConfig(10, temperature=0.0, stop_strings=[stop]))[0]
    k = len(cut.token_ids)
    assert cut.finish_reason == "stop_string" and k <= 5
    assert cut.token_ids == full.token_ids[:k]  # exactly the sampled tokens, nothing after
    assert cut.sampler_logprobs == pytest.approx(full.sampler_logprobs[:k], abs=1e-6)
    assert stop in tokenizer.decode(cut.token_ids)
    assert stop not in tokenizer.decode(cut.token_ids[:-1])  # cut at the first completion


def test_stop_string_check_skips_no_token_that_completes_one(tiny_model, tokenizer):
    """Tokens whose text lacks every stop string's last character are not checked; the cut
    must still land where decoding the whole turn after every token first finds a stop."""
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    p = prompts(tokenizer)[:1]
    torch.manual_seed(0)  # sampled (random-vocabulary text), replayed with the same seed
    full = policy.generate(p, SamplingConfig(24, stop_strings=[]))[0]
    texts = [tokenizer.decode(full.token_ids[: k + 1]) for k in range(24)]
    checked = 0
    for k in range(1, 24):
        stop = texts[k][-3:]
        if not stop or not stop[-1].isascii() or stop[-1].isspace():
            continue  # those are always checked; the skip rule is for ASCII endings
        first = next(j for j in range(24) if stop in texts[j])  # brute force
        torch.manual_seed(0)
        cut = policy.generate(p, SamplingConfig(24, stop_strings=[stop]))[0]
        assert len(cut.token_ids) == first + 1 and cut.finish_reason == "stop_string"
        checked += 1
    assert checked >= 5


def test_finished_rows_leave_the_batch_without_changing_the_others(tiny_model, tokenizer):
    ps = prompts(tokenizer)
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    full = policy.generate(ps, GREEDY)
    stop = tokenizer.decode(full[1].token_ids[1:3])  # row 1 stops after <= 3 tokens
    both = policy.generate(ps, SamplingConfig(10, temperature=0.0, stop_strings=[stop]))
    assert both[1].finish_reason == "stop_string" and len(both[1].token_ids) <= 3
    going = [i for i in (0, 2) if both[i].finish_reason == "length"]  # (rows 0 and 2 ran
    # on beside row 1 until it stopped: the same tokens as in the first batch)
    assert_same_draws(
        [both[i] for i in going],
        [full[i] for i in going],
        model=tiny_model,
        prompts=[ps[i] for i in going],
        sampling=GREEDY,
    )


def test_stop_token_is_kept_and_ends_the_turn(tiny_model, tokenizer):
    ps = prompts(tokenizer)
    # one row each time: the same shapes, so the same tokens up to the stop token
    first = TransformersPolicy(tiny_model, tokenizer, dtype="float32").generate(ps[:1], GREEDY)
    token = first[0].token_ids[2]
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32", stop_token_ids=[token])
    gen = policy.generate(ps[:1], GREEDY)[0]
    assert gen.finish_reason == "stop" and gen.token_ids[-1] == token
    assert gen.token_ids == first[0].token_ids[: len(gen.token_ids)]


def test_lora_copy_shares_the_base_and_resyncs_after_a_step(tiny_model, tokenizer):
    from algorithms.lora import apply_lora

    peft_model = apply_lora(tiny_model, 4, 8, 0.0, ["q_proj", "v_proj", "up_proj"], seed=0)
    policy = TransformersPolicy(peft_model, tokenizer, dtype="float32")
    layer = policy.model.model.layers[0].self_attn.q_proj
    trained = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(layer, weights._LoRALinear) and not hasattr(policy.model, "get_base_model")
    assert layer.folded is weights.packs_linears("cpu", torch.float32)
    assert layer.base_layer.weight is trained.base_layer.weight  # frozen base: shared, no copy
    scaling = trained.scaling["default"]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1.0)
    ps = prompts(tokenizer)
    ids = torch.tensor([ps[0]])
    for _ in range(2):  # LoRA B starts at 0: after one step the adapter matters
        token_logprobs(peft_model, ids, torch.ones_like(ids)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.manual_seed(1)
        gens = policy.generate(ps, SamplingConfig(8, temperature=1.0, stop_strings=[]))
        for p, g in zip(ps, gens, strict=True):
            diff = (recompute(peft_model, p, g) - torch.tensor(g.sampler_logprobs)).abs()
            assert diff.mean() < 1e-3  # the bound for float32
    assert torch.equal(layer.b, trained.lora_B["default"].weight * scaling)  # the synced update
    assert torch.equal(layer.a, trained.lora_A["default"].weight) and layer.b.abs().sum() > 0


def test_a_float32_lora_update_is_folded_into_the_packed_weights_only(tiny_model, tokenizer):
    """float32 on a CPU: the sampler's LoRA layer runs ``W + B A`` from its packed copy (no
    low-rank matmuls per step); the shared base ``W`` never changes, a repack keeps the
    update, and a sync folds the new one."""
    from algorithms.lora import apply_lora

    if not weights.packs_linears("cpu", torch.float32):
        pytest.skip("this torch has no oneDNN packed linear layers")
    peft_model = apply_lora(tiny_model, 4, 8, 0.0, ["q_proj"], seed=0)
    trained = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        trained.lora_B["default"].weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    base = trained.base_layer.weight.clone()
    policy = TransformersPolicy(peft_model, tokenizer, dtype="float32")
    q = policy.model.model.layers[0].self_attn.q_proj
    assert q.folded and q.base_layer.weight is trained.base_layer.weight
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        learned = trained(x)
        assert (learned - trained.base_layer(x)).abs().max() > 1e-2  # the update matters
        torch.testing.assert_close(q(x), learned, atol=1e-5, rtol=0)
        assert torch.equal(trained.base_layer.weight, base)  # folded into the packed copy only
        q.base_layer.pack()  # what a full fine-tuning sync does: the update stays folded
        torch.testing.assert_close(q(x), learned, atol=1e-5, rtol=0)
        trained.lora_B["default"].weight.mul_(-2)
        policy.sync()
        torch.testing.assert_close(q(x), trained(x), atol=1e-5, rtol=0)


def test_a_lora_layer_over_a_conv1d_stays_unmerged_in_float32(tokenizer):
    """GPT-2's projections are ``Conv1D`` s, not linear layers: nothing packs them, so
    their LoRA updates stay unmerged (and sample as the trained model computes)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from algorithms.lora import apply_lora

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)
    peft_model = apply_lora(GPT2LMHeadModel(config).eval(), 4, 8, 0.0, ["c_attn"], seed=0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # an update that matters
    policy = TransformersPolicy(peft_model, tokenizer, dtype="float32")
    layer = policy.model.transformer.h[0].attn.c_attn
    assert isinstance(layer, weights._LoRALinear) and not layer.folded
    ps = prompts(tokenizer)[:1]
    gen = policy.generate(ps, SamplingConfig(4, temperature=1.0, stop_strings=[]), seeds=[0])[0]
    diff = (recompute(peft_model, ps[0], gen) - torch.tensor(gen.sampler_logprobs)).abs()
    assert len(gen.token_ids) == 4 and diff.max() < 1e-3


def _bf16_lora(tiny_model, b_scale):
    from algorithms.lora import apply_lora

    peft_model = apply_lora(tiny_model.bfloat16(), 4, 8, 0.0, ["q_proj", "v_proj", "up_proj"], 0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * b_scale)
    return peft_model


def test_bf16_lora_sampler_logprobs_match_the_learners_autocast(tiny_model, tokenizer):
    """A LoRA run: bf16 base, float32 adapter trained under bf16 autocast. The sampler's
    log-probs agree with the learner's recomputation, and the adapter is not ignored."""
    peft_model = _bf16_lora(tiny_model, 4e-3)
    policy = TransformersPolicy(peft_model, tokenizer, dtype="bfloat16")
    torch.manual_seed(0)
    ps = prompts(tokenizer)
    gens = policy.generate(ps, SamplingConfig(12, temperature=1.0, stop_strings=[]))
    own, base = [], []
    for p, g in zip(ps, gens, strict=True):
        sampled = torch.tensor(g.sampler_logprobs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            own.append((recompute(peft_model, p, g) - sampled).abs())
            with peft_model.disable_adapter():
                base.append((recompute(peft_model, p, g) - sampled).abs())
    own, base = torch.cat(own).mean(), torch.cat(base).mean()
    assert own < 2e-3 and base > 4 * own  # measured: 4e-4 vs 4e-3


def test_bf16_lora_sampler_keeps_an_update_that_merging_would_round_away(tiny_model, tokenizer):
    """Folded into bf16 weights, an update below half their spacing vanishes:
    bf16(W + BA) == W. The sampler's layer keeps it, as the learner's layer does."""
    peft_model = _bf16_lora(tiny_model, 1e-3)
    trained = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        trained.base_layer.weight.copy_(trained.base_layer.weight.sign())  # spacing 2**-7
    delta = trained.get_delta_weight("default")
    assert 0 < delta.abs().max() < 2**-9
    assert torch.equal(
        (trained.base_layer.weight.float() + delta).bfloat16(), trained.base_layer.weight
    )
    policy = TransformersPolicy(peft_model, tokenizer, dtype="bfloat16")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        sampled = policy.model.model.layers[0].self_attn.q_proj(x).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            learned = trained(x).float()
        without = trained.base_layer(x).float()
    torch.testing.assert_close(sampled, learned, atol=1e-6, rtol=0)
    assert (sampled - without).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_gives_the_linear_layers_outputs(dtype):
    """bfloat16: bit-identical to ``F.linear`` (the same oneDNN kernel, the weight laid
    out once instead of per call); float32: oneDNN instead of MKL, equal to rounding."""
    if not weights.packs_linears("cpu", dtype):
        pytest.skip(f"oneDNN packs no {dtype} linear on this CPU (bf16 needs avx512bw/vl/dq)")
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 40, dtype=dtype)
    packed = weights._PackedLinear(linear)
    assert packed.weight is linear.weight and packed.bias is linear.bias  # shared, not copied
    inputs = [  # one row, decode rows (B, 1, H), a prefill, a strided last-position view
        torch.randn(1, 96, generator=gen),
        torch.randn(8, 1, 96, generator=gen),
        torch.randn(3, 50, 96, generator=gen),
        torch.randn(4, 7, 96, generator=gen)[:, -1:],
    ]
    with torch.no_grad():
        for x in inputs:
            x = x.to(dtype)
            out, expected = packed(x), linear(x)
            assert out.shape == expected.shape and out.dtype == dtype
            if dtype == torch.bfloat16:
                assert torch.equal(out, expected)
            else:
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        linear.weight.mul_(2.0)  # a changed weight needs pack() again
        x = inputs[1]
        assert not torch.allclose(packed(x.to(dtype)), linear(x.to(dtype)))
        packed.pack()
        torch.testing.assert_close(packed(x.to(dtype)), linear(x.to(dtype)), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    not weights.packs_linears("cpu", torch.bfloat16),
    reason="oneDNN packs no bfloat16 linear on this CPU (needs avx512bw/vl/dq)",
)
def test_sampling_copy_packs_every_linear_and_shares_the_frozen_base(tiny_model, tokenizer):
    peft_model = _bf16_lora(tiny_model, 1e-3)
    policy = TransformersPolicy(peft_model, tokenizer, dtype="bfloat16")
    linears = [n for n, m in policy.model.named_modules() if type(m) is torch.nn.Linear]
    assert linears == []  # every linear layer, the LM head and LoRA base layers included
    q = policy.model.model.layers[0].self_attn.q_proj
    trained = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(q, weights._LoRALinear)
    assert isinstance(q.base_layer, weights._PackedLinear)
    assert q.base_layer.weight is trained.base_layer.weight  # frozen base: shared, not copied
    head = policy.model.get_output_embeddings()
    assert isinstance(head, weights._PackedLinear)
    assert head.weight is policy.model.get_input_embeddings().weight  # still tied
    trained_modules = peft_model.modules()
    assert not any(isinstance(m, weights._PackedLinear) for m in trained_modules)


@pytest.mark.parametrize(
    ("dtype", "lora"),
    [("float32", True), ("float32", False), ("bfloat16", True), ("bfloat16", False)],
)
def test_released_weights_are_packed_again_to_the_same_tokens(tiny_model, tokenizer, dtype, lora):
    """``release_weights`` (the trainer, before a learn phase) frees every packed copy:
    the next generation packs them again, from the synced weights, and gives the same
    tokens and log-probs, bit for bit, as without the release, before and after an
    optimizer step."""
    from algorithms.lora import apply_lora

    if not weights.packs_linears("cpu", getattr(torch, dtype)):
        pytest.skip(f"oneDNN packs no {dtype} linear on this CPU")
    model = apply_lora(tiny_model, 4, 8, 0.0, ["q_proj", "up_proj"], seed=0) if lora else tiny_model
    params = [p for p in model.parameters() if p.requires_grad]

    def train_step(seed: int) -> None:  # an optimizer step's change (LoRA B too: not 0)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)

    train_step(3)
    policy = TransformersPolicy(model, tokenizer, dtype=dtype)
    packed = [m for m in policy.model.modules() if isinstance(m, weights._PackedLinear)]
    concats = [m for m in policy.model.modules() if isinstance(m, weights.PackedConcat)]
    assert packed and concats
    ps, sampling = prompts(tokenizer), SamplingConfig(8, temperature=1.0, stop_strings=[])

    def draw(p: TransformersPolicy) -> list[tuple[list[int], list[float]]]:
        return [
            (g.token_ids, g.sampler_logprobs) for g in p.generate(ps, sampling, seeds=[1, 2, 3])
        ]

    kept = draw(policy)
    sizes = [weights._nbytes(m.packed) for m in packed + concats]
    freed = policy.release_weights()
    assert all(m.packed is None for m in packed + concats)
    assert freed == sum(sizes)
    assert draw(policy) == kept  # the weights did not change: packed again as they were
    assert all(m.packed is not None for m in packed)
    assert [weights._nbytes(m.packed) for m in packed + concats] == sizes
    train_step(4)
    policy.release_weights()
    assert draw(policy) == draw(TransformersPolicy(model, tokenizer, dtype=dtype)) != kept


@pytest.mark.parametrize(("dtype", "bound"), [("float32", FP32_GAP), ("bfloat16", 0.05)])
def test_full_finetuning_sync_samples_from_the_updated_weights(tiny_model, tokenizer, dtype, bound):
    """Full fine-tuning: after an optimizer step the sampler follows the new weights
    (float32: the trained tensors are shared and their packed copies made again;
    bfloat16: copied, then packed again), not the ones it was built from."""
    import copy

    policy = TransformersPolicy(tiny_model, tokenizer, dtype=dtype)
    before = copy.deepcopy(tiny_model)
    optimizer = torch.optim.SGD(tiny_model.parameters(), lr=0.5)
    ps = prompts(tokenizer)
    ids = torch.tensor([ps[0]])
    token_logprobs(tiny_model, ids, torch.ones_like(ids)).sum().backward()
    optimizer.step()
    torch.manual_seed(0)
    gens = policy.generate(ps, SamplingConfig(8, temperature=1.0, stop_strings=[]))
    new, old = [], []
    for p, g in zip(ps, gens, strict=True):
        new.append((recompute(tiny_model, p, g) - torch.tensor(g.sampler_logprobs)).abs())
        old.append((recompute(before, p, g) - torch.tensor(g.sampler_logprobs)).abs())
    assert torch.cat(new).mean() < bound < torch.cat(old).mean()


def test_bf16_sampler_logprobs_stay_close_to_the_float32_trainer(tiny_model, tokenizer):
    """bf16 sampling vs a float32 recomputation of the same weights: measured, bounded."""
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="bfloat16")
    assert policy.model is not tiny_model
    assert next(policy.model.parameters()).dtype == torch.bfloat16
    torch.manual_seed(0)
    ps = prompts(tokenizer)
    gens = policy.generate(ps, SamplingConfig(12, temperature=1.0, stop_strings=[]))
    diffs = torch.cat(
        [
            (recompute(tiny_model, p, g) - torch.tensor(g.sampler_logprobs)).abs()
            for p, g in zip(ps, gens, strict=True)
        ]
    )
    assert diffs.mean() < 0.05  # measured ~0.01 for this model; SmolLM2 in the README


def test_sampler_draws_from_the_warped_distribution():
    """Frequencies follow softmax(logits / T) after top-k; cut tokens are never drawn."""
    from agentenv.lm.draw import sample as _sample
    from agentenv.lm.draw import warpers as _warpers

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 5.0, -9.0]]).repeat(20000, 1)
    sampling = SamplingConfig(temperature=2.0, top_k=3)
    torch.manual_seed(0)
    token, logp = _sample(logits, 2.0, _warpers(sampling))
    cut = float("-inf")
    probs = torch.softmax(torch.tensor([2.0, 1.0, cut, cut, 5.0, cut]) / 2, 0)  # top-3 kept
    freq = torch.bincount(token, minlength=6).double() / len(token)
    assert freq[2] == freq[3] == freq[5] == 0
    assert torch.allclose(freq, probs.double(), atol=0.01)
    assert torch.allclose(logp, probs.log()[token], atol=1e-6)
    greedy, _ = _sample(logits[:2], 0.0, [])
    assert greedy.tolist() == [4, 4]


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampling_draws_what_the_plain_inverse_cdf_formula_draws(temperature, dtype, kept):
    """``sample``'s in-place float64 CDF, skipped division by 1 and buffers kept from a
    previous step (``kept``: a step of 24 rows first, so these 16 use the front of larger
    buffers holding its values) change nothing: the same tokens and log-probs, bit for bit,
    as the formula written out, per-row seeds; the logits it is given are left as they were."""
    from agentenv.lm.draw import Buffers
    from agentenv.lm.draw import sample as _sample

    buffers = Buffers() if kept else None
    if kept:
        _sample(torch.randn(24, 4096).to(dtype), temperature, [], None, buffers)
        cdf = buffers.take("cdf", (24, 4096), torch.float64, torch.device("cpu"))
    logits = (torch.randn(16, 4096, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    before = logits.clone()
    token, logp = _sample(
        logits, temperature, [], [torch.Generator().manual_seed(i) for i in range(16)], buffers
    )
    if kept:  # the same storage, not a new one
        again = buffers.take("cdf", (16, 4096), torch.float64, torch.device("cpu"))
        assert again.data_ptr() == cdf.data_ptr() and again.shape == (16, 4096)
    logp_ref = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    if temperature:
        cdf = logp_ref.double().exp().cumsum(dim=-1)
        u = torch.cat(
            [
                torch.rand(1, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                for i in range(16)
            ]
        )
        ref = torch.searchsorted(cdf, (1 - u) * cdf[:, -1:]).squeeze(1)
    else:
        ref = logp_ref.argmax(dim=-1)
    assert torch.equal(token, ref) and len(set(token.tolist())) > 8  # rows drew apart
    assert torch.equal(logp, logp_ref.gather(1, ref[:, None]).squeeze(1))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_next_turn_continues_from_the_saved_cache(tiny_model, tokenizer, dtype):
    """A prompt extending the previous call's output reuses its KV cache: same result."""
    ps = prompts(tokenizer)
    policy = TransformersPolicy(tiny_model, tokenizer, dtype=dtype)
    fresh = TransformersPolicy(tiny_model, tokenizer, dtype=dtype, reuse_cache=False)
    first = policy.generate(ps, GREEDY)
    env = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )
    turn2 = [p + g.token_ids + env for p, g in zip(ps, first, strict=True)]
    turn2.append(ps[0] + env)  # no saved sequence is a prefix of this one
    assert all(policy._lookup(tuple(p)) is not None for p in turn2[:3])
    reused = policy.generate(turn2, GREEDY)
    expected = fresh.generate(turn2, GREEDY)
    tol = 1e-5 if dtype == "float32" else 0.05
    assert_same_draws(
        reused, expected, model=tiny_model, prompts=turn2, sampling=GREEDY, atol=tol, dtype=dtype
    )
    policy.sync()  # new weights: the saved caches are dropped
    assert policy._saved == {}


def test_shardings_the_sampler_cannot_gather_are_refused(tiny_model, tokenizer):
    param = next(tiny_model.parameters())
    param.ds_id = 0  # how DeepSpeed ZeRO-3 marks a partitioned parameter
    with pytest.raises(InvalidOptionError, match="ZeRO-3.*fsdp_version: 2"):
        TransformersPolicy(tiny_model, tokenizer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_joining_and_leaving_a_running_batch_decode_as_they_would_alone(
    sharp_model, tokenizer, dtype, device
):
    """Continuous batching: a row added while others decode, or left running after others
    ended, gets the tokens and log-probs of a fresh single-row generate with its seed."""
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, stop_strings=[])
    rows = prompts(tokenizer)
    seeds = [11, 22, 33]
    limits = [12, 5, 9]  # rows end at different steps
    sharp_model = on(sharp_model, device)
    policy = TransformersPolicy(sharp_model, tokenizer, dtype=dtype)
    decoder = policy.decoder(sampling)
    decoder.add(0, rows[0], seed=seeds[0], max_new_tokens=limits[0])
    got = {}
    for step in range(40):
        # rows join a running batch narrower (47 + 1 slots vs 50) and wider (47 + 6 vs 43)
        # than their own prefill: either side may need the masked gap
        if step == 1:
            decoder.add(2, rows[2], seed=seeds[2], max_new_tokens=limits[2])
        if step == 6:
            decoder.add(1, rows[1], seed=seeds[1], max_new_tokens=limits[1])
        for key, generation in decoder.step():
            got[key] = generation
        if len(got) == 3:
            break
    assert len(decoder) == 0 and sorted(got) == [0, 1, 2]
    alone = [
        TransformersPolicy(sharp_model, tokenizer, dtype=dtype).generate(
            [rows[i]],
            sampling.__class__(**{**vars(sampling), "max_new_tokens": limits[i]}),
            seeds=[seeds[i]],
        )[0]
        for i in range(3)
    ]
    assert [len(g.token_ids) for g in alone] == limits
    atol = 1e-5 if dtype == "float32" else 0.05  # bf16: batched kernels round apart
    assert_same_draws(
        [got[i] for i in range(3)],
        alone,
        model=sharp_model,
        prompts=rows,
        sampling=sampling,
        seeds=seeds,
        atol=atol,
        dtype=dtype,
    )


# The tiny random model's logits are flat: at this temperature 8 rows of one prompt draw
# 2 different first tokens and part into 6 sequences over 12 steps.
PARTING = SamplingConfig(max_new_tokens=12, temperature=0.068, stop_strings=[])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("caches", ["append", "dynamic"])
def test_rows_sharing_a_slot_until_they_part_decode_as_they_would_alone(
    tiny_model, tokenizer, device, caches, monkeypatch
):
    """Rows whose tokens so far are the same run as one sequence of the batch, and a
    sequence splits where its rows draw different tokens: each row still gets the tokens
    and log-probs of a fresh single-row generate with its seed (float32)."""
    from agentenv.lm import decoding, sampler

    if caches == "dynamic":  # transformers' own caches: a split copies the whole cache
        monkeypatch.setattr(sampler, "append_cache", lambda model: None)
        monkeypatch.setattr(decoding, "append_cache", lambda model: None)
    model = on(tiny_model, device)
    first, other = prompts(tokenizer)[:2]
    batch = [first] * 8 + [other] * 2
    seeds = list(range(10))
    policy = TransformersPolicy(model, tokenizer, dtype="float32", share_slots=True)
    got = policy.generate(batch, PARTING, seeds=seeds)
    assert 0 < policy.decoded_slots < 0.75 * policy.decoded_rows  # shared for most steps
    assert len({tuple(g.token_ids) for g in got[:8]}) > 1  # and parted
    apart = TransformersPolicy(model, tokenizer, dtype="float32", share_slots=False)
    separate = apart.generate(batch, PARTING, seeds=seeds)  # a slot per row: the same
    same = {"model": tiny_model, "prompts": batch, "sampling": PARTING, "seeds": seeds}
    assert_same_draws(separate, got, **same)
    assert apart.decoded_slots == apart.decoded_rows  # (drafts: fewer rows than tokens)
    assert apart.decoded_tokens == sum(len(g.token_ids) for g in separate)
    assert policy.decoded_tokens == sum(len(g.token_ids) for g in got)
    alone = []
    for prompt, seed in zip(batch, seeds, strict=True):
        one = TransformersPolicy(model, tokenizer, dtype="float32")
        alone.append(one.generate([prompt], PARTING, seeds=[seed])[0])
        assert one.decoded_slots == one.decoded_rows <= len(alone[-1].token_ids)
        assert one.decoded_tokens == len(alone[-1].token_ids)
    assert_same_draws(got, alone, **same)


def test_rows_of_a_model_with_sliding_windows_keep_a_slot_each(tokenizer, monkeypatch):
    """A cache of sliding-window layers cannot copy a slot's rows when it splits: its rows
    each keep their own slot, take no drafts (and decode as they would alone)."""
    from tiny_models import tiny_qwen2

    from agentenv.lm import decoding

    model = tiny_qwen2(tokenizer, use_sliding_window=True, sliding_window=4096, max_window_layers=0)
    assert set(model.config.layer_types) == {"sliding_attention"}
    first = prompts(tokenizer)[0]
    policy = TransformersPolicy(model, tokenizer, dtype="float32", share_slots=True)
    widths = []  # tokens per row of each decode step's forward
    step = decoding.decode_logits
    monkeypatch.setattr(decoding.Decoder, "_draft_length", lambda self, running: 4)
    monkeypatch.setattr(decoding, "lookup", lambda context, k: list(context[-k:]))
    monkeypatch.setattr(
        decoding,
        "decode_logits",
        lambda m, c, ids, *a, **k: widths.append(ids.shape[1]) or step(m, c, ids, *a, **k),
    )
    got = policy.generate([first] * 3, PARTING, seeds=[0, 1, 2])
    assert policy.decoded_slots == policy.decoded_rows > 0
    assert set(widths) == {1}  # nor drafts: rejected ones would take slots of the window
    alone = TransformersPolicy(model, tokenizer, dtype="float32")
    expected = alone.generate([first], PARTING, seeds=[1])
    assert_same_draws(got[1:2], expected, model=model, prompts=[first], sampling=PARTING, seeds=[1])


def test_rows_that_end_together_save_one_cache_that_each_continuation_uses(tiny_model, tokenizer):
    """Three rows of one slot end at the same step: their cache is saved once, and each of
    their next turns, admitted at different steps, continues it (only the new tokens are
    prefilled); the last one uses it up."""
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0, stop_strings=[])
    first = prompts(tokenizer)[0]
    policy = TransformersPolicy(
        tiny_model, tokenizer, dtype="float32", share_slots=True, draft_tokens=0
    )
    decoder = policy.decoder(greedy)
    for key in "abc":
        decoder.add(key, first, seed=0)
    ended = [x for _ in range(4) for x in decoder.step()]
    assert sorted(k for k, _ in ended) == ["a", "b", "c"]
    assert policy.decoded_rows == 12 and policy.decoded_slots == 4
    turn = ended[0][1].token_ids
    assert all(g.token_ids == turn for _, g in ended)
    longer = [*first, *turn, *tokenizer.encode(" go on", add_special_tokens=False)]
    new = len(longer) - len(first) - len(turn) + 1  # the last sampled token, then the reply
    assert len(policy._saved) == 1
    for i, key in enumerate("abc"):
        before = policy.prefill_tokens
        decoder.add(key, longer, seed=0, max_new_tokens=2)
        decoder.step()  # admitted alone (the others are still decoding, or done)
        assert policy.prefill_tokens - before == new
        assert (policy._lookup(tuple(longer)) is None) == (i == 2)


@pytest.mark.parametrize("device", DEVICES)
def test_a_continued_row_starts_from_its_saved_cache(sharp_model, tokenizer, device):
    """An episode's next turn, added while another row decodes, continues its saved KV
    cache: its tokens and log-probs equal a fresh prefill of the whole prompt (float32)."""
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, stop_strings=[])
    sharp_model = on(sharp_model, device)
    first = prompts(tokenizer)[0]
    policy = TransformersPolicy(sharp_model, tokenizer, dtype="float32")
    decoder = policy.decoder(sampling)
    decoder.add("a", first, seed=1, max_new_tokens=4)
    decoder.add("b", prompts(tokenizer)[1], seed=2)
    ended = [x for _ in range(4) for x in decoder.step()]
    assert [key for key, _ in ended] == ["a"]
    assert [r.key for rows in decoder.slots for r in rows] == ["b"]
    turn = ended[0][1]
    longer = [*first, *turn.token_ids, *tokenizer.encode(" ok, go on", add_special_tokens=False)]
    assert policy._lookup(tuple(longer)) is not None
    decoder.add("a2", longer, seed=3, max_new_tokens=6)
    got = dict(x for _ in range(12) for x in decoder.step())
    assert policy._lookup(tuple(longer)) is None  # the saved row was continued (and used up)
    alone = TransformersPolicy(sharp_model, tokenizer, dtype="float32").generate(
        [longer], SamplingConfig(max_new_tokens=6, temperature=1.0, stop_strings=[]), seeds=[3]
    )[0]
    assert len(got["a2"].token_ids) == len(alone.token_ids) == 6
    sampling = dataclasses.replace(sampling, max_new_tokens=6)
    assert_same_draws(
        [got["a2"]], [alone], model=sharp_model, prompts=[longer], sampling=sampling, seeds=[3]
    )


def test_the_running_batch_keeps_no_autograd_graph(tiny_model, tokenizer):
    """A float32 model's weights are sampled from as they are (they require grad): decode steps
    outside ``generate`` must still keep no graph, or every step's activations stay alive
    (the rollout engine then grew to 12 GB collecting 64 episodes)."""
    assert all(p.requires_grad for p in tiny_model.parameters())
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    assert any(p.requires_grad for p in policy.model.parameters())  # shared, not copied
    decoder = policy.decoder(SamplingConfig(max_new_tokens=6, temperature=1.0, stop_strings=[]))
    for i, prompt in enumerate(prompts(tokenizer)):
        decoder.add(i, prompt, seed=i, max_new_tokens=3 + i)
    ended = [x for _ in range(3) for x in decoder.step()]
    assert [key for key, _ in ended] == [0] and decoder.live == 2
    assert not decoder._logits.requires_grad
    assert not any(layer.keys.requires_grad for layer in decoder._cache.layers)


def test_length_groups_pad_the_fewest_slots():
    """Hand-computed cases, then every small case against all groupings into runs of the
    rows sorted by length (the only candidates: any other grouping pads at least as much)."""
    import itertools
    import random

    from agentenv.lm.sampler import length_groups

    # 6 x 250 + 14 x 50 = 2,200 slots + 256 for the second call, vs 20 x 250 = 5,000
    assert length_groups([250] * 6 + [50] * 14) == [list(range(6)), list(range(6, 20))]
    assert length_groups([100, 98, 97, 95]) == [[0, 1, 2, 3]]  # 400 slots: one call
    assert length_groups([50, 250, 49, 251]) == [[1, 3], [0, 2]]  # longest first
    assert length_groups([7]) == [[0]]
    # [300, 5]: 600 slots in one call, 305 + call_slots in two
    assert length_groups([300, 5], call_slots=294) == [[0], [1]]  # saves 1 slot
    assert length_groups([300, 5], call_slots=295) == [[0, 1]]  # saves none: one call

    def cost(groups, lengths, call_slots):
        return sum(len(g) * max(lengths[i] for i in g) for g in groups) + call_slots * (
            len(groups) - 1
        )

    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.choice([rng.randint(1, 20), rng.randint(100, 300)]) for _ in range(7)]
        call_slots = rng.choice([0, 16, 256])
        groups = length_groups(lengths, call_slots)
        assert sorted(i for g in groups for i in g) == list(range(7))
        order = sorted(range(7), key=lambda i: -lengths[i])
        least = min(
            cost([order[a:b] for a, b in itertools.pairwise((0, *cuts, 7))], lengths, call_slots)
            for k in range(7)
            for cuts in itertools.combinations(range(1, 7), k)
        )
        assert cost(groups, lengths, call_slots) == least


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_continued_rows_prefilled_in_length_groups_decode_as_in_one_batch(
    sharp_model, tokenizer, dtype, monkeypatch
):
    """Env replies of ~300 tokens and of a few side by side: the prefill runs in two
    groups (fewer padded slots), merged into one batch; each row gets the tokens and
    log-probs of the one-batch prefill (float32 to 1e-5) and of a fresh prefill of its
    whole prompt, and the same tokens count as read."""
    from agentenv.lm import sampler

    calls = []
    real = sampler.length_groups
    monkeypatch.setattr(sampler, "length_groups", lambda n: calls.append(real(n)) or calls[-1])
    ps = prompts(tokenizer)
    long_reply = tokenizer.encode(" the search found this passage about calculators." * 30)
    short_reply = tokenizer.encode(" Error: try again.")
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, stop_strings=[])
    got = {}
    for split in (True, False):
        policy = TransformersPolicy(sharp_model, tokenizer, dtype=dtype, split_prefill=split)
        first = policy.generate(ps, sampling, seeds=[1, 2, 3])
        replies = [short_reply, long_reply, short_reply[:-1]]
        turn2 = [p + g.token_ids + r for p, g, r in zip(ps, first, replies, strict=True)]
        read = policy.prefill_tokens
        got[split] = (turn2, policy.generate(turn2, sampling, seeds=[4, 5, 6]))
        got[split] += (policy.prefill_tokens - read,)
    assert calls == [[[1], [0, 2]]]  # split once (turn 2, first policy): rows reordered
    (turn2, split, read), (turn2_one, one, read_one) = got[True], got[False]
    # each row reads its last sampled token (not in its saved cache) and its env reply
    assert turn2 == turn2_one and read == read_one == sum(len(r) + 1 for r in replies)
    fresh = TransformersPolicy(sharp_model, tokenizer, dtype=dtype, reuse_cache=False)
    alone = [
        fresh.generate([p], sampling, seeds=[s])[0] for p, s in zip(turn2, [4, 5, 6], strict=True)
    ]
    atol = 1e-5 if dtype == "float32" else 0.05  # bf16: batched kernels round apart
    for other in (one, alone):
        assert_same_draws(
            split,
            other,
            model=sharp_model,
            prompts=turn2,
            sampling=sampling,
            seeds=[4, 5, 6],
            atol=atol,
            dtype=dtype,
        )
