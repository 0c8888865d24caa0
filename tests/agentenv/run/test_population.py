"""``agentenv train --population N``: the run, its lineage, resume and the best member."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from agentenv.cli import build_parser, main
from agentenv.errors import InvalidOptionError
from agentenv.run.config import TrainConfig
from agentenv.run.export import resolve_checkpoint
from agentenv.run.population import read_lineage, start_hyperparameters
from agentenv.run.tracking import read_metrics
from agentenv.run.train import train
from algorithms.checkpoint import latest_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

ENV = {"source": "word_problems", "prompt_style": "compact"}
LRS = [1e-4, 1e-3, 1e-2]


def config(model_dir, out, **kw):
    import coin_env  # noqa: F401  (registers CoinCalculator-v0: rewards a tiny model can vary)

    base = dict(
        model=model_dir,
        env_id="CoinCalculator-v0",
        env_kwargs=ENV,
        steps=3,
        batch_size=2,
        rollout={
            "group_size": 2,
            "max_turns": 2,
            "max_episode_tokens": 256,
            "sampling": {"max_new_tokens": 6},
        },
        eval_tasks=0,
        save_every=1,
        keep_checkpoints=10,
        log_episodes=0,
        output_dir=str(out),
        grpo={"learning_rate": 1e-3},
        evolution={
            "population": 3,
            "evolve_every": 1,
            "validation_tasks": 2,
            "mutation_prob": 1.0,
            "member_start": {"learning_rate": LRS},
        },
    )
    return TrainConfig(**{**base, **kw})


def member_weights(run, step):
    folder = run / "checkpoints" / f"step_{step:06d}"
    return [
        load_file(folder / f"member_{i}" / "adapter" / "adapter_model.safetensors")
        for i in range(3)
    ]


def test_a_population_run_evolves_logs_its_lineage_and_resumes_exactly(tiny_model_dir, tmp_path):
    whole = train(config=config(tiny_model_dir, tmp_path / "whole"))
    lineage = read_lineage(whole)
    assert [r["step"] for r in lineage] == [1, 2]  # every step, never after the last
    children = lineage[-1]["children"]
    assert sorted(c["slot"] for c in children) == [0, 1, 2]
    assert sum(c["elite"] for c in children) == 1
    assert all(c["mutation"] for c in children if not c["elite"])  # mutation_prob 1
    rows = read_metrics(whole)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"member0/rewards/mean", "member2/loss", "member1/hp/learning_rate"} <= set(rows[0])
    assert rows[0]["member2/hp/learning_rate"] == 1e-2
    assert all("member0/fitness" in row for row in rows)  # 2 evolutions and the end's
    assert rows[0]["rewards/mean"] == pytest.approx(
        sum(rows[0][f"member{i}/rewards/mean"] for i in range(3)) / 3
    )
    assert (whole / "plots" / "fitness.png").is_file()
    state = json.loads((whole / "checkpoints/step_000003/population.json").read_text())
    assert state["lineage"] == lineage and state["step"] == 3
    assert [len(m["fitness"]) for m in state["members"]] == [3, 3, 3]
    assert [m["hyperparameters"] for m in state["members"]] == [
        c["hyperparameters"] for c in children
    ]

    # a run killed after step 1's checkpoint, resumed (an evolution after step 2): the
    # same weights and lineage
    split = tmp_path / "split"
    shutil.copytree(whole, split)
    for step in (2, 3):
        shutil.rmtree(split / "checkpoints" / f"step_{step:06d}")
    (split / "lineage.jsonl").write_text("")  # whatever the killed run left
    train(config=config(tiny_model_dir, split), resume=True)
    for a, b in zip(member_weights(whole, 3), member_weights(split, 3), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_lineage(split) == lineage
    assert json.loads((split / "checkpoints/step_000003/population.json").read_text()) == state
    # the members did learn, and differently
    w = member_weights(whole, 3)
    assert any(not torch.equal(w[0][k], w[1][k]) for k in w[0] if "lora_B" in k)

    # the best member is what eval and export use
    ckpt = latest_checkpoint(whole / "checkpoints")
    best = max(range(3), key=lambda i: (state["members"][i]["fitness"][-1], -i))
    assert resolve_checkpoint(ckpt) == ckpt / f"member_{best}"
    out = tmp_path / "exported"
    assert main(["export", str(ckpt), str(out)]) == 0
    assert (out / "config.json").is_file() and f"member_{best}" in (out / "README.md").read_text()


def test_evolve_every_0_trains_the_members_independently(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, tmp_path / "run", steps=2, evolution={"population": 2})
    cfg.evolution.evolve_every = 0
    run = train(config=cfg)
    assert read_lineage(run) == [] and not (run / "plots" / "fitness.png").exists()
    state = json.loads((run / "checkpoints/step_000002/population.json").read_text())
    assert [len(m["fitness"]) for m in state["members"]] == [1, 1]  # the final measurement


def test_population_settings_are_checked_before_any_model_loads(tmp_path):
    bad = config("/no/such/model", tmp_path / "a", grpo={"use_lora": False})
    with pytest.raises(InvalidOptionError, match="use_lora true"):
        train(config=bad)
    bad = config("/no/such/model", tmp_path / "b")
    bad.evolution.member_start = {"beta": [0.0, 0.1, 0.1]}
    with pytest.raises(InvalidOptionError, match="grpo.beta is 0"):
        train(config=bad)
    good = config("/no/such/model", tmp_path / "c", grpo={"learning_rate": 1e-3, "beta": 0.04})
    good.evolution.member_start = {"beta": [0.01, 0.04, 0.1]}
    assert [hp["beta"] for hp in start_hyperparameters(good)] == [0.01, 0.04, 0.1]
    assert [hp["learning_rate"] for hp in start_hyperparameters(good)] == [1e-3] * 3


def test_the_population_flags_reach_the_config():
    args = build_parser().parse_args(
        [
            "train",
            "--population",
            "4",
            "--evolve-every",
            "3",
            "--member-start",
            '{"learning_rate": [1e-5, 1e-5, 1e-3, 1e-4]}',
            "--mutate",
            "learning_rate",
            "temperature",
            "--no-elitism",
            "--mutation-factors",
            "0.8",
            "1.25",
        ]
    )
    from agentenv.cli import _train_config

    cfg = _train_config(args).evolution
    assert (cfg.population, cfg.evolve_every, cfg.elitism) == (4, 3, False)
    assert cfg.member_start == {"learning_rate": [1e-5, 1e-5, 1e-3, 1e-4]}
    assert cfg.mutate == ["learning_rate", "temperature"]
    assert cfg.mutation_factors == [0.8, 1.25]
