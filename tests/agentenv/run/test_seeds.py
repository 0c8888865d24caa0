"""``agentenv seeds``: a recipe over several seeds, and the arms' report by hand."""

from __future__ import annotations

import json
import math

import pytest

from agentenv.cli import main
from agentenv.errors import InvalidOptionError
from agentenv.run.evaluate import EvalReport
from agentenv.run.seeds import Arm, format_arms, paired, summary, train_cost

ENV = {"source": "word_problems", "prompt_style": "compact"}


def report(per_task: list[float], label: str = "", **metrics: float) -> EvalReport:
    accuracy = sum(per_task) / len(per_task)
    return EvalReport({"accuracy": accuracy, **metrics}, per_task, label=label)


def write_arm(folder, per_seed: dict[int, list[float]], **metrics) -> None:
    for seed, per_task in per_seed.items():
        report(per_task, **metrics).save(folder / f"seed_{seed}" / "eval.json")
    (folder / f"seed_{min(per_seed)}" / "cost.json").write_text(
        json.dumps({"wall_s": 2400.0, "peak_rss_gb": 5.5})
    )


def test_mean_sd_and_min_by_hand():
    s = summary([0.353, 0.038])
    assert s["mean"] == pytest.approx(0.1955)
    assert s["sd"] == pytest.approx(0.315 / math.sqrt(2))  # n - 1: |a - b| / sqrt(2)
    assert s["min"] == 0.038
    assert math.isnan(summary([0.4])["sd"])
    three = summary([0.1, 0.2, 0.6])  # mean 0.3; squares 0.04, 0.01, 0.09 over 2
    assert three["mean"] == pytest.approx(0.3) and three["sd"] == pytest.approx(0.07**0.5)


def test_paired_differences_against_the_baseline_by_hand(tmp_path):
    """Seed 0 gains on tasks 0 and 3: diffs 1, 0, 0, 1, mean 0.5, sample variance 1/3,
    stderr sqrt(1/3 / 4); seed 1 equals the baseline: 0 +- 0."""
    baseline = report([0, 0, 1, 0], label="sft")
    write_arm(tmp_path / "gae", {0: [1, 0, 1, 1], 1: [0, 0, 1, 0]}, second_hop_recall=0.25)
    arm = Arm.load(tmp_path / "gae")
    assert list(arm.seeds) == [0, 1] and arm.label == "gae"
    diffs = paired(arm, baseline)
    assert diffs[0] == (pytest.approx(0.5), pytest.approx(math.sqrt(1 / 12)))
    assert diffs[1] == (0.0, 0.0)
    text = format_arms([arm], baseline)
    assert text.splitlines() == [
        "baseline sft: accuracy 0.250",
        "gae: seeds 0, 1: 0.750 / 0.250; mean 0.500 ± 0.354, min 0.250; vs baseline "
        "+0.500 ± 0.289 / +0.000 ± 0.000; second_hop_recall 0.250 / 0.250; train 40 min 5.5 GB",
    ]
    with pytest.raises(InvalidOptionError, match="different task counts"):
        paired(arm, report([0, 1]))


def test_part_reports_one_env_of_a_mixture_arm_against_a_one_env_baseline(tmp_path, capsys):
    """A schedule arm's eval reports cover two envs; --part bridge compares the bridge part
    (2 of 4 right, the baseline 1: +0.25) rather than the pooled tasks (6 of them)."""
    from dataclasses import asdict

    single, bridge = report([1, 1], label="single"), report([1, 0, 0, 1], label="bridge")
    pooled = EvalReport({"accuracy": 4 / 6}, [1, 1, 1, 0, 0, 1], label="mix")
    pooled.by_env = {"single": asdict(single), "bridge": asdict(bridge)}
    pooled.save(tmp_path / "sched" / "seed_0" / "eval.json")
    baseline = report([0, 0, 0, 1], label="sft")
    baseline.save(tmp_path / "sft.json")
    arm = Arm.load(tmp_path / "sched", part="bridge")
    assert arm.label == "sched/bridge" and arm.accuracies() == [0.5]
    assert paired(arm, baseline)[0][0] == pytest.approx(0.25)
    with pytest.raises(InvalidOptionError, match="different task counts"):
        paired(Arm.load(tmp_path / "sched"), baseline)  # the pooled report: 6 tasks
    with pytest.raises(InvalidOptionError, match="no env 'brige'; it has single, bridge"):
        Arm.load(tmp_path / "sched", part="brige")
    args = ["seeds", "--report", str(tmp_path / "sched"), "--part", "bridge"]
    assert main([*args, "--baseline", str(tmp_path / "sft.json")]) == 0
    assert "sched/bridge: seeds 0: 0.500; mean 0.500, min 0.500; vs baseline +0.250" in (
        capsys.readouterr().out
    )


def test_an_arm_without_evaluated_seeds_names_the_command(tmp_path):
    with pytest.raises(InvalidOptionError, match="agentenv seeds"):
        Arm.load(tmp_path)


def test_seeds_needs_train_arguments_and_an_output_dir_before_any_run(tmp_path, capsys):
    assert main(["seeds", "--seeds", "0"]) == 2
    assert "arguments after --" in capsys.readouterr().err
    assert main(["seeds", "--seeds", "0", "--", "--steps", "1"]) == 2
    assert "--output-dir OUT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["seeds", "--", "--steps", "1", "--learnin-rate", "1", "--output-dir", "x"])
    assert "--learning-rate" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_seeds_runs_each_seed_into_its_folder_and_reports_the_arm(tiny_model_dir, tmp_path, capsys):
    """Two seeds at once (each its own process), evaluated on 3 test tasks; run again,
    the command finds both done and only reports; --report reads the arm."""
    arm = tmp_path / "arm"
    train = ["--model", tiny_model_dir, "--env-kwargs", json.dumps(ENV), "--steps", "1"]
    train += ["--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4"]
    train += ["--eval-tasks", "0", "--log-episodes", "0", "--seed", "7"]
    train += ["--output-dir", str(arm)]
    args = ["seeds", "--seeds", "0", "1", "--eval-tasks", "3", "--jobs", "2", "--", *train]
    assert main(args) == 0
    out = capsys.readouterr().out
    for seed in (0, 1):
        folder = arm / f"seed_{seed}"
        config = json.loads((folder / "config.json").read_text())
        assert config["seed"] == seed and config["output_dir"] == str(folder)  # not 7, not arm
        saved = EvalReport.load(folder / "eval.json")
        assert len(saved.per_task) == 3 and saved.config["env_kwargs"] == ENV
        assert saved.config["adapter"].endswith("checkpoints/step_000001")
        cost = json.loads((folder / "cost.json").read_text())
        assert cost["wall_s"] > 0 and cost["peak_rss_gb"] > 0.1
        assert f"seed {seed}: accuracy" in out
    assert "arm: seeds 0, 1:" in out
    assert main(args) == 0  # both done: nothing runs again
    assert "seed 0: accuracy" not in capsys.readouterr().out
    assert main(["seeds", "--report", str(arm)]) == 0
    assert capsys.readouterr().out.startswith("arm: seeds 0, 1:")


def test_a_resumed_seed_reports_the_sum_of_its_step_times(tmp_path):
    """The resumed process saw only the last part (here 300 s); metrics.jsonl holds every
    step (100 + 200 + 300 s), and the report shows that in place of the wall."""
    folder = tmp_path / "seed_0"
    folder.mkdir()
    rows = [{"step": s, "time/step_s": t} for s, t in ((1, 100.0), (2, 200.0), (3, 300.0))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    last_part = {"wall_s": 330.0, "peak_rss_gb": 4.2}

    assert train_cost(last_part, folder, resumed=False) == last_part
    cost = train_cost(last_part, folder, resumed=True)
    assert cost == {"wall_s": 330.0, "peak_rss_gb": 4.2, "resumed": 1.0, "steps_s": 600.0}
    arm = Arm("arm", {0: report([1.0, 0.0])}, {0: cost})
    assert format_arms([arm]).endswith(
        "train 10 min (resumed: its step times) 4.2 GB (its last part)"
    )
    arm = Arm("arm", {0: report([1.0, 0.0])}, {0: last_part})
    assert format_arms([arm]).endswith("train 6 min 4.2 GB")
