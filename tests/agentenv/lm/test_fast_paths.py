"""Each fast path of the sampler, turned off by its own switch, against the reference path.

A LoRA model with a live adapter decodes two turns of an episode per row, in float32: a
group's two rows share each prompt (the shared prefix and slots), the second turn extends
the first (the continued cache), after environment replies of different lengths (the split
prefill). With any one switch off, the sampler must still draw what the reference path
draws (``assert_same_draws``: the same tokens wherever rounding cannot flip a draw), and
the switch must take effect (each case's ``probe``), on whatever CPU runs the test.
"""

from __future__ import annotations

import pytest
import torch
from draws import assert_same_draws

import agentenv.lm.decode_step as decode_step
import agentenv.lm.decoding as decoding
import agentenv.lm.sampler as sampler_module
from agentenv.errors import InvalidOptionError
from agentenv.lm.backend import FAST_PATHS, EngineConfig, SamplingConfig
from agentenv.lm.reference import ReferencePolicy
from agentenv.lm.sampler import TransformersPolicy
from agentenv.lm.weights import PackedConcat, _LoRALinear, _PackedLinear, packs_linears

SAMPLED = SamplingConfig(max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.9, stop_strings=[])
SEEDS = [21, 22, 23, 24]
REPLIES = ["Result: 4", "Error: the tool 'search' takes a query; here is a much longer reply."]


@pytest.fixture(scope="module")
def lora_model(sharp_model):
    """A copy of the sharp model with a LoRA adapter whose B is not zero (the module's)."""
    import copy

    from algorithms.lora import apply_lora

    model = apply_lora(copy.deepcopy(sharp_model), 4, 8, 0.0, ["q_proj", "v_proj", "up_proj"], 0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B starts at 0: give the adapter a say
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=generator)
    return model


@pytest.fixture(scope="module")
def reference_turns(lora_model, tokenizer):
    """The reference path's two turns: ``[(prompts, seeds, generations)] * 2``."""
    ref = ReferencePolicy(lora_model, tokenizer, dtype="float32")
    prompts, turns = first_prompts(tokenizer), []
    for turn in (1, 2):
        seeds = [s + 100 * turn for s in SEEDS]
        turns.append((prompts, seeds, ref.generate(prompts, SAMPLED, seeds=seeds)))
        prompts = next_prompts(tokenizer, prompts, turns[-1][2])
    return turns


def first_prompts(tokenizer) -> list[list[int]]:
    """Two groups of two rows: each group's rows share their prompt."""
    system = {"role": "system", "content": "You are a careful assistant. " * 4}
    out = []
    for user in ("2 + 2?", "Spell 'calculator' backwards please."):
        messages = [system, {"role": "user", "content": user}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out += [ids["input_ids"]] * 2
    return out


def next_prompts(tokenizer, prompts, turns) -> list[list[int]]:
    """Each row's episode so far plus an environment reply (short or long, by row)."""
    out = []
    for i, (prompt, turn) in enumerate(zip(prompts, turns, strict=True)):
        reply = f"<|im_end|>\n<|im_start|>user\n{REPLIES[i % 2]}<|im_end|>\n<|im_start|>assistant\n"
        out.append(prompt + turn.token_ids + tokenizer.encode(reply))
    return out


# the function each switch's path runs through, where it has one
ENTRIES = {
    "llama_step": (decode_step, "_llama_step"),
    "inplace_attention": (sampler_module, "sampler_attention"),
    "split_prefill": (sampler_module, "length_groups"),
    "draft_tokens": (decoding, "lookup"),
}


def forbid(monkeypatch, module, name: str) -> None:
    """Make ``module.name`` fail the test if it is called."""

    def called(*args, **kwargs):
        raise AssertionError(f"{name} ran with its fast path off")

    monkeypatch.setattr(module, name, called)


def count(monkeypatch, module, name: str) -> list[int]:
    """Count the calls of ``module.name``: ``[calls]``."""
    calls, real = [0], getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# switch -> (what makes a run with it off fail if the path still ran, a check afterwards)
def probe(name: str, monkeypatch):
    if name in ENTRIES:
        forbid(monkeypatch, *ENTRIES[name])

    def after(policy: TransformersPolicy) -> None:
        modules = list(policy.model.modules())
        if name == "pack_weights":
            assert not any(isinstance(m, _PackedLinear) for m in modules)
        elif name == "pack_qkv":
            assert not any(
                isinstance(getattr(m, "packed_qkv", None), PackedConcat) for m in modules
            )
        elif name == "fold_lora":
            lora = [m for m in modules if isinstance(m, _LoRALinear)]
            assert lora and not any(m.folded for m in lora)
        elif name == "share_slots":
            assert policy.decoded_slots == policy.decoded_rows
        elif name == "reuse_cache":
            assert policy._saved == {}

    return after


@pytest.mark.parametrize("name", [*FAST_PATHS, "draft_tokens"])
def test_each_fast_path_off_draws_what_the_reference_draws(
    name, lora_model, reference_turns, tokenizer, monkeypatch
):
    after = probe(name, monkeypatch)
    off = {name: 0 if name == "draft_tokens" else False}
    fast = TransformersPolicy(lora_model, tokenizer, dtype="float32", **off)
    for prompts, seeds, want in reference_turns:  # the second continues the first
        got = fast.generate(prompts, SAMPLED, seeds=seeds)
        assert_same_draws(
            got, want, model=lora_model, prompts=prompts, sampling=SAMPLED, seeds=seeds
        )
    after(fast)


def test_every_fast_path_runs_by_default_on_this_cpu(
    lora_model, reference_turns, tokenizer, monkeypatch
):
    """The probes above can fail: with nothing off, each path they look for is there."""
    calls = {name: count(monkeypatch, *entry) for name, entry in ENTRIES.items()}
    policy = TransformersPolicy(lora_model, tokenizer, dtype="float32")
    for prompts, seeds, want in reference_turns:
        got = policy.generate(prompts, SAMPLED, seeds=seeds)
        assert_same_draws(
            got, want, model=lora_model, prompts=prompts, sampling=SAMPLED, seeds=seeds
        )
    assert policy._saved  # continued turns: caches kept
    assert policy.decoded_slots < policy.decoded_rows  # a group's rows share a slot
    assert {name: n[0] > 0 for name, n in calls.items()} == dict.fromkeys(ENTRIES, True)
    modules = list(policy.model.modules())
    if packs_linears("cpu", torch.float32):
        assert any(isinstance(m, _PackedLinear) for m in modules)
        assert any(m.folded for m in modules if isinstance(m, _LoRALinear))


def test_unknown_or_misplaced_fast_path_names_are_refused_with_the_names():
    with pytest.raises(InvalidOptionError, match="unknown fast path.*'packed'.*pack_weights"):
        EngineConfig(fast_paths_off=["packed"])
    with pytest.raises(InvalidOptionError, match="engine 'vllm'"):
        EngineConfig(engine="vllm", fast_paths_off=["llama_step"])
    assert EngineConfig(fast_paths_off=list(FAST_PATHS)).fast_paths_off == list(FAST_PATHS)


def test_make_policy_passes_the_switches_to_the_sampler(tiny_model, tokenizer):
    from agentenv.lm.engines import make_policy

    config = EngineConfig(fast_paths_off=["share_slots", "pack_weights"])
    policy = make_policy(config, tiny_model, tokenizer, model_name="tiny", dtype="float32")
    assert isinstance(policy, TransformersPolicy) and not policy.share_slots
    assert not any(isinstance(m, _PackedLinear) for m in policy.model.modules())


def test_the_cli_flag_reaches_the_generation_config():
    from agentenv.cli import _train_config, build_parser

    args = build_parser().parse_args(["train", "--fast-paths-off", "share_slots", "llama_step"])
    assert _train_config(args).generation.fast_paths_off == ["share_slots", "llama_step"]


def test_one_log_line_says_which_paths_run_and_why_the_others_do_not(lora_model, tokenizer, caplog):
    """A LoRA Llama in float32 on a CPU: every path runs but the ones switched off, and
    the line (info: nothing failed a precondition) names each switched-off one."""
    caplog.set_level("INFO", logger=sampler_module.__name__)
    policy = TransformersPolicy(lora_model, tokenizer, dtype="float32", share_slots=False)
    records = [r for r in caplog.records if r.name == sampler_module.__name__]
    assert [r.levelname for r in records] == ["INFO"]
    assert policy.fast_paths_missing == {}
    assert policy.fast_paths["share_slots"] == "switched off"
    packed = packs_linears("cpu", torch.float32)
    for name in ("pack_weights", "pack_qkv", "fold_lora"):
        assert (policy.fast_paths[name] is None) is packed
    for name in ("llama_step", "inplace_attention", "share_prefix", "reuse_cache", "drafting"):
        assert policy.fast_paths[name] is None, name
    assert "off: share_slots (switched off)" in records[0].getMessage()


def test_a_path_whose_precondition_fails_is_named_in_a_warning(
    lora_model, tokenizer, caplog, monkeypatch
):
    """No oneDNN in this torch build: packing (and what builds on it) is off, the sampler
    still draws, and one warning names the path and the reason."""
    import agentenv.lm.weights as weights

    monkeypatch.setattr(weights, "_onednn_linear", lambda: False)
    caplog.set_level("INFO", logger=sampler_module.__name__)
    policy = TransformersPolicy(lora_model, tokenizer, dtype="float32")
    records = [r for r in caplog.records if r.name == sampler_module.__name__]
    assert [r.levelname for r in records] == ["WARNING"]
    assert list(policy.fast_paths_missing) == ["pack_weights"]
    assert "oneDNN" in records[0].getMessage() and "pack_weights" in records[0].getMessage()
    assert policy.fast_paths["pack_qkv"] == policy.fast_paths["fold_lora"] == "needs pack_weights"
    assert not any(isinstance(m, _PackedLinear) for m in policy.model.modules())


def test_another_architecture_is_decoded_without_the_llama_step_and_says_so(tokenizer, caplog):
    from tiny_models import tiny_qwen2

    caplog.set_level("INFO", logger=sampler_module.__name__)
    policy = TransformersPolicy(tiny_qwen2(tokenizer), tokenizer, dtype="float32")
    assert policy.fast_paths_missing == {"llama_step": "Qwen2ForCausalLM is not a Llama model"}
    records = [r for r in caplog.records if r.name == sampler_module.__name__]
    assert [r.levelname for r in records] == ["WARNING"]
    assert "llama_step: Qwen2ForCausalLM is not a Llama model" in records[0].getMessage()
