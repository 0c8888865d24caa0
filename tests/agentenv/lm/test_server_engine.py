"""An OpenAI-compatible server as the engine, against a real vLLM server on 127.0.0.1.

The server runs vLLM's own ``api_server`` from a Python that imports vllm (see
``tests/helpers/vllm_server.py``); the tests that need it skip with the reason where
there is none. The others check what fails before any model loads.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import urllib.request

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
from vllm_server import VLLMServer, free_port, vllm_python

import agentenv
from agentenv.errors import EngineError, InvalidOptionError
from agentenv.lm.backend import EngineConfig
from envs.calculator import CalculatorEnv

PYTHON, WHY = vllm_python()
needs_server = pytest.mark.skipif(PYTHON is None, reason=WHY)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    return save_small(tokenizer, tmp_path_factory.mktemp("served-tiny"))


KEY = "sk-agentenv-test"  # the module's server asks for it, as `vllm serve --api-key` does
KEY_ENV = "AGENTENV_TEST_SERVER_KEY"  # the variable a run's server_api_key_env names


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """The module's server (asking for an API key) and a spare one without a key for the
    test that kills a server, launched together: a start takes tens of seconds."""
    assert PYTHON is not None
    log = tmp_path_factory.mktemp("log")
    keyed = VLLMServer(PYTHON, model_dir, log / "server.log", api_key=KEY).launch()
    spare = VLLMServer(PYTHON, model_dir, log / "spare.log").launch()
    try:
        yield keyed.wait(), spare.wait()
    finally:
        keyed.stop()
        spare.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def policy_for(model, tokenizer, server, **kwargs):
    from agentenv.lm.server_engine import ServerPolicy

    return ServerPolicy(model, tokenizer, url=server.url, api_key=KEY, **kwargs)


def lora(model, r=4):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    )


# ---- what fails before a model loads (no server needed) ----------------------------


def test_engine_server_needs_a_url_and_its_key_variable_set(monkeypatch):
    with pytest.raises(InvalidOptionError, match="server_url"):
        EngineConfig(engine="server")
    monkeypatch.delenv("AGENTENV_NO_SUCH_KEY", raising=False)
    with pytest.raises(InvalidOptionError, match="export AGENTENV_NO_SUCH_KEY=<key>"):
        EngineConfig(
            engine="server",
            server_url="http://127.0.0.1:1/v1",
            server_api_key_env="AGENTENV_NO_SUCH_KEY",
        )
    with pytest.raises(InvalidOptionError, match="server_timeout_s"):
        EngineConfig(engine="server", server_url="http://127.0.0.1:1/v1", server_timeout_s=0)


def test_a_url_where_nothing_answers_fails_naming_it_and_the_fix():
    from agentenv.lm.engines import check_engine

    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(EngineError, match=f"no answer from {url}/models.*Is the server running"):
        check_engine(EngineConfig(engine="server", server_url=url))
    with pytest.raises(InvalidOptionError, match="must be an http"):
        check_engine(EngineConfig(engine="server", server_url="127.0.0.1:8000"))


def test_train_refuses_full_fine_tuning_and_a_dead_server_before_loading_a_model(tmp_path):
    from agentenv.run.config import TrainConfig
    from agentenv.run.train import train

    url = f"http://127.0.0.1:{free_port()}/v1"
    base = {
        "model": "no/such-model",  # loading it would fail with another error
        "output_dir": str(tmp_path / "run"),
        "generation": {"engine": "server", "server_url": url},
    }
    full = TrainConfig(**{**base, "grpo": {"use_lora": False}})
    with pytest.raises(InvalidOptionError, match="only a LoRA adapter.*use_lora true"):
        train(config=full)
    with pytest.raises(EngineError, match=f"no answer from {url}"):
        train(config=TrainConfig(**base))


# ---- against a real server ---------------------------------------------------------


@needs_server
def test_tokens_and_logprobs_match_the_trainers_and_seeds_reproduce(tokenizer, server):
    model = small(tokenizer)
    check_tokens_logprobs_and_seeds(policy_for(model, tokenizer, server), model, tokenizer)


@needs_server
def test_a_stop_string_ends_the_turn_at_the_token_that_completes_it(tokenizer, server):
    model = small(tokenizer)
    check_stop_string(policy_for(model, tokenizer, server), tokenizer)


def _lora_loads(server) -> int:
    """Adapters the server has loaded so far (its log says so for each)."""
    return server.log.read_text().count("Loaded new LoRA adapter")


def _listed(server) -> set[str]:
    request = urllib.request.Request(f"{server.url}/models", headers=server.headers)
    with urllib.request.urlopen(request, timeout=10) as reply:
        return {m["id"] for m in json.load(reply)["data"]}


@needs_server
def test_after_an_optimizer_step_the_server_samples_the_new_adapter(tokenizer, server, tmp_path):
    model = lora(small(tokenizer))
    policy = policy_for(model, tokenizer, server, adapter_dir=tmp_path / "adapters")
    prompt = prompts(tokenizer)[0]
    before = policy.generate([prompt], SAMPLING, seeds=[1])[0]
    assert policy.syncs == 1  # the adapter as it starts (lora_B = 0: the base model)
    first = policy.model_name
    assert first in _listed(server)
    policy.generate([prompt], SAMPLING, seeds=[1])
    assert policy.syncs == 1  # unchanged: not sent again
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.tensor([[*prompt, *before.token_ids]])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    (-torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).sum()).backward()
    optimizer.step()
    with torch.no_grad():  # and a push away from the base, so the samples must change
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    after = policy.generate([prompt], SAMPLING, seeds=[1])[0]
    assert policy.syncs == 2
    want = recomputed(model, prompt, after)
    torch.testing.assert_close(torch.tensor(after.sampler_logprobs), want, atol=1e-4, rtol=0)
    assert after.sampler_logprobs != pytest.approx(before.sampler_logprobs, abs=1e-3)
    listed = _listed(server)  # the old version is unloaded and its folder removed
    assert policy.model_name in listed and first not in listed
    assert [p.name for p in (tmp_path / "adapters").iterdir()] == [policy.model_name]
    policy.close()
    assert policy.model_name not in _listed(server)
    assert (tmp_path / "adapters").is_dir()  # the caller's folder stays; its adapter goes
    assert not any((tmp_path / "adapters").iterdir())


@needs_server
def test_the_engines_own_adapter_folder_goes_with_it_even_without_close(tokenizer, server):
    model = lora(small(tokenizer))
    policy = policy_for(model, tokenizer, server)
    policy.generate([prompts(tokenizer)[0]], SAMPLING, seeds=[1])  # writes an adapter there
    own, name = policy.adapter_dir, policy.model_name
    assert own.name.startswith("agentenv-adapters-") and any(own.iterdir())
    del policy  # never closed: a test, a notebook, an exception before close()
    gc.collect()
    assert not own.exists()
    from agentenv.lm.server_engine import _request  # unloaded here, as close() would

    _request(f"{server.url}/unload_lora_adapter", {"lora_name": name}, 10, KEY)
    assert name not in _listed(server)


@needs_server
def test_collect_sends_each_episodes_turn_as_its_env_answers(tokenizer, server):
    """Continuous batching over the server: one request in flight per episode."""
    model = small(tokenizer)
    check_continuous_collection(policy_for(model, tokenizer, server), model, tokenizer)


KILL = {"server": None}  # the server the next step of a KillsServer env kills


class KillsServer(CalculatorEnv):
    """The Calculator, except that a step kills ``KILL["server"]`` (once) and asks for
    another turn: the server dies in the middle of a rollout."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        server, KILL["server"] = KILL["server"], None
        if server is not None:
            server.stop()
            return obs, reward, False, False, info
        return obs, reward, terminated, truncated, info


agentenv.register("KillsServer-v0", entry_point=KillsServer, override=True)


@needs_server
def test_a_server_dying_mid_rollout_stops_the_run_clearly_and_it_resumes(
    tokenizer, model_dir, servers, tmp_path, monkeypatch
):
    from agentenv.run.config import TrainConfig
    from agentenv.run.tracking import read_metrics
    from agentenv.run.train import train

    server, first = servers  # first: the one this test kills
    config = TrainConfig(
        env_id="KillsServer-v0",
        model=model_dir,
        dtype="float32",
        env_kwargs={"prompt_style": "compact"},
        steps=3,
        batch_size=1,
        save_every=1,
        rollout={"group_size": 2, "max_turns": 2, "sampling": {"max_new_tokens": 6}},
        eval_tasks=0,
        output_dir=str(tmp_path / "run"),
        grpo={"learning_rate": 1e-2, "lora_r": 4},
        generation={"engine": "server", "server_url": first.url},
    )
    try:
        train(config=dataclasses.replace(config, steps=2))
        KILL["server"] = first  # step 3: an env step kills it, the next turn finds it dead
        with pytest.raises(EngineError, match=f"no answer from {first.url}.*--resume"):
            train(config=config, resume=True)
    finally:
        KILL["server"] = None
        first.stop()
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step_000001", "step_000002"]  # nothing half-written
    # the run resumes on another server (the module's), which asks for an API key: the
    # run reads it from the variable named
    generation = {"engine": "server", "server_url": server.url}
    with pytest.raises(EngineError, match="answered 401"):
        train(config=dataclasses.replace(config, generation=generation), resume=True)
    monkeypatch.setenv(KEY_ENV, KEY)
    generation["server_api_key_env"] = KEY_ENV
    train(config=dataclasses.replace(config, generation=generation), resume=True)
    assert KEY not in (tmp_path / "run" / "config.json").read_text()
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["rollout/tokens"] > 0 for r in rows)
    assert all(r["sampler/logprob_abs_diff_mean"] < 1e-3 for r in rows)
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints[-1] == "step_000003"
    assert not any(name.startswith("agentenv-") for name in _listed(server))  # unloaded


@needs_server
def test_agentenv_eval_on_the_server_with_an_adapter_unloads_it_after(
    tokenizer, model_dir, server, tmp_path, monkeypatch
):
    """``agentenv eval --engine server --adapter ...``: the adapter is what the server
    samples (loaded before the first turn), and it is unloaded when eval ends."""
    from agentenv.cli import main
    from agentenv.run.evaluate import EvalReport

    checkpoint = tmp_path / "checkpoint"  # as agentenv sft / train write one
    with torch.no_grad():
        model = lora(small(tokenizer))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(checkpoint / "adapter")
    out = tmp_path / "eval.json"
    loads = _lora_loads(server)
    argv = ["eval", "Calculator-v0", "--model", model_dir, "--adapter", str(checkpoint)]
    argv += ["--engine", "server", "--server-url", server.url, "--num-tasks", "2"]
    argv += ["--max-new-tokens", "8", "--output", str(out), "--server-api-key-env", KEY_ENV]
    monkeypatch.setenv(KEY_ENV, KEY)
    assert main(argv) == 0
    assert len(EvalReport.load(out).per_task) == 2
    assert _lora_loads(server) == loads + 1  # the adapter, once, before the first turn
    assert not any(name.startswith("agentenv-") for name in _listed(server))
