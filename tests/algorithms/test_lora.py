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
        from agentenv.models import load_tokenizer
        from agentenv.models import tiny_model as build

        apply_lora(build(load_tokenizer()), 4, 8, 0.0, ["q_proj"], seed=0, last_layers=3)
