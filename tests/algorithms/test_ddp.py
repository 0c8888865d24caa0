"""GRPO under DDP: 2 CPU processes (gloo) give the update of one process on the whole batch.

Rank 1's share holds only zero-variance groups for one of the splits, so this also checks
that a process with nothing to learn still joins every all-reduce (no hang).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, loss_type: str, processes: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if processes == 1:
        cmd = [sys.executable, str(WORKER), str(out), loss_type]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(processes), str(WORKER), str(out), loss_type,
        ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_processes_give_the_one_process_update(tmp_path, loss_type):
    one = run(tmp_path / "one.pt", loss_type, 1)
    two = run(tmp_path / "two.pt", loss_type, 2)
    assert two["world"] == 2 and one["world"] == 1
    for key in ("loss", "rewards/mean", "frac_reward_zero_std", "num_sequences"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7)
    assert two["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
    for name, g in one["grads"].items():
        scale = g.abs().max().item()
        torch.testing.assert_close(two["grads"][name], g, atol=1e-5 * scale + 1e-12, rtol=1e-4)
