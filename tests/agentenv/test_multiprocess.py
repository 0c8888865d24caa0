"""`agentenv train` under `accelerate launch` with 2 CPU processes (gloo), tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

from agentenv.train import task_seeds, task_share
from algorithms.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_process_shares_are_disjoint_and_cover_the_step():
    for world in (1, 2, 4):
        shares = [task_share(0, 3, 8, rank, world) for rank in range(world)]
        assert sorted(s for share in shares for s in share) == sorted(task_seeds(0, 3, 8))
        assert all(len(share) == 8 // world for share in shares)


def launch(processes: int, out: Path, model: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if processes > 1:
        cmd += ["--multi_gpu", "--num_processes", str(processes)]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["-m", "agentenv.cli", "train", "--model", model, "--batch-size", "2"]
    cmd += ["--group-size", "2", "--max-new-tokens", "4", "--eval-tasks", "0"]
    cmd += ["--save-every", "1", "--output-dir", str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_two_processes_split_the_tasks_and_only_the_main_one_writes(tiny_model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for processes, out in ((1, one), (2, two)):
        proc = launch(processes, out, tiny_model_dir, "--steps", "2")
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (two / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]  # one row per step, not one per process
    for step in (1, 2):  # the main process logs its share: 1 task x G=2 of the 2 tasks
        name = f"episodes/step_{step:06d}.jsonl"
        assert len((two / name).read_text().splitlines()) == 2
        assert len((one / name).read_text().splitlines()) == 4
    assert json.loads((two / "config.json").read_text())["batch_size"] == 2

    proc = launch(2, two, tiny_model_dir, "--steps", "3", "--resume")  # resume, 2 processes
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (two / "metrics.jsonl").open()] == [1, 2, 3]
    assert latest_checkpoint(two / "checkpoints").name == "step_000003"

    proc = launch(2, tmp_path / "odd", tiny_model_dir, "--steps", "1", "--batch-size", "3")
    assert proc.returncode != 0 and "multiple of the 2 processes" in proc.stderr
