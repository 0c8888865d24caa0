"""End-to-end: the training loop, SFT warm start, resume, artifacts, CLI (tiny model)."""

import json

import pytest

from agentenv.cli import main
from agentenv.errors import InvalidOptionError
from agentenv.tracking import read_metrics
from agentenv.train import TrainConfig, task_seeds, train
from algorithms.checkpoint import latest_checkpoint

ENV = {"source": "word_problems", "prompt_style": "compact"}


def config(model_dir, out, **kw):
    base = dict(
        model=model_dir,
        env_kwargs=ENV,
        steps=2,
        batch_size=2,
        group_size=2,
        max_turns=2,
        max_new_tokens=6,
        max_episode_tokens=256,
        eval_tasks=3,
        save_every=1,
        log_episodes=3,
        output_dir=str(out),
        grpo={"learning_rate": 1e-3},
    )
    return TrainConfig(**{**base, **kw})


def test_two_step_run_writes_every_artifact(tiny_model_dir, tmp_path, capsys):
    run = train(config=config(tiny_model_dir, tmp_path / "run"))
    saved = json.loads((run / "config.json").read_text())
    assert saved["steps"] == 2 and saved["env_kwargs"] == ENV
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 2]  # eval before, 2 steps, eval after
    step_row = rows[1]
    for key in (
        "loss",
        "kl",
        "rewards/mean",
        "rollout/generate_s",
        "episodes/correct_rate",
        "tokens_per_second",
        "time/step_s",
        "clip_ratio/high_mean",
    ):
        assert key in step_row
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    assert list((run / "tb").glob("events.out.tfevents.*"))
    episodes = [json.loads(x) for x in (run / "episodes" / "step_000002.jsonl").open()]
    assert len(episodes) == 3
    ep = episodes[0]
    assert len(ep["input_ids"]) == len(ep["action_mask"]) == len(ep["tokens"])
    assert ep["advantage"] is not None and ep["messages"][0]["role"] == "system"
    assert {p.name for p in (run / "plots").glob("*.png")} >= {
        "reward.png",
        "eval_accuracy.png",
        "kl.png",
        "loss.png",
        "tokens_per_second.png",
    }
    assert latest_checkpoint(run / "checkpoints").name == "step_000002"
    assert (run / "eval" / "before.json").exists() and (run / "eval" / "after.json").exists()
    out = capsys.readouterr().out
    assert "accuracy diff (b-a)" in out and "plots:" in out
    assert main(["show", str(run), "--step", "1"]) == 0
    html = (run / "viewer" / "step_000001.html").read_text()
    assert "class='p'" in html and "class='e'" in html
    assert main(["show", str(run), "--step", "9"]) == 2  # clear error, lists steps
    assert main(["plot", str(run)]) == 0


def test_resume_after_kill_continues_at_the_right_step(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    train(config=config(tiny_model_dir, out, steps=2, eval_tasks=0))
    # a kill during the step-3 save leaves a half-written folder: never picked up
    partial = out / "checkpoints" / "step_000003.tmp-999"
    partial.mkdir()
    (partial / "optimizer.pt").write_text("torn")
    train(config=config(tiny_model_dir, out, steps=3, eval_tasks=0), resume=True)
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == [1, 2, 3]  # no step repeated or skipped
    state = json.loads((latest_checkpoint(out / "checkpoints") / "trainer_state.json").read_text())
    assert state["step"] == 3
    assert task_seeds(0, 2, 2) == task_seeds(0, 2, 2) != task_seeds(0, 1, 2)


def test_resume_without_a_run_is_a_clear_error(tiny_model_dir, tmp_path):
    with pytest.raises(InvalidOptionError, match="existing run"):
        train(config=config(tiny_model_dir, tmp_path / "none"), resume=True)


def test_sft_then_init_from_and_eval_adapter(tiny_model_dir, tmp_path, capsys):
    assert (
        main(
            [
                "sft",
                "Calculator-v0",
                "--model",
                tiny_model_dir,
                "--env-kwargs",
                json.dumps(ENV),
                "--num-demos",
                "6",
                "--epochs",
                "1",
                "--output-dir",
                str(tmp_path / "sft"),
            ]
        )
        == 0
    )
    ckpt = tmp_path / "sft" / "checkpoint"
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists()
    sft_rows = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").open()]
    assert sft_rows and all(r["sft/loss"] > 0 for r in sft_rows)
    run = train(
        config=config(tiny_model_dir, tmp_path / "grpo", steps=1, eval_tasks=0, init_from=str(ckpt))
    )
    assert latest_checkpoint(run / "checkpoints") is not None
    report = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                "Calculator-v0",
                "--model",
                tiny_model_dir,
                "--adapter",
                str(ckpt),
                "--env-kwargs",
                json.dumps(ENV),
                "--num-tasks",
                "3",
                "--max-new-tokens",
                "4",
                "--output",
                str(report),
            ]
        )
        == 0
    )
    data = json.loads(report.read_text())
    assert data["metrics"]["num_tasks"] == 3 and len(data["per_task"]) == 3
    assert main(["eval", "--compare", str(report), str(report)]) == 0
    assert "accuracy diff (b-a)" in capsys.readouterr().out


def test_config_file_and_validation(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\ngrpo:\n  loss_type: grpo\n")
    cfg = TrainConfig.from_file(path, batch_size=3)
    assert (cfg.steps, cfg.batch_size, cfg.grpo) == (7, 3, {"loss_type": "grpo"})
    path.write_text("stepz: 7\n")
    with pytest.raises(InvalidOptionError, match="unknown config key"):
        TrainConfig.from_file(path)
    with pytest.raises(InvalidOptionError, match="steps"):
        TrainConfig(steps=0)


def test_quickstart_reports_the_share_of_groups_with_a_learning_signal(tmp_path, capsys):
    from agentenv.cli import _print_learning_signal

    rows = [
        {"step": 0, "eval/accuracy": 0.1},
        {"step": 1, "rewards/mean": 0.0, "frac_reward_zero_std": 1.0},
        {"step": 2, "rewards/mean": 0.25, "frac_reward_zero_std": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _print_learning_signal(tmp_path)
    out = capsys.readouterr().out
    assert "reward per step: 0.00 0.25;" in out
    assert "(reward variance > 0): 25%." in out


def test_quickstart_says_whether_the_held_out_gain_is_significant(tmp_path, capsys):
    from agentenv.cli import _print_learning_signal
    from agentenv.evaluate import EvalReport

    (tmp_path / "metrics.jsonl").write_text("")
    EvalReport({}, [0.0, 0.0, 1.0, 0.0]).save(tmp_path / "eval" / "before.json")
    EvalReport({}, [1.0, 1.0, 1.0, 0.0]).save(tmp_path / "eval" / "after.json")
    _print_learning_signal(tmp_path)
    out = capsys.readouterr().out  # diffs 1,1,0,0: mean 0.5, stderr sqrt(1/3 / 4) = 0.289
    assert "+0.500 ± 0.289 (paired stderr): NOT more than 2 standard errors" in out
    EvalReport({}, [1.0] * 4).save(tmp_path / "eval" / "after.json")
    EvalReport({}, [0.0] * 4).save(tmp_path / "eval" / "before.json")
    _print_learning_signal(tmp_path)
    assert "+1.000 ± 0.000 (paired stderr): more than 2" in capsys.readouterr().out
