"""QLoRA: a 4-bit (bitsandbytes NF4) base, LoRA on top, reference decoding, export."""

import importlib.util
import json

import pytest
import torch

from agentenv.errors import InvalidOptionError
from agentenv.lm.quantize import check_quantize, quantization_of

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*is_gradient_checkpointing:FutureWarning",
    "ignore:.*jit.script_method.*:DeprecationWarning",
)


def test_bad_quantize_settings_are_named_before_any_model_loads(monkeypatch):
    check_quantize(None, use_lora=False)  # nothing asked: nothing needed
    with pytest.raises(InvalidOptionError, match="one of \\('nf4',\\)"):
        check_quantize("int8")
    with pytest.raises(InvalidOptionError, match="set use_lora true"):
        check_quantize("nf4", use_lora=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "bitsandbytes" else real(name)
    )
    with pytest.raises(InvalidOptionError, match="install.sh --qlora"):
        check_quantize("nf4")
    from agentenv.run.config import TrainConfig

    with pytest.raises(InvalidOptionError, match="bitsandbytes"):
        TrainConfig(model="/no/such/model", quantize="nf4")


def test_a_4bit_base_is_refused_with_a_full_fine_tune_or_another_engine(bnb):
    from agentenv.run.config import SFTRunConfig, TrainConfig

    with pytest.raises(InvalidOptionError, match="use_lora true"):
        TrainConfig(quantize="nf4", grpo={"use_lora": False})
    with pytest.raises(InvalidOptionError, match="use_lora true"):
        SFTRunConfig(quantize="nf4", sft={"use_lora": False})
    with pytest.raises(InvalidOptionError, match="engine vllm"):
        TrainConfig(quantize="nf4", generation={"engine": "vllm"})


@pytest.fixture
def bnb():
    return pytest.importorskip(
        "bitsandbytes", reason="QLoRA needs bitsandbytes (bash install.sh --qlora)"
    )


def load_4bit(model_dir):
    from agentenv.lm import models

    return models.load(model_dir, dtype="float32", device="cpu", quantize="nf4")


def test_the_base_loads_in_4_bits_and_decodes_with_the_reference_path(bnb, tiny_model_dir, caplog):
    from agentenv.lm import models
    from agentenv.lm.backend import EngineConfig, SamplingConfig
    from agentenv.lm.engines import make_policy
    from agentenv.lm.reference import ReferencePolicy

    model, tokenizer = load_4bit(tiny_model_dir)
    plain, _ = models.load(tiny_model_dir, dtype="float32", device="cpu")
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2 * 7  # every linear of the 2 decoder layers; not the head
    assert quantization_of(model) == "nf4" and quantization_of(plain) is None
    assert layers[0].weight.dtype == torch.uint8
    assert model.get_memory_footprint() < plain.get_memory_footprint()
    with caplog.at_level("WARNING"):
        policy = make_policy(
            EngineConfig(), model, tokenizer, model_name=tiny_model_dir, dtype="float32"
        )
    assert isinstance(policy, ReferencePolicy)
    assert "4 bits (nf4)" in caplog.text
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    (gen,) = policy.generate([ids], SamplingConfig(max_new_tokens=5, temperature=0.0))
    assert len(gen.token_ids) == 5 and all(lp <= 0 for lp in gen.sampler_logprobs)


def test_grpo_trains_the_adapter_and_leaves_the_4bit_weights_alone(bnb, tiny_model_dir):
    from toy_episodes import SAMPLING, make_groups

    from algorithms.config import GRPOConfig
    from algorithms.grpo import GRPO

    model, tokenizer = load_4bit(tiny_model_dir)
    torch.manual_seed(0)
    cfg = GRPOConfig(learning_rate=1e-2, lora_r=4, lora_alpha=8)
    algo = GRPO(model, tokenizer, cfg, sampling=SAMPLING)
    quantized = {
        n: p.detach().clone() for n, p in algo.model.named_parameters() if p.dtype == torch.uint8
    }
    lora = {n: p.detach().clone() for n, p in algo.model.named_parameters() if p.requires_grad}
    assert quantized and lora and all(".lora_" in n for n in lora)
    algo.learn(make_groups([[0, 1, 1, 0], [1, 0, 0, 1]]))
    params = dict(algo.model.named_parameters())
    assert all(torch.equal(params[n], w) for n, w in quantized.items())
    assert any(not torch.equal(params[n], w) for n, w in lora.items() if "lora_B" in n)


def test_a_rollout_leaves_the_4bit_base_differentiable(bnb, tiny_model_dir):
    """A forward in eval mode without gradients (what the sampler runs) must not move the
    4-bit layers onto bitsandbytes' bf16 inference kernel, which has no backward (on CPUs
    with avx512_bf16): the LoRA gradients after it equal those before, bit for bit."""
    from algorithms.lora import apply_lora

    model, tokenizer = load_4bit(tiny_model_dir)
    peft_model = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj", "up_proj"], 0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at 0: let the lower layers' A get a gradient
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([tokenizer.encode("what is 3 + 4?", add_special_tokens=False)])

    def gradients():
        peft_model.train()
        peft_model.zero_grad()
        peft_model(ids).logits.sum().backward()
        return {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}

    before = gradients()
    peft_model.eval()
    with torch.no_grad():
        peft_model(ids)  # a rollout's forward
    layers = [m for m in peft_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    after = gradients()
    assert before.keys() == after.keys()
    for name, grad in before.items():
        assert torch.equal(grad, after[name]), name


def test_a_qlora_run_records_its_base_and_exports_into_the_dequantized_weights(
    bnb, tiny_model_dir, tmp_path, capsys
):
    import coin_env  # noqa: F401  (rewards a tiny model can vary)
    from transformers import AutoModelForCausalLM

    from agentenv.run.config import TrainConfig
    from agentenv.run.export import export_checkpoint, load_from_checkpoint
    from agentenv.run.train import train

    config = TrainConfig(
        model=tiny_model_dir,
        env_id="CoinCalculator-v0",
        env_kwargs={"source": "word_problems", "prompt_style": "compact"},
        quantize="nf4",
        dtype="float32",
        steps=2,
        batch_size=2,
        rollout={"group_size": 2, "max_turns": 1, "sampling": {"max_new_tokens": 6}},
        eval_tasks=0,
        log_episodes=0,
        output_dir=str(tmp_path / "run"),
        grpo={"learning_rate": 1e-2, "lora_r": 4, "lora_alpha": 8},
    )
    run = train(config=config)
    ckpt = run / "checkpoints" / "step_000002"
    assert json.loads((ckpt / "trainer_state.json").read_text())["quantize"] == "nf4"
    assert sorted(p.name for p in (ckpt / "adapter").iterdir() if p.suffix == ".safetensors") == [
        "adapter_model.safetensors"  # the adapter only: no base weights
    ]
    out = export_checkpoint(ckpt, tmp_path / "exported", model=tiny_model_dir)
    assert "nf4 base, de-quantized" in (out / "README.md").read_text()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert getattr(exported.config, "quantization_config", None) is None
    trained, tokenizer = load_4bit(tiny_model_dir)
    trained = load_from_checkpoint(trained, ckpt).eval()
    ids = torch.tensor([tokenizer.encode("what is 3 + 4?", add_special_tokens=False)])
    with torch.no_grad():
        want, got = trained(ids).logits, exported(ids).logits
    assert torch.allclose(want, got, atol=1e-4), (want - got).abs().max()
    # evaluating it on the unquantized base says so, naming the flag
    import argparse

    from agentenv.cli import _load_policy

    capsys.readouterr()
    args = argparse.Namespace(
        adapter=str(ckpt), model=tiny_model_dir, device="cpu", dtype="float32", quantize=None
    )
    _load_policy(args)
    assert "pass --quantize nf4" in capsys.readouterr().err
