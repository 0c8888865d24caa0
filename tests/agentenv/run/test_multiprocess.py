"""`agentenv train` under `accelerate launch` with 2 CPU processes (gloo), tiny model."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from devices import CPU_ONLY
from draws import assert_same_episode_draws
from run_metrics import untimed_metrics

from agentenv.lm.backend import SamplingConfig
from agentenv.rollout.episode import Episode
from agentenv.run.train import sampling_seed, task_seeds, task_share
from algorithms.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[3]


def test_process_shares_are_disjoint_and_cover_the_step():
    for world in (1, 2, 4):
        shares = [task_share(0, 3, 8, rank, world) for rank in range(world)]
        assert sorted(s for share in shares for s in share) == sorted(task_seeds(0, 3, 8))
        assert all(len(share) == 8 // world for share in shares)


def launch(
    processes: int, out: Path, model: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``agentenv train`` on a tiny model under ``accelerate launch``."""
    args = ["train", "--model", model, "--batch-size", "2", "--group-size", "2"]
    args += ["--max-new-tokens", "4", "--eval-tasks", "0", "--save-every", "1"]
    return accelerate_launch(processes, *args, "--output-dir", str(out), *extra, env=env)


def accelerate_launch(
    processes: int, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``agentenv ARGS`` under ``accelerate launch`` with ``processes`` CPU processes."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers")])  # coin_env
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **CPU_ONLY, **(env or {})}
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if processes > 1:
        cmd += ["--multi_gpu", "--num_processes", str(processes)]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["-m", "agentenv.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_a_batch_that_two_processes_cannot_split_evenly_is_refused(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """Under the WORLD_SIZE and RANK a launcher sets (accelerate launch, torchrun), before
    any model loads: so one process shows it (no launch needed)."""
    from agentenv.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    args = ["train", "--model", tiny_model_dir, "--steps", "1", "--batch-size", "3"]
    assert main([*args, "--output-dir", str(tmp_path / "odd")]) == 2
    err = capsys.readouterr().err
    assert "batch_size=3 must be a multiple of the 2 processes" in err
    assert "set batch_size to 4" in err
    assert not (tmp_path / "odd").exists()  # nothing written


def logged_groups(run: Path, step: int, seeds: set[int]) -> list[list[Episode]]:
    """Step ``step``'s logged episodes of the tasks ``seeds``, as groups in the log's order
    (the log keeps no sampler log-probs: zeros)."""
    groups: dict[int, list[Episode]] = {}
    for line in (run / f"episodes/step_{step:06d}.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["seed"] in seeds:
            n = len(e["input_ids"])
            episode = Episode(e["input_ids"], e["action_mask"], [0.0] * n, e["reward"])
            episode.num_turns, episode.stop_reason, episode.seed = (
                e["num_turns"],
                e["stop_reason"],
                e["seed"],
            )
            groups.setdefault(e["seed"], []).append(episode)
    return list(groups.values())


def policy_at(model_dir: str, run: Path, step: int) -> torch.nn.Module:
    """The policy that collected step ``step + 1``: the model, with the run's adapter of
    step ``step`` (none at step 0: a fresh LoRA adapter changes nothing)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if step == 0:
        return model
    return PeftModel.from_pretrained(model, run / f"checkpoints/step_{step:06d}/adapter")


def test_two_processes_end_with_the_weights_of_one_on_the_same_batch(tiny_model_dir, tmp_path):
    """The same 2 steps x 4 tasks, collected by 1 process or split over 2: the same
    episodes (each turn samples from its own seed) and the same adapters, up to the float
    rounding of batched kernels and gloo's all-reduce. Rounding may flip a draw (the
    batches differ, and under continuous batching their make-up follows the envs'
    timing): episodes may then part at a near tie (tests/helpers/draws.py), and the
    adapters are compared up to the step before the first such parting (those steps
    trained on the same batches). Only the main process writes (one metrics row per
    step, its own share of the episodes). (Resuming on 2 processes: the lost-rank test.)"""
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    # float32: in bf16 a row's rounding, and so at times a token, depends on its batch (and
    # on the drafts its decode steps verify, which follow the batch's hit rate)
    args = ("coin_env:CoinCalculator-v0", "--batch-size", "4", "--learning-rate", "1e-2")
    args += ("--dtype", "float32")
    for processes, out in ((1, one), (2, two)):
        proc = launch(processes, out, tiny_model_dir, *args, "--steps", "2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        # the main process's last words, printed before it ends without the teardown
        assert f"run directory: {out}" in proc.stdout
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0)  # launch()'s, the default
    same_batches = 0  # steps before the first that parted
    for step in (1, 2):  # rank 0 logs its share, tasks 0 and 2 of the step's 4
        share = set(task_share(0, step - 1, 4, rank=0, world=2))
        mine, expected = logged_groups(two, step, share), logged_groups(one, step, share)
        assert [len(g) for g in mine] == [len(g) for g in expected] == [2, 2]  # G = 2
        parted = assert_same_episode_draws(
            mine,
            expected,
            model=policy_at(tiny_model_dir, one, step - 1),
            sampling=sampling,
            sample_seed=sampling_seed(0, step - 1),
            atol=0.0,  # (no log-probs logged)
        )
        if parted:
            break
        same_batches = step
    adapters = [f"checkpoints/step_{s:06d}/adapter/adapter_model.safetensors" for s in (1, 2)]
    for adapter in adapters[:same_batches]:
        a, b = (load_file(run / adapter) for run in (one, two))
        assert a.keys() == b.keys()
        moved = [k for k in a if "lora_B" in k and a[k].abs().sum() > 0]
        assert moved  # it learned: B starts at zero
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-4)
    assert [json.loads(line)["step"] for line in (two / "metrics.jsonl").open()] == [1, 2]
    assert json.loads((two / "config.json").read_text())["batch_size"] == 4


def test_sft_on_two_processes_ends_with_its_checkpoint_and_status_0(tiny_model_dir, tmp_path):
    """``agentenv sft`` under 2 processes: both end with status 0 (without the
    interpreter's teardown) after the main process wrote the checkpoint and metrics."""
    out = tmp_path / "sft"
    args = ("sft", "Calculator-v0", "--env-kwargs", '{"source": "word_problems"}')
    args += ("--model", tiny_model_dir, "--num-demos", "4")
    args += ("--epochs", "1", "--batch-size", "2", "--dtype", "float32", "--output-dir", str(out))
    proc = accelerate_launch(2, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "checkpoint" / "adapter" / "adapter_model.safetensors").is_file()
    assert proc.stdout.count(f"checkpoint: {out / 'checkpoint'}") == 1  # the main process's
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1.0, 2.0]  # 4 demonstrations, 2 a step


def test_a_run_that_loses_a_rank_exits_promptly_and_resume_equals_an_uninterrupted_run(
    tiny_model_dir, tmp_path
):
    """Rank 1 is SIGKILLed in step 2 (its env's 6th step, tests/helpers/coin_env.py): the
    launch ends promptly with an error, step 1's checkpoint is the last, and ``--resume``
    on 2 processes ends with the adapter and metrics of a run that was never killed."""
    import time

    from safetensors.torch import load_file

    from agentenv.run.tracking import read_metrics

    whole, split = tmp_path / "whole", tmp_path / "split"
    args = ("--import", "coin_env", "RankCrash-v0", "--steps", "3", "--batch-size", "4")
    args += ("--learning-rate", "1e-2", "--log-episodes", "0")
    never = tmp_path / "never"
    never.write_text("")  # the marker exists: no crash
    proc = launch(2, whole, tiny_model_dir, *args, env={"COIN_CRASH_MARKER": str(never)})
    assert proc.returncode == 0, proc.stderr[-3000:]

    crash = {"COIN_CRASH_MARKER": str(tmp_path / "crashed"), "COIN_CRASH_AT": "6"}
    proc = launch(2, split, tiny_model_dir, *args, env=crash)
    exited = time.time()
    assert proc.returncode != 0 and (tmp_path / "crashed").exists(), proc.stderr[-3000:]
    killed = float((tmp_path / "crashed").read_text())
    assert exited - killed < 30, f"the launch ended {exited - killed:.0f} s after the kill"
    assert latest_checkpoint(split / "checkpoints").name == "step_000001"
    assert [r["step"] for r in read_metrics(split)] == [1]

    proc = launch(2, split, tiny_model_dir, *args, "--resume", env=crash)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = "checkpoints/step_000003/adapter/adapter_model.safetensors"
    a, b = (load_file(run / adapter) for run in (whole, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)  # it learned something
    rows = [untimed_metrics(run) for run in (whole, split)]
    assert rows[0] == rows[1] and [r["step"] for r in rows[0]] == [1, 2, 3]


def test_the_sampler_gathers_fsdp2_sharded_lora_weights():
    """tests/helpers/fsdp2_sampler.py under torchrun: 2 CPU processes shard a tiny LoRA
    model with torch's fully_shard; each sampler copy must hold the whole policy."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **CPU_ONLY}
    script = ROOT / "tests" / "helpers" / "fsdp2_sampler.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the two processes share one pipe, so their lines may interleave ("ok 0ok 1\n\n")
    assert sorted(re.findall(r"ok \d", proc.stdout)) == ["ok 0", "ok 1"]


def test_sharding_the_sampler_or_checkpoints_cannot_gather_is_refused_before_loading():
    from agentenv.errors import InvalidOptionError
    from agentenv.run.train import check_sharding

    check_sharding({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})  # ZeRO-2: fine
    check_sharding({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})  # FSDP2: gathered
    with pytest.raises(InvalidOptionError, match="FSDP1.*fsdp_version: 2"):
        check_sharding({"ACCELERATE_USE_FSDP": "true"})  # accelerate's default version is 1
    with pytest.raises(InvalidOptionError, match="ZeRO-3.*fsdp_version: 2.*zero_stage: 2"):
        check_sharding({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})


def test_a_population_with_dynamic_sampling_trains_on_two_processes(tiny_model_dir, tmp_path):
    """Every process holds every member and trains each on its share of the tasks; the
    main process measures the fitness and broadcasts it, so both carry out the same
    evolution (a process without the values would fail) and the checkpoint holds every
    member. Each process also fills its own share of the batch by dynamic sampling; the
    rounds (which hold collectives) go on while either needs one, so a process that is
    full waits in them: a disagreement would hang the launch. Parity rewards with G = 2
    tie half the time, so rounds happen."""
    out = tmp_path / "pop"
    args = ("coin_env:CoinCalculator-v0", "--batch-size", "4", "--learning-rate", "1e-2")
    args += ("--population", "2", "--evolve-every", "1", "--validation-tasks", "2")
    args += ("--mutation-prob", "1", "--dtype", "float32")
    args += ("--dynamic-sampling", "--max-extra-tasks", "1")
    proc = launch(2, out, tiny_model_dir, *args, "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run directory: {out}" in proc.stdout
    lineage = [json.loads(line) for line in (out / "lineage.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lineage] == [1, 2] and len(lineage[0]["children"]) == 2
    state = json.loads((out / "checkpoints/step_000003/population.json").read_text())
    assert [len(m["fitness"]) for m in state["members"]] == [3, 3]
    for member in ("member_0", "member_1"):
        assert (out / "checkpoints/step_000003" / member / "adapter").is_dir()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # each member, the main process's share: 2 tasks, at most 2 more
        for m in ("member0/", "member1/"):
            assert 2 <= row[f"{m}sampling/tasks_drawn"] <= 4
            assert row[f"{m}sampling/groups_trained"] <= 2
    assert any(r[f"{m}sampling/rounds"] > 0 for r in rows for m in ("member0/", "member1/"))


def test_a_mixture_on_two_processes_draws_the_episodes_of_one(tiny_model_dir, tmp_path):
    """Two envs 1:1 over 4 tasks: tasks 0, 1 the first env's, 2, 3 the second's; rank 0
    of 2 collects tasks 0 and 2 (one of each env), with its env's name, max_turns and
    sampling seed, the same episodes one process draws for them (up to a near tie)."""
    from agentenv.env.mixture import EnvSpec, Mixture
    from agentenv.run.train import step_share

    envs = ["coin=coin_env:CoinCalculator-v0", "calc=coin_env:CoinCalculator-v0"]
    one, two = tmp_path / "one", tmp_path / "two"
    args = ("--envs", *envs, "--batch-size", "4", "--log-episodes", "8", "--dtype", "float32")
    for processes, out in ((1, one), (2, two)):
        proc = launch(processes, out, tiny_model_dir, *args, "--steps", "1")
        assert proc.returncode == 0, proc.stderr[-3000:]
    mixture = Mixture([EnvSpec("Calculator-v0", name=n) for n in ("coin", "calc")])
    share = step_share(mixture, 0, 0, 4, rank=0, world=2)
    assert [len(s) for s in share] == [1, 1]
    rows = {
        run: [json.loads(line) for line in (run / "episodes/step_000001.jsonl").open()]
        for run in (one, two)
    }
    assert [r["env"] for r in rows[one]] == ["coin"] * 4 + ["calc"] * 4
    assert [(r["env"], r["seed"]) for r in rows[two]] == [
        ("coin", share[0][0]), ("coin", share[0][0]), ("calc", share[1][0]), ("calc", share[1][0])
    ]  # fmt: skip
    for e in range(2):  # each env's group: its tasks' seeds, its own sampling seed
        seeds = set(share[e])
        parted = assert_same_episode_draws(
            logged_groups(two, 1, seeds),
            logged_groups(one, 1, seeds),
            model=policy_at(tiny_model_dir, one, 0),
            sampling=SamplingConfig(max_new_tokens=4, temperature=1.0),
            sample_seed=mixture.sample_seed(sampling_seed(0, 0), e),
            atol=0.0,  # (no log-probs logged)
        )
        assert parted <= 1  # a near tie parts at most one of a group of 2 here, rarely
    metrics = json.loads((two / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["groups/coin"] == metrics["groups/calc"] == 1  # the main process's share
