"""HF-native artifacts: a checkpoint's adapter folder loads with AutoPeftModelForCausalLM,
`agentenv export` writes a merged model that generates what the adapter model does, and
`agentenv eval --adapter` loads the adapter's own base model."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentenv.cli import _load_policy, main
from agentenv.errors import InvalidOptionError
from agentenv.lm import models
from agentenv.run.export import base_model_for, checkpoint_base, export_checkpoint
from algorithms.config import SFTConfig
from algorithms.sft import SFT


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory):
    """A LoRA checkpoint of the tiny model whose adapter changes its outputs."""
    model, tokenizer = models.load(tiny_model_dir, dtype="float32")
    trainer = SFT(model, tokenizer, SFTConfig(), seed=0)
    with torch.no_grad():
        for name, p in trainer.unwrapped_model.named_parameters():
            if "lora_B" in name:  # B starts at 0: give the adapter an effect
                p.normal_(0, 0.5, generator=torch.Generator(p.device).manual_seed(0))
    return trainer.save(tmp_path_factory.mktemp("ckpt") / "checkpoint")


def greedy(model, tokenizer, n=12):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 6 * 7?"}], add_generation_prompt=True
    )
    ids = torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


def test_adapter_folder_loads_with_auto_peft_and_its_tokenizer(checkpoint, tiny_model_dir):
    from peft import AutoPeftModelForCausalLM

    adapter = checkpoint / "adapter"
    assert checkpoint_base(checkpoint) == tiny_model_dir  # a base that loads from here
    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    assert (
        tokenizer.chat_template
        and tokenizer.chat_template == models.load_tokenizer(tiny_model_dir).chat_template
    )
    base, _ = models.load(tiny_model_dir, dtype="float32")
    assert greedy(model, tokenizer) != greedy(base, tokenizer)  # the adapter is applied


def test_export_writes_a_merged_model_with_the_adapter_models_greedy_text(
    checkpoint, tmp_path, capsys
):
    from peft import AutoPeftModelForCausalLM

    out = tmp_path / "merged"
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert "exported" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert merged.dtype == torch.float32 and tokenizer.chat_template
    adapter_model = AutoPeftModelForCausalLM.from_pretrained(str(checkpoint / "adapter")).eval()
    assert greedy(merged, tokenizer, 20) == greedy(adapter_model, tokenizer, 20)
    assert sorted(p.name for p in out.parent.iterdir()) == ["merged"]  # no temp folder left


def test_export_rejects_bad_input_before_loading(checkpoint, tmp_path):
    with pytest.raises(InvalidOptionError, match="neither adapter/ nor model/"):
        export_checkpoint(tmp_path, tmp_path / "out")
    (tmp_path / "taken").mkdir()
    with pytest.raises(InvalidOptionError, match="already exists"):
        export_checkpoint(checkpoint, tmp_path / "taken")
    with pytest.raises(InvalidOptionError, match="'float32' or 'bfloat16'"):
        export_checkpoint(checkpoint, tmp_path / "out", dtype="float16")


def test_eval_adapter_loads_the_adapters_own_base(checkpoint, tiny_model_dir, tmp_path):
    args = SimpleNamespace(
        model=models.DEFAULT_MODEL, adapter=str(checkpoint), device="cpu", dtype="float32"
    )
    model, _ = _load_policy(args)  # the default alias, but the adapter was trained on tiny
    assert model.get_base_model().config.num_hidden_layers == 2
    assert base_model_for(checkpoint, "some/other-model") == "some/other-model"  # --model wins
    moved = tmp_path / "moved"
    (moved / "adapter").mkdir(parents=True)
    config = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")  # the base folder is gone
    (moved / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    assert base_model_for(moved, models.DEFAULT_MODEL) == models.DEFAULT_MODEL


def test_loading_an_adapter_checkpoint_prints_no_library_warning(tmp_path):
    """What `agentenv train --init-from` does (the quickstart's GRPO after SFT): peft's
    deprecation warning from transformers stays out of the user's output."""
    import warnings

    from agentenv.lm.models import load_tokenizer, tiny_model
    from agentenv.run.export import load_from_checkpoint
    from algorithms.lora import apply_lora

    tokenizer = load_tokenizer()
    apply_lora(tiny_model(tokenizer), 4, 8, 0.0, ["q_proj"], seed=0).save_pretrained(
        tmp_path / "ckpt" / "adapter"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        model = load_from_checkpoint(tiny_model(tokenizer), tmp_path / "ckpt")
    assert any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_export_of_a_gae_checkpoint_leaves_its_critic_out(tiny_model_dir, tmp_path):
    """A ``credit="gae"`` checkpoint holds the critic (``critic.pt``) beside the adapter;
    the exported model is the policy alone and generates what the adapter model does."""
    from peft import AutoPeftModelForCausalLM
    from toy_episodes import SAMPLING, make_groups

    from algorithms.config import GRPOConfig
    from algorithms.grpo import GRPO

    model, tokenizer = models.load(tiny_model_dir, dtype="float32")
    config = GRPOConfig(learning_rate=5e-2, lora_r=4, lora_alpha=8, credit="gae")
    trainer = GRPO(model, tokenizer, config, sampling=SAMPLING)
    trainer.learn(make_groups([[1, 0, 0], [0, 1, 0]], seed=0))
    saved = trainer.save(tmp_path / "checkpoint")
    assert (saved / "critic.pt").is_file()
    out = tmp_path / "merged"
    assert main(["export", str(saved), str(out)]) == 0
    assert not list(out.glob("critic*")) and (out / "config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert not any("lora" in name or "value" in name for name, _ in merged.named_parameters())
    adapter_model = AutoPeftModelForCausalLM.from_pretrained(str(saved / "adapter")).eval()
    assert greedy(merged, tokenizer, 20) == greedy(adapter_model, tokenizer, 20)
