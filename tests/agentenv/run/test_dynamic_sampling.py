"""Dynamic sampling (``grpo.dynamic_sampling``): which groups a step keeps, how many extra
tasks it draws, its cap, under each credit, in one and two processes, and in a run."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file
from toy_episodes import SAMPLING, make_groups

from agentenv.run.dynamic_sampling import extra_budget, extra_task_seeds, fill_batch
from agentenv.run.tracking import read_metrics
from agentenv.run.train import train
from algorithms.config import GRPOConfig
from algorithms.grpo import GRPO


class Script:
    """Draws scripted groups: each group is a name whose signal the script fixes."""

    def __init__(self, rounds: list[str]):
        self.rounds = list(rounds)  # each round's signals, e.g. "TF": a kept, a dropped group
        self.calls: list[tuple[int, int]] = []

    def draw(self, round_: int, n: int) -> list[list[str]]:
        self.calls.append((round_, n))
        flags = self.rounds.pop(0)[:n]
        return [[f"r{round_}g{i}{flag}"] * 2 for i, flag in enumerate(flags)]  # G = 2


def signal(groups):
    return [group[0].endswith("T") for group in groups]


def first(flags: str) -> list[list[str]]:
    return [[f"r0g{i}{flag}"] * 2 for i, flag in enumerate(flags)]


def test_a_round_draws_the_missing_groups_over_the_keep_rate_and_stops_when_full():
    """2 of 4 kept: rate 0.5, so round 1 draws ceil(2 / 0.5) = 4 tasks; 2 of them kept
    fill the batch. The kept groups train in draw order."""
    script = Script(["FTFT"])
    trained, stats = fill_batch(first("TFFT"), signal, script.draw, want=4, budget=8)
    assert script.calls == [(1, 4)]
    assert [g[0] for g in trained] == ["r0g0T", "r0g3T", "r1g1T", "r1g3T"]
    assert stats == {
        "sampling/tasks_drawn": 8.0,
        "sampling/groups_with_signal": 4.0,
        "sampling/groups_trained": 4.0,
        "sampling/rounds": 1.0,
        "sampling/episodes_per_trained_group": 8 * 2 / 4,
    }


def test_a_full_first_draw_draws_nothing_and_surplus_groups_are_left_out():
    script = Script([])
    trained, stats = fill_batch(first("TTTT"), signal, script.draw, want=4, budget=8)
    assert script.calls == [] and stats["sampling/rounds"] == 0.0
    assert len(trained) == 4 and stats["sampling/episodes_per_trained_group"] == 2.0
    script = Script(["TTTT"])
    trained, stats = fill_batch(first("FFTT"), signal, script.draw, want=4, budget=8)
    assert [g[0] for g in trained] == ["r0g2T", "r0g3T", "r1g0T", "r1g1T"]
    assert stats["sampling/groups_with_signal"] == 6.0


def test_the_cap_ends_the_step_with_what_it_found_or_the_first_draw():
    """Nothing kept: the rate floor 0.25 asks 4 x 4 = 16 tasks, the budget allows 6; with
    none kept still, the step trains on its first draw (as a plain step). One kept of 4:
    the budget's 2 extra tasks find one more, and the step trains on 2 groups."""
    script = Script(["FFFFFF"])
    trained, stats = fill_batch(first("FFFF"), signal, script.draw, want=4, budget=6)
    assert script.calls == [(1, 6)]
    assert [g[0] for g in trained] == ["r0g0F", "r0g1F", "r0g2F", "r0g3F"]
    assert stats["sampling/tasks_drawn"] == 10.0 and stats["sampling/groups_with_signal"] == 0
    assert stats["sampling/episodes_per_trained_group"] == 20.0  # all 20 episodes, for none
    script = Script(["TF"])
    trained, stats = fill_batch(first("TFFF"), signal, script.draw, want=4, budget=2)
    assert script.calls == [(1, 2)] and [g[0] for g in trained] == ["r0g0T", "r1g0T"]
    assert stats["sampling/groups_trained"] == 2.0 and stats["sampling/rounds"] == 1.0
    # rounds size by the keep rate so far (3 of 8: ceil(1 / 0.375) = 3), then the budget
    script = Script(["FFFT", "FFF", "T"])
    trained, stats = fill_batch(first("TTFF"), signal, script.draw, want=4, budget=8)
    assert script.calls == [(1, 4), (2, 3), (3, 1)] and len(trained) == 4
    _, stats = fill_batch(first("FFFF"), signal, Script([]).draw, want=4, budget=0)
    assert stats["sampling/rounds"] == 0.0  # max_extra_tasks 0: the plain step


def test_two_processes_run_the_same_rounds_each_filling_its_own_share():
    """Rank 0 is full after its first draw, rank 1 needs two rounds: both take part in
    both rounds (the rounds hold collectives), rank 0 drawing nothing."""
    barrier = threading.Barrier(2)
    flags: list[bool] = [False, False]
    results: dict[int, tuple] = {}

    def any_process(rank: int, flag: bool) -> bool:
        flags[rank] = flag
        barrier.wait()
        out = any(flags)
        barrier.wait()
        return out

    scripts = {0: Script([]), 1: Script(["FF", "TT"])}
    starts = {0: "TT", 1: "TF"}

    def run(rank: int) -> None:
        results[rank] = fill_batch(
            first(starts[rank]),
            signal,
            scripts[rank].draw,
            want=2,
            budget=extra_budget(2.0, 4, world=2),  # 4 each
            any_process=lambda flag: any_process(rank, flag),
        )

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert scripts[0].calls == [] and scripts[1].calls == [(1, 2), (2, 2)]
    assert [g[0] for g in results[1][0]] == ["r0g0T", "r2g0T"]
    assert results[0][1]["sampling/rounds"] == results[1][1]["sampling/rounds"] == 2.0
    assert results[0][1]["sampling/tasks_drawn"] == 2.0


def test_extra_seeds_are_a_function_of_the_step_round_and_rank():
    assert extra_task_seeds(0, 3, 1, 4) == extra_task_seeds(0, 3, 1, 4)
    assert extra_task_seeds(0, 3, 1, 2) == extra_task_seeds(0, 3, 1, 4)[:2]
    seeds = {tuple(extra_task_seeds(0, 3, r, 4, rank)) for r in (1, 2) for rank in (0, 1)}
    assert len(seeds) == 4
    assert extra_budget(2.0, 4) == 8 and extra_budget(0.5, 3, world=2) == 1


@pytest.mark.parametrize(
    ("overrides", "kept", "drawn"),
    [
        ({}, ["differ", "differ"], 6),  # nothing kept at first: 4 x 2 missing, capped at 4
        ({"turn_weight": 1.0}, ["tie+turns", "differ"], 4),  # bandit + shaping
        ({"credit": "turn"}, ["tie+turns", "tie"], 2),
        ({"credit": "gae"}, ["tie+turns", "tie"], 2),
        ({"credit": "gae", "turn_weight": 0.0}, ["differ", "differ"], 6),
    ],
)
def test_under_each_credit_the_trainers_decision_picks_the_groups(
    tokenizer, overrides, kept, drawn
):
    """A tie of outcomes whose per-turn rewards differ ("tie+turns") is kept with any
    weight on the per-turn rewards; a tie whose returns differ only from turn to turn
    ("tie") by the turn credits alone; outcomes that differ by every credit."""
    from agentenv.lm.models import tiny_model as build

    def groups(names):
        rewards = {"tie": [0, 0], "tie+turns": [1, 1], "differ": [0, 1]}
        turns = {"tie": [[0.5, 0], [0.5, 0]], "tie+turns": [[0.5, 0], [0, 0]],
                 "differ": [[0, 0], [0, 0]]}  # fmt: skip
        out = make_groups([rewards[n] for n in names], seed=4)
        for group, name in zip(out, names, strict=True):
            for episode, values in zip(group, turns[name], strict=True):
                episode.turn_rewards, episode.name = values, name
        return out

    cfg = GRPOConfig(learning_rate=1e-3, lora_r=4, lora_alpha=8, **overrides)
    trainer = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    script = ["tie", "differ", "tie", "differ"]
    trained, stats = fill_batch(
        groups(["tie+turns", "tie"]),
        trainer.group_signal,
        lambda r, n: groups(script[:n]),
        want=2,
        budget=4,
    )
    assert [g[0].name for g in trained] == kept
    assert stats["sampling/tasks_drawn"] == drawn


def ds_config(model_dir, out, steps, **grpo):
    from agentenv.run.config import TrainConfig

    return TrainConfig(
        env_id="CoinCalculator-v0",
        model=model_dir,
        steps=steps,
        batch_size=2,
        rollout={"group_size": 2, "max_turns": 1, "sampling": {"max_new_tokens": 4}},
        eval_tasks=0,
        save_every=1,
        log_episodes=0,
        output_dir=str(out),
        grpo={"learning_rate": 1e-2, "dynamic_sampling": True, "max_extra_tasks": 2.0, **grpo},
        pools={"difficulty_pools": True, "retire_after": 1},
        dtype="float32",
    )


def test_a_dynamic_sampling_run_with_pools_resumes_to_an_uninterrupted_ones_state(
    tiny_model_dir, tmp_path
):
    """Dynamic sampling and difficulty pools on (retiring a task after one group of G = 2
    all solved or none, as parity rewards often are): a run killed after step 2 and resumed ends
    with the weights, metrics and task pool of one that ran 3 steps."""
    import coin_env  # noqa: F401  (registers CoinCalculator-v0: parity rewards)
    from run_metrics import untimed_metrics

    whole, split = tmp_path / "whole", tmp_path / "split"
    train(config=ds_config(tiny_model_dir, whole, 3))
    train(config=ds_config(tiny_model_dir, split, 2))
    train(config=ds_config(tiny_model_dir, split, 3), resume=True)
    adapter = "checkpoints/step_000003/adapter/adapter_model.safetensors"
    a, b = (load_file(run / adapter) for run in (whole, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [untimed_metrics(run) for run in (whole, split)]
    assert rows[0] == rows[1] and len(rows[0]) == 3
    for row in read_metrics(whole):
        assert 2 <= row["sampling/tasks_drawn"] <= 2 + 4
        found = row["sampling/groups_with_signal"]
        assert row["sampling/groups_trained"] == (min(found, 2) if found else 2)
        assert row["time/extra_draws_s"] >= 0
    drew_more = [r for r in read_metrics(whole) if r["sampling/rounds"] > 0]
    assert drew_more, "parity rewards of G=2 tie half the time: some step should draw more"
    config = json.loads((whole / "config.json").read_text())
    assert config["grpo"]["dynamic_sampling"] is True
    pools = [torch.load(run / "checkpoints/step_000003/task_pool.pt") for run in (whole, split)]
    assert pools[0] == pools[1] and pools[0]["retired"]
    seen = [row["pools/tasks_seen"] for row in read_metrics(whole)]
    assert seen == sorted(seen) and seen[-1] == len(pools[0]["groups"])
    last = read_metrics(whole)[-1]  # parity rewards: "solved" where no answer says otherwise
    assert last["pools/retired_hard"] + last["pools/retired_easy"] == len(pools[0]["retired"])
