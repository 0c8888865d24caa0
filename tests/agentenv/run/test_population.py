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
from agentenv.run.population import (
    TaskSplit,
    member_sample_seed,
    read_lineage,
    start_hyperparameters,
    validation_slice,
)
from agentenv.run.tracking import read_metrics
from agentenv.run.train import sampling_seed, task_share, train
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
    # same weights and lineage (the copies made at step 1 draw with their restored lineage
    # ids; with the slots' ids instead the weights differ)
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


def test_the_population_json_and_lineage_keep_each_members_lineage_id(tiny_model_dir, tmp_path):
    """population.json and lineage.jsonl hold the ids the members draw with (what a resume
    restores): every copy a fresh one."""
    run = train(config=config(tiny_model_dir, tmp_path / "run", steps=2))
    (record,) = read_lineage(run)
    state = json.loads((run / "checkpoints/step_000001/population.json").read_text())
    ids = [m["lineage_id"] for m in state["members"]]
    assert ids == [c["lineage_id"] for c in record["children"]] and len(set(ids)) == 3
    copies = [c for c in record["children"] if c["parent"] != c["slot"]]
    assert copies and all(c["lineage_id"] >= 3 for c in copies)  # fresh ids, not 0-2
    assert state["next_lineage_id"] == 3 + len(copies)


class Recorder:
    """Stands in for ``collect`` and records, per call, the tasks the env really reset to
    (whatever picked them: a seed or a task_id option), the sample seed and the tokens."""

    def __init__(self, collect):
        self.collect, self.calls = collect, []

    def __call__(self, make_env, seeds, policy, fmt, config, *, options=None, sample_seed=None):
        groups, metrics = self.collect(
            make_env, seeds, policy, fmt, config, options=options, sample_seed=sample_seed
        )
        env = make_env()
        opts = options or [None] * len(seeds)
        tasks = [
            env.reset(seed=s, options=o)[1]["task_id"] for s, o in zip(seeds, opts, strict=True)
        ]
        env.close()
        self.calls.append(
            {
                "training": config.group_size > 1,  # fitness collects one episode per task
                "seeds": list(seeds),
                "tasks": tasks,
                "sample_seed": sample_seed,
                "tokens": [e.input_ids for g in groups for e in g],
            }
        )
        return groups, metrics


NUM_TASKS, HELD_OUT = 12, 3  # a train split small enough that training would hit the slice


@pytest.fixture(scope="module")
def twins_run(tiny_model_dir, tmp_path_factory):
    """Two members, an evolution after each of 4 steps, never a mutation: every evolution
    makes the loser an unmutated copy of the winner (a twin, before lineage ids)."""
    import agentenv.rollout.collect as collect_module
    import agentenv.run.evaluate as evaluate_module

    recorder = Recorder(collect_module.collect)
    out = tmp_path_factory.mktemp("twins")
    cfg = config(
        tiny_model_dir,
        out,
        steps=4,
        batch_size=4,
        env_kwargs={**ENV, "num_tasks": NUM_TASKS},
        evolution={
            "population": 2,
            "evolve_every": 1,
            "validation_tasks": HELD_OUT,
            "mutation_prob": 0.0,
            "member_start": {"learning_rate": [1e-3, 1e-2]},
        },
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(collect_module, "collect", recorder)
        mp.setattr(evaluate_module, "collect", recorder)  # fitness: evaluate on the slice
        run = train(config=cfg)
    return run, recorder.calls


def test_an_unmutated_copy_draws_other_episodes_than_its_parent(twins_run):
    run, calls = twins_run
    training = [c for c in calls if c["training"]]
    assert len(training) == 4 * 2  # 4 steps, 2 members each, in member order
    for record in read_lineage(run):  # after steps 1, 2, 3
        (copy,) = [c for c in record["children"] if c["parent"] != c["slot"]]
        assert copy["mutation"] == {}  # the same weights, optimizer and settings
        step = record["step"]  # the next step's collections, by slot
        parent, child = training[2 * step + copy["parent"]], training[2 * step + copy["slot"]]
        assert parent["tasks"] == child["tasks"] and parent["seeds"] == child["seeds"]
        assert parent["sample_seed"] != child["sample_seed"]
        assert parent["tokens"] != child["tokens"]  # not its parent's episodes again
    # lineage 0 draws a plain run's seeds; the others their own
    assert training[0]["sample_seed"] == sampling_seed(0, 0)
    assert training[1]["sample_seed"] == member_sample_seed(sampling_seed(0, 0), 1)


def test_no_fitness_task_is_ever_drawn_for_training(twins_run):
    _, calls = twins_run
    held_out = set(validation_slice(NUM_TASKS, HELD_OUT))
    fitness = [c for c in calls if not c["training"]]
    assert len(fitness) == 4 * 2  # after every step, each member
    assert all(set(c["tasks"]) == held_out for c in fitness)
    trained = {t for c in calls if c["training"] for t in c["tasks"]}
    assert not trained & held_out
    assert len(trained) > NUM_TASKS - HELD_OUT - 3  # 16 draws reach most of the other 9
    # and over many steps: every draw maps to a task outside the slice, all of them reached
    split = TaskSplit(NUM_TASKS, validation_slice(NUM_TASKS, HELD_OUT))
    drawn = [
        t
        for step in range(2000)
        for rank in (0, 1)
        for t in (o["task_id"] for o in split.training_options(task_share(0, step, 4, rank, 2)))
    ]
    assert set(drawn) == set(range(NUM_TASKS)) - held_out


def test_fitness_episodes_are_seeded(twins_run):
    """Every fitness measurement draws from the same seed: members and evolutions compare."""
    _, calls = twins_run
    fitness = [c for c in calls if not c["training"]]
    assert len({c["sample_seed"] for c in fitness}) == 1
    assert all(c["seeds"] == fitness[0]["seeds"] for c in fitness)


def test_the_validation_slice_and_the_training_tasks_by_hand():
    split = TaskSplit(10, (2, 5, 6))  # training tasks: 0 1 3 4 7 8 9
    assert [split.training_task(s) for s in range(10)] == [0, 1, 3, 4, 7, 8, 9, 0, 1, 3]
    assert split.training_options([2, 13]) == [{"task_id": 3}, {"task_id": 9}]  # 13 % 7 = 6
    assert validation_slice(10, 3) == validation_slice(10, 3) == (2, 5, 7)  # no seed, no state
    assert len(validation_slice(2000, 64)) == 64
    with pytest.raises(InvalidOptionError, match="below 12"):
        validation_slice(12, 12)


def test_a_plain_run_keeps_its_sampling_seed():
    seed = sampling_seed(0, 3)
    assert member_sample_seed(seed, 0) == seed  # lineage 0: a plain run's draws
    assert len({member_sample_seed(seed, i) for i in range(100)}) == 100


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
