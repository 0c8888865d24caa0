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
from devices import CPU_ONLY

WORKER = Path(__file__).with_name("ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]
FSDP2_TRAINER = ROOT / "tests" / "helpers" / "fsdp2_trainer.py"


def run(out: Path, args: str, processes: int, worker: Path = WORKER) -> dict:
    """Run ``worker OUT *args`` in ``processes`` processes; return what it saved to OUT."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers")])  # toy_episodes
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **CPU_ONLY}
    if processes == 1:
        cmd = [sys.executable, str(worker), str(out), *args.split()]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(processes), str(worker), str(out), *args.split(),
        ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


DDP_JOBS = "grpo:dapo grpo:grpo sft"


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> tuple[dict, dict]:
    """Every job of ddp_worker.py on 1 process and on 2, one launch each: ``(one, two)``."""
    out = tmp_path_factory.mktemp("ddp")
    return run(out / "one.pt", DDP_JOBS, 1), run(out / "two.pt", DDP_JOBS, 2)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_processes_give_the_one_process_update(ddp_runs, loss_type):
    one, two = (runs[f"grpo:{loss_type}"] for runs in ddp_runs)
    assert two["world"] == 2 and one["world"] == 1
    for key in ("loss", "rewards/mean", "frac_reward_zero_std", "num_sequences"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7)
    assert two["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
    for name, g in one["grads"].items():
        scale = g.abs().max().item()
        torch.testing.assert_close(two["grads"][name], g, atol=1e-5 * scale + 1e-12, rtol=1e-4)


def test_sft_on_uneven_shares_gives_the_one_process_update(ddp_runs):
    """SFT on 2 processes with 7 and 2 episodes (so different micro-batch counts) finishes
    and gives the gradient, loss and grad norm of one process on all 9."""
    one, two = (runs["sft"] for runs in ddp_runs)
    assert (one["world"], two["world"]) == (1, 2)
    for key in ("sft/loss", "sft/policy_tokens", "sft/grad_norm"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4)
    assert one["metrics"]["sft/grad_norm"] > 0
    for name, g in one["grads"].items():
        scale = g.abs().max().item()
        torch.testing.assert_close(two["grads"][name], g, atol=1e-5 * scale + 1e-12, rtol=1e-4)


def assert_same_adam_weights(got: dict, want: dict, steps: int, lr: float = 1e-2) -> None:
    """All but a handful of elements equal to 1e-4; none further apart than Adam can move
    them. Adam divides by sqrt(v): on an element whose gradient is near zero, the
    all-reduce's rounding becomes an update difference of up to lr per step. How many such
    elements there are depends on the kernels' summation order (4 of 3.2M in full fine-tuning
    with torch 2.13 / accelerate 1.15), so the bound is one in 100,000 elements (at least 3)."""
    off = total = 0
    for name, w in want.items():
        diff = (got[name] - w).abs()
        assert diff.max() <= 2 * lr * steps, name
        off += int((diff > 1e-4).sum())
        total += w.numel()
    assert off <= max(3, total // 100_000), (off, total)


FSDP2_KINDS = ("full", "lora_kl")  # lora_kl: LoRA, plus the KL term


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory) -> tuple[dict, dict, Path]:
    """tests/helpers/fsdp2_trainer.py's every kind, unsharded and on 2 processes (one launch
    each): ``(one, two, where two's checkpoints are)``."""
    out = tmp_path_factory.mktemp("fsdp2")
    kinds = " ".join(FSDP2_KINDS)
    one = run(out / "one.pt", f"plain {kinds}", 1, FSDP2_TRAINER)
    two = run(out / "two.pt", f"fsdp2 {kinds}", 2, FSDP2_TRAINER)
    return one, two, out / "two.pt"


@pytest.mark.parametrize("kind", FSDP2_KINDS)
def test_fsdp2_checkpoints_hold_the_one_process_weights_and_resume(fsdp2_runs, kind):
    """accelerate's FSDP2 on 2 CPU processes (tests/helpers/fsdp2_trainer.py): 2 GRPO steps,
    a checkpoint, a resumed third step. The checkpoint's weights, the weights after the
    resumed step, every step's loss and grad norm and the sampler's greedy tokens equal those
    of one unsharded process on the same batch; the checkpoint also resumes in a plain
    process."""
    from fsdp2_trainer import checkpoint
    from fsdp2_trainer import config as fsdp2_config
    from toy_episodes import SAMPLING

    from agentenv.lm.models import load_tokenizer, tiny_model
    from algorithms.grpo import GRPO

    one, two = fsdp2_runs[0][kind], fsdp2_runs[1][kind]
    assert (one["world"], two["world"]) == (1, 2)
    assert one["keys"] == ["int"] and two["keys"] == ["str"]  # by position / by name
    assert one["steps"] == two["steps"] == [2.0]  # AdamW's state after 2 steps
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4) and a["grad_norm"] > 0
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
    assert one["saved"].keys() == two["saved"].keys() and one["saved"]
    assert_same_adam_weights(two["saved"], one["saved"], steps=2)
    assert one["after"].keys() == two["after"].keys()
    assert_same_adam_weights(two["after"], one["after"], steps=3)
    moved = 0.0
    for name, w in one["after"].items():
        key = name.replace(".default.", ".")  # peft saves adapters without their name
        if key in one["saved"]:
            moved += (w - one["saved"][key]).abs().sum().item()
    assert moved > 0  # the resumed third step changed the loaded weights
    for (tokens, logps), (want, want_logps) in zip(two["sampled"], one["sampled"], strict=True):
        assert tokens == want and len(tokens) == 8  # the sampler gathered the whole policy
        torch.testing.assert_close(torch.tensor(logps), torch.tensor(want_logps), atol=1e-4, rtol=0)

    if kind == "lora_kl":
        assert all(m["kl"] > 0 for m in two["metrics"][1:])  # the KL term is live
    tokenizer = load_tokenizer()  # the FSDP2 checkpoint resumes without sharding too
    torch.manual_seed(0)
    plain = GRPO(tiny_model(tokenizer), tokenizer, fsdp2_config(kind), seed=1, sampling=SAMPLING)
    plain.load(checkpoint(str(fsdp2_runs[2]), kind))
    assert plain.step == 2
    state = plain.optimizer.state_dict()["state"]
    assert state and all(float(s["step"]) == 2.0 for s in state.values())
