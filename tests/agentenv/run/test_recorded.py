"""A checkpoint records the env and rollout settings its run trained with (run.json, or the
run directory's config.json for older ones), and `agentenv eval|demo --adapter` use them
unless told otherwise, saying so."""

import json

import pytest

from agentenv import config as config_lib
from agentenv.cli import main
from agentenv.errors import InvalidOptionError
from agentenv.lm import models
from agentenv.run.config import SFTRunConfig, TrainConfig
from agentenv.run.recorded import (
    check_checkpoint,
    checkpoint_env,
    recorded_run,
    run_record,
    take_recorded,
)
from algorithms.config import SFTConfig
from algorithms.sft import SFT

ENV = {"source": "word_problems", "prompt_style": "compact"}


def train_config(**kw):
    rollout = {"max_turns": 1, "max_episode_tokens": 300, "sampling": {"max_new_tokens": 4}}
    return TrainConfig(env_kwargs=ENV, rollout=rollout, **kw)


def test_run_record_holds_the_env_and_the_rollout_settings():
    record = run_record(config_lib.to_dict(train_config()))
    assert record == {
        "env_id": "Calculator-v0",
        "env_kwargs": ENV,
        "quantize": None,
        "max_turns": 1,
        "max_new_tokens": 4,
        "max_episode_tokens": 300,
    }
    sft = run_record(config_lib.to_dict(SFTRunConfig(env_kwargs=ENV)))
    assert sft == {"env_id": "Calculator-v0", "env_kwargs": ENV, "quantize": None}


def make_checkpoint(folder, record=None):
    (folder / "adapter").mkdir(parents=True)
    if record is not None:
        (folder / "run.json").write_text(json.dumps(record))
    return folder


def test_old_checkpoints_are_read_through_their_run_directory(tmp_path):
    """Checkpoints from before run.json: RUN/checkpoints/step_N and an SFT's RUN/checkpoint."""
    run = tmp_path / "run"
    step = make_checkpoint(run / "checkpoints" / "step_000002")
    (run / "config.json").write_text(json.dumps(config_lib.to_dict(train_config())))
    record, source = recorded_run(step)
    assert source == run / "config.json" and record["env_kwargs"] == ENV
    assert record["max_new_tokens"] == 4
    sft = tmp_path / "sft"
    make_checkpoint(sft / "checkpoint")
    (sft / "config.json").write_text(json.dumps(config_lib.to_dict(SFTRunConfig())))
    assert checkpoint_env(sft / "checkpoint") == {"env_id": "Calculator-v0", "env_kwargs": {}}
    assert recorded_run(make_checkpoint(tmp_path / "lone")) is None  # nothing recorded


def test_a_population_checkpoint_records_its_fittest_members_run(tmp_path):
    ckpt = tmp_path / "step_000004"
    for i, kwargs in enumerate([{"source": "prices"}, ENV]):
        make_checkpoint(ckpt / f"member_{i}", {"env_id": "Calculator-v0", "env_kwargs": kwargs})
    members = [{"index": i, "hyperparameters": {}, "fitness": [f]} for i, f in enumerate([0, 1])]
    (ckpt / "population.json").write_text(json.dumps({"step": 4, "members": members}))
    assert checkpoint_env(ckpt)["env_kwargs"] == ENV  # member_1, the fitter


def test_recorded_settings_yield_to_given_ones():
    record = run_record(config_lib.to_dict(train_config()))
    taken = take_recorded(record, {"max_turns": 3})
    assert taken == {k: record[k] for k in ("env_id", "env_kwargs", "max_new_tokens")} | {
        "max_episode_tokens": 300
    }
    # the same env, named with its namespace: its kwargs still apply
    assert take_recorded(record, {"env_id": "agentenv/Calculator-v0"})["env_kwargs"] == ENV
    assert "env_kwargs" not in take_recorded(record, {"env_id": "RAG-v0"})  # another env
    assert "env_kwargs" not in take_recorded(record, {"env_kwargs": {"source": "prices"}})


def test_a_missing_or_bad_checkpoint_names_the_flag_and_the_path(tmp_path):
    with pytest.raises(InvalidOptionError, match=r"--adapter .*gone: no such folder"):
        check_checkpoint(tmp_path / "gone", "--adapter")
    with pytest.raises(InvalidOptionError, match="--init-from .* neither adapter/ nor model/"):
        check_checkpoint(tmp_path, "--init-from")
    check_checkpoint(None, "--adapter")
    check_checkpoint(make_checkpoint(tmp_path / "ok"), "--adapter")


@pytest.mark.parametrize("command", ["eval", "demo"])
def test_a_missing_adapter_fails_before_the_model_loads(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("model loaded"))
    assert main([command, "--adapter", str(tmp_path / "nope")]) == 2
    assert f"--adapter {tmp_path / 'nope'}: no such folder" in capsys.readouterr().err


def test_a_missing_init_from_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("model loaded"))
    flags = ["--init-from", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "run")]
    assert main(["train", *flags]) == 2
    assert f"--init-from {tmp_path / 'nope'}: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory):
    """A LoRA checkpoint written by the trainer with a run's record: run.json inside."""
    model, tokenizer = models.load(tiny_model_dir, dtype="float32")
    trainer = SFT(model, tokenizer, SFTConfig(), seed=0)
    trainer.run_record = run_record(config_lib.to_dict(train_config()))
    return trainer.save(tmp_path_factory.mktemp("ckpt") / "checkpoint")


def test_the_trainer_writes_its_run_record_into_the_checkpoint(checkpoint):
    record = json.loads((checkpoint / "run.json").read_text())
    assert record["env_kwargs"] == ENV and record["max_new_tokens"] == 4


def test_eval_with_an_adapter_uses_the_env_it_trained_on_and_says_so(
    checkpoint, tiny_model_dir, tmp_path, capsys
):
    """Without the record, eval scored the default task set (gsm_symbolic) silently."""
    out = tmp_path / "report.json"
    flags = ["--model", tiny_model_dir, "--adapter", str(checkpoint), "--num-tasks", "2"]
    assert main(["eval", *flags, "--dtype", "float32", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    note = f"note: using the env the checkpoint trained on: Calculator-v0 {json.dumps(ENV)}"
    assert note in captured.err
    assert "max_new_tokens 4" in captured.err and "pass --env-id/--env-kwargs/" in captured.err
    config = json.loads(out.read_text())["config"]
    assert config["env_id"] == "Calculator-v0" and config["env_kwargs"] == ENV
    assert (config["max_turns"], config["max_new_tokens"], config["max_episode_tokens"]) == (
        1,
        4,
        300,
    )
    assert config["adapter"] == str(checkpoint) and config["split"] == "test"
    assert f"env:     Calculator-v0 {json.dumps(ENV)}" in captured.out
    assert f"adapter: {checkpoint}" in captured.out
    # given kwargs win (the env id still comes from the checkpoint)
    kwargs = json.dumps({"source": "prices"})
    assert main(["eval", *flags, "--env-kwargs", kwargs, "--output", str(out)]) == 0
    assert json.dumps(ENV) not in capsys.readouterr().err
    assert json.loads(out.read_text())["config"]["env_kwargs"] == {"source": "prices"}


def test_demo_with_an_adapter_plays_the_env_it_trained_on(
    checkpoint, tiny_model_dir, monkeypatch, capsys
):
    from agentenv.env import play

    played = {}

    def fake_play(env, policy, *, seed=None, max_steps=100):
        played.update(source=env.source, max_steps=max_steps, tokens=policy.max_new_tokens)
        raise SystemExit(0)

    monkeypatch.setattr(play, "play_episode", fake_play)
    with pytest.raises(SystemExit):
        main(["demo", "--model", tiny_model_dir, "--adapter", str(checkpoint)])
    assert "the env the checkpoint trained on: Calculator-v0" in capsys.readouterr().err
    assert played == {"source": "word_problems", "max_steps": 1, "tokens": 4}


def test_demo_of_a_mixture_checkpoint_plays_one_of_its_envs(
    checkpoint, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """Before, a mixture's checkpoint played the default Calculator task set (gsm_symbolic)."""
    import shutil

    from agentenv.env import play

    mixture = tmp_path / "mixture"
    shutil.copytree(checkpoint, mixture)
    envs = [
        {"name": "wp", "env_id": "Calculator-v0", "env_kwargs": ENV, "max_turns": 2},
        {"name": "prices", "env_id": "Calculator-v0", "env_kwargs": {"source": "prices"}},
    ]
    record = {"env_id": "Calculator-v0", "envs": envs, "max_turns": 5, "max_new_tokens": 4}
    (mixture / "run.json").write_text(json.dumps(record))
    played = {}

    def fake_play(env, policy, *, seed=None, max_steps=100):
        played.update(source=env.source, max_steps=max_steps, tokens=policy.max_new_tokens)
        raise SystemExit(0)

    monkeypatch.setattr(play, "play_episode", fake_play)
    flags = ["--model", tiny_model_dir, "--adapter", str(mixture)]
    with pytest.raises(SystemExit):
        main(["demo", *flags])
    err = capsys.readouterr().err
    assert "trained on a mixture (wp, prices); this plays wp (name another, e.g. `prices`" in err
    assert played == {"source": "word_problems", "max_steps": 2, "tokens": 4}  # its own turns
    with pytest.raises(SystemExit):
        main(["demo", "prices", *flags])
    assert "this plays prices" in capsys.readouterr().err
    assert played == {"source": "prices", "max_steps": 5, "tokens": 4}  # the run's turns


def test_export_says_which_env_the_checkpoint_trained_on(checkpoint, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", str(checkpoint), str(out)]) == 0
    trained_on = f"Calculator-v0 {json.dumps(ENV)}"
    assert f"note: {checkpoint} trained on {trained_on}" in capsys.readouterr().err
    assert f"Trained on: `{trained_on}`" in (out / "README.md").read_text()
    assert main(["export", str(tmp_path / "gone"), str(tmp_path / "x")]) == 2
    assert f"CHECKPOINT {tmp_path / 'gone'}: no such folder" in capsys.readouterr().err
