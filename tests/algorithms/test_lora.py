import pytest
import torch
from peft import PeftModel

from agentenv.errors import InvalidOptionError
from algorithms.lora import apply_lora


def test_last_layers_only_adapts_the_top_and_keeps_grad_flowing(tiny_model, tokenizer):
    model = apply_lora(tiny_model, 4, 8, 0.0, ["q_proj", "v_proj"], seed=0, last_layers=1)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".layers.1." in n and "lora_" in n for n in names)
    ids = torch.tensor([tokenizer.encode("hello world")])
    model(input_ids=ids).logits.sum().backward()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]  # A gets 0 while B=0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)


def test_peft_model_is_kept_and_bad_layer_count_refused(tiny_model):
    model = apply_lora(tiny_model, 4, 8, 0.0, ["q_proj"], seed=0)
    assert isinstance(model, PeftModel)
    assert apply_lora(model, 8, 16, 0.0, ["v_proj"], seed=1) is model  # adapters kept
    with pytest.raises(InvalidOptionError, match="lora_layers"):
        from agentenv.lm.models import load_tokenizer
        from agentenv.lm.models import tiny_model as build

        apply_lora(build(load_tokenizer()), 4, 8, 0.0, ["q_proj"], seed=0, last_layers=3)


def test_lora_input_is_not_cast_to_float32_same_values_less_kept(tiny_model, tokenizer):
    """Under bf16 autocast the adapter's matmuls run in bf16 whether or not peft first
    casts the input to float32: same loss and gradients, but the cast's copies were kept
    for backward."""
    model = apply_lora(tiny_model.bfloat16(), 4, 8, 0.0, ["q_proj", "v_proj", "up_proj"], seed=0)
    layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and not any(m.cast_input_dtype_enabled for m in layers)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.01)
    ids = torch.tensor([tokenizer.encode("hello world, how are you today?")])

    def run(cast):
        for m in layers:
            m.cast_input_dtype_enabled = cast
        kept = {}  # storage -> bytes: a tensor saved twice is kept once

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        model.zero_grad()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in params], sum(kept.values())

    loss, grads, kept = run(False)
    cast_loss, cast_grads, cast_kept = run(True)
    assert loss == cast_loss
    assert all(torch.equal(a, b) for a, b in zip(grads, cast_grads, strict=True))
    assert kept < cast_kept
