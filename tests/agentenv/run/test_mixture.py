"""Several envs in one run (:mod:`agentenv.env.mixture`): quotas by hand, schedules, task
and seed namespaces, the config's forms and errors, per-env metrics of a real run and its
resume, reports pooled over envs."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from agentenv.env.mixture import EnvSpec, Mixture
from agentenv.errors import InvalidOptionError
from agentenv.run.config import EvalRunConfig, SFTRunConfig, TrainConfig
from agentenv.run.dynamic_sampling import extra_task_seeds
from agentenv.run.evaluate import EvalReport, compare, format_table, pool_reports
from agentenv.run.recorded import take_recorded
from agentenv.run.train import step_share, task_seeds, task_share


def mixture(*weights: float) -> Mixture:
    return Mixture(
        [EnvSpec("Calculator-v0", name=f"e{i}", weight=w) for i, w in enumerate(weights)]
    )


def test_quotas_of_weights_that_do_not_divide_the_batch_alternate():
    """1:1:1 over 4 groups: need 4/3 each; the earliest env wins ties -> 2,1,1 (debts
    -2/3, 1/3, 1/3), then 1,2,1, then 1,1,2 (debts 0), and again."""
    m = mixture(1, 1, 1)
    assert [m.quotas(s, 4) for s in range(6)] == [[2, 1, 1], [1, 2, 1], [1, 1, 2]] * 2


def test_quotas_two_to_one_by_hand():
    """2:1 over 4: need 8/3, 4/3 -> seats a, a, b, a = 3,1 (debts -1/3, 1/3); need 7/3,
    5/3 -> a, b, a, b = 2,2 (debts 1/3, -1/3); need 3, 1 -> a, a, a (tie 1 vs 1: the
    earlier), b = 3,1 (debts 0): 8 of 12 groups to a."""
    m = mixture(2, 1)
    assert [m.quotas(s, 4) for s in range(6)] == [[3, 1], [2, 2], [3, 1]] * 2


def test_a_schedule_moves_the_groups_from_one_env_to_the_other():
    """single [[0, 1], [4, 0]] and bridge [[0, 0], [4, 1]], 2 groups a step, by hand:
    step 0 weights 1, 0 -> 2,0; step 1 .75, .25: need 1.5, .5 -> 2,0 (debts -.5, .5);
    step 2 .5, .5: need .5, 1.5 -> 1,1; step 3 .25, .75: need 0, 2 -> 0,2; then 0,2."""
    single = EnvSpec("RAG-v0", name="single", schedule=[[0, 1], [4, 0]])
    bridge = EnvSpec("RAG-v0", name="bridge", schedule=[[0, 0], [4, 1]])
    assert [bridge.weight_at(s) for s in (0, 1, 2, 4, 9)] == [0.0, 0.25, 0.5, 1.0, 1.0]
    m = Mixture([single, bridge])
    assert [m.quotas(s, 2) for s in range(6)] == [[2, 0], [2, 0], [1, 1], [0, 2], [0, 2], [0, 2]]


def test_quotas_stay_within_two_groups_of_each_envs_share_however_small_its_weight():
    for trial in range(120):
        rng = random.Random(trial)
        weights = [
            rng.choice([0.01, 0.1, 0.5, 1, 2, 3.7, rng.random() + 0.01])
            for _ in range(rng.randint(2, 5))
        ]
        n = rng.randint(1, 16)
        m, given, share = mixture(*weights), [0] * len(weights), [0.0] * len(weights)
        for step in range(300):
            quotas = m.quotas(step, n)
            assert sum(quotas) == n and min(quotas) >= 0
            for e, w in enumerate(weights):
                given[e] += quotas[e]
                share[e] += n * w / sum(weights)
                assert abs(given[e] - share[e]) < 2, (weights, n, step, e)


def test_quotas_are_the_same_replayed_from_any_step_and_one_env_takes_the_whole_batch():
    a, b = mixture(1, 0.3, 2), mixture(1, 0.3, 2)
    assert a.quotas(37, 5) == [b.quotas(s, 5) for s in range(38)][-1]
    assert Mixture([EnvSpec("Calculator-v0")]).quotas(9, 7) == [7]


def test_one_env_draws_the_tasks_and_seeds_it_drew_before_mixtures():
    one = Mixture([EnvSpec("Calculator-v0")])
    for rank, world in ((0, 1), (1, 2), (2, 4)):
        assert step_share(one, 3, 5, 8, rank, world) == [task_share(3, 5, 8, rank, world)]
    assert one.sample_seed(1234, 0) == 1234
    assert extra_task_seeds(3, 5, 1, 4, 0, "") == extra_task_seeds(3, 5, 1, 4, 0)


def test_processes_share_a_mixtures_tasks_disjointly_and_envs_seed_apart():
    """Two processes' shares are the step's tasks, each with the env its quota gave it;
    each env samples from and draws extra tasks with seeds of its own."""
    m = mixture(2, 1, 1)
    seeds = task_seeds(0, 4, 8)
    shares = [step_share(m, 0, 4, 8, rank, 2) for rank in range(2)]
    by_env = [sorted(shares[0][e] + shares[1][e]) for e in range(3)]
    envs = m.step_tasks(seeds, 4)
    assert by_env == [
        sorted(s for s, x in zip(seeds, envs, strict=True) if x == e) for e in range(3)
    ]
    assert [len(b) for b in by_env] == m.quotas(4, 8)
    assert len({m.sample_seed(99, e) for e in range(3)}) == 3
    assert extra_task_seeds(0, 4, 1, 3, 0, "e0") != extra_task_seeds(0, 4, 1, 3, 0, "e1")


def test_envs_from_the_command_line_a_file_and_config_json_are_the_same():
    flags = TrainConfig.resolve(None, {"envs": ["coin=CoinCalculator-v0@2", "Calculator-v0"]})
    assert [(e.name, e.env_id, e.weight) for e in flags.envs] == [
        ("coin", "CoinCalculator-v0", 2.0),
        ("Calculator-v0", "Calculator-v0", 1.0),
    ]
    item = '{"env_id": "RAG-v0", "name": "bridge", "env_kwargs": {"question_types": ["bridge"]}}'
    assert EnvSpec.parse(item)["env_kwargs"] == {"question_types": ["bridge"]}
    from agentenv import config as config_lib

    again = TrainConfig.resolve(None, json.loads(json.dumps(config_lib.to_dict(flags))))
    assert again.envs == flags.envs


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"env_id": "RAG-v0", "envs": ["Calculator-v0"]}, "put every env in envs"),
        ({"envs": ["Calculator-v0", "Calculator-v0"]}, "give each a distinct name"),
        ({"envs": [{"env_id": "Calculator-v0", "wieght": 2}]}, "did you mean 'weight'"),
        ({"envs": [{"env_id": "Calculator-v0", "schedule": [[5, 1], [2, 0]]}]}, "steps increasing"),
        ({"envs": [{"env_id": "Calculator-v0", "weight": -1}]}, "weight must be >= 0"),
        ({"envs": [{"env_id": "Calculator-v0", "max_new_tokens": 0}]}, "max_new_tokens must be"),
        ({"envs": ["a=Calculator-v0@x"]}, "must be a number"),
        ({"envs": ["a/b=Calculator-v0"]}, "without '/'"),
        (
            {"envs": [{"env_id": "Calculator-v0", "schedule": [[0, 1], [3, 0]]}], "steps": 5},
            "weight 0 at step 3",
        ),
    ],
)
def test_bad_mixtures_are_refused_naming_the_value(settings, message):
    with pytest.raises(InvalidOptionError, match=message):
        TrainConfig.resolve(None, settings)


def test_sft_and_eval_take_a_mixture_and_sft_splits_demonstrations_by_weight():
    cfg = SFTRunConfig(envs=["a=Calculator-v0@3", "b=Calculator-v0@1"], num_demos=10)
    assert cfg.mixture().largest_remainder(10) == [8, 2]  # 7.5, 2.5: the tie to the earlier
    assert mixture(1, 1, 1).largest_remainder(4) == [2, 1, 1]
    assert len(EvalRunConfig(envs=["a=Calculator-v0", "b=RAG-v0"]).mixture()) == 2


def test_a_checkpoint_of_a_mixture_gives_eval_its_envs_unless_others_are_given():
    envs = [{"env_id": "Calculator-v0", "name": "a"}, {"env_id": "RAG-v0", "name": "b"}]
    record = {"env_id": "Calculator-v0", "env_kwargs": {}, "envs": envs, "max_turns": 3}
    assert take_recorded(record, {}) == {"envs": envs, "max_turns": 3}
    assert take_recorded(record, {"env_id": "RAG-v0"}) == {"max_turns": 3}
    assert take_recorded(record, {"envs": envs[:1]}) == {"max_turns": 3}
    single = {"env_id": "RAG-v0", "env_kwargs": {"k": 1}}
    assert take_recorded(single, {"envs": envs}) == {}


def report(per_task: list[float], accuracy_only: bool = False) -> EvalReport:
    acc = sum(per_task) / len(per_task)
    metrics = {
        "accuracy": acc,
        "mean_turns": 2.0 if accuracy_only else 1.0,
        "num_tasks": float(len(per_task)),
    }
    return EvalReport(metrics, per_task, {"env_id": "Calculator-v0"}, "x")


def test_a_report_over_envs_pools_by_task_and_compares_each_env_paired():
    """a: 2 tasks (1, 0), b: 4 tasks (1, 1, 1, 0): pooled accuracy 4/6, mean_turns
    (2 x 2 + 4 x 1) / 6, num_tasks 6; against a run that solves b's last task too, the
    pooled paired diff is 1/6 and b's 1/4 with SE sqrt(var/n) = sqrt((1/4 x 3/4 x 4/3)/4)."""
    before = pool_reports({"a": report([1, 0], True), "b": report([1, 1, 1, 0])}, "before", {})
    assert before.metrics["accuracy"] == pytest.approx(4 / 6)
    assert before.metrics["mean_turns"] == pytest.approx(8 / 6)
    assert before.metrics["num_tasks"] == 6
    assert before.metrics["accuracy/a"] == 0.5 and before.metrics["accuracy/b"] == 0.75
    assert before.per_task == [1, 0, 1, 1, 1, 0]
    after = pool_reports({"a": report([1, 0], True), "b": report([1, 1, 1, 1])}, "after", {})
    d = compare(before, after)
    assert d["accuracy_diff"] == pytest.approx(1 / 6)
    assert d["accuracy_diff/a"] == 0 and d["accuracy_diff/b"] == pytest.approx(0.25)
    assert d["accuracy_diff_stderr/b"] == pytest.approx((0.25 * 0.75 * 4 / 3 / 4) ** 0.5)
    assert "  b: +0.2500" in format_table([before, after])
    assert EvalReport(**json.loads(json.dumps(before.__dict__))).part("b").per_task == [1, 1, 1, 0]


def mix_config(model_dir, out, steps, **extra):
    return TrainConfig(
        envs=[
            {"env_id": "CoinCalculator-v0", "name": "coin", "weight": 2},
            {"env_id": "Calculator-v0", "name": "calc", "max_turns": 2, "max_new_tokens": 6},
        ],
        model=model_dir,
        steps=steps,
        batch_size=3,
        rollout={"group_size": 2, "max_turns": 1, "sampling": {"max_new_tokens": 4}},
        eval_tasks=0,
        save_every=1,
        log_episodes=6,
        output_dir=str(out),
        dtype="float32",
        **{"grpo": {"learning_rate": 1e-2}, **extra},
    )


def test_a_mixture_run_logs_each_envs_quota_episodes_and_metrics(tiny_model_dir, tmp_path):
    """Weights 2:1 over 3 groups of 2: each step 2 coin groups (1 turn of 4 tokens) and 1
    calc group (its own max_turns 2 and turns of up to 6 tokens); the logged episodes carry
    their env; each env's reward mean is that of its logged episodes; the pooled reward is
    the mean over all six."""
    import coin_env  # noqa: F401  (registers CoinCalculator-v0: parity rewards)

    from agentenv.run.tracking import read_metrics
    from agentenv.run.train import train

    run = train(config=mix_config(tiny_model_dir, tmp_path / "run", 2))
    for row in read_metrics(run):
        step = int(row["step"])
        eps = [json.loads(line) for line in (run / f"episodes/step_{step:06d}.jsonl").open()]
        assert [e["env"] for e in eps] == ["coin"] * 4 + ["calc"] * 2
        assert row["groups/coin"] == 2 and row["groups/calc"] == 1
        assert row["episodes/mean_turns/coin"] == 1
        assert row["turns/policy_tokens_mean/coin"] == 4  # the run's max_new_tokens
        assert 4 < row["turns/policy_tokens_mean/calc"] <= 6  # its own (random text: 6)
        assert {e["num_turns"] for e in eps if e["env"] == "calc"} <= {1, 2}
        for env in ("coin", "calc"):
            own = [e["reward"] for e in eps if e["env"] == env]
            assert row[f"rewards/mean/{env}"] == pytest.approx(sum(own) / len(own))
        assert row["rewards/mean"] == pytest.approx(sum(e["reward"] for e in eps) / 6)
    assert (run / "plots/no_signal_per_env.png").exists()


def test_a_mixture_with_dynamic_sampling_and_pools_resumes_to_an_uninterrupted_run(
    tiny_model_dir, tmp_path
):
    import coin_env  # noqa: F401
    from run_metrics import untimed_metrics

    from agentenv.run.train import train

    extra = {
        "pools": {"difficulty_pools": True, "retire_after": 1},
        "grpo": {"learning_rate": 1e-2, "dynamic_sampling": True},
    }
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(config=mix_config(tiny_model_dir, whole, 3, **extra))
    train(config=mix_config(tiny_model_dir, split, 2, **extra))
    train(config=mix_config(tiny_model_dir, split, 3, **extra), resume=True)
    adapter = "checkpoints/step_000003/adapter/adapter_model.safetensors"
    a, b = (load_file(run / adapter) for run in (whole, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [untimed_metrics(run) for run in (whole, split)]
    assert rows[0] == rows[1] and len(rows[0]) == 3
    for env in ("coin", "calc"):
        pools = [
            torch.load(r / f"checkpoints/step_000003/task_pool_{env}.pt") for r in (whole, split)
        ]
        assert pools[0] == pools[1] and pools[0]["groups"]
    for row in rows[0]:
        assert (
            row["sampling/groups_trained"]
            == row["sampling/groups_trained/coin"] + row["sampling/groups_trained/calc"]
        )
        assert row["sampling/groups_trained/coin"] <= 2 and row["sampling/groups_trained/calc"] <= 1


def test_a_population_on_a_mixture_measures_fitness_over_every_envs_slice(
    tiny_model_dir, tmp_path, capsys
):
    """2 validation tasks of each env: coin's parity rewards (0 or 1 each) and the
    Calculator's (0: a tiny random model never answers right), pooled over the 4 tasks:
    a fitness of 0, 1/4 or 1/2 (coin's alone would be 0, 1/2 or 1)."""
    import coin_env  # noqa: F401

    from agentenv.run.tracking import read_metrics
    from agentenv.run.train import train

    evolution = {"population": 2, "evolve_every": 1, "validation_tasks": 2}
    run = train(config=mix_config(tiny_model_dir, tmp_path / "pop", 2, evolution=evolution))
    assert "validation slice of coin's train split, 2 of its" in capsys.readouterr().err
    for row in read_metrics(run):
        for member in range(2):
            fitness = row[f"member{member}/fitness"]
            assert fitness in (0.0, 0.25, 0.5)
        assert row["member0/groups/coin"] == 2 and row["member1/groups/calc"] == 1


def test_the_mixture_recipe_has_each_single_env_recipes_env_and_limits():
    """examples/mixture_grpo.yaml: each env with the kwargs, turn and token limits of its
    single-env recipe, 4 groups of each a step (as many episodes as the three together)."""
    from pathlib import Path

    import agentenv

    examples = Path(__file__).parents[3] / "examples"
    mix = TrainConfig.resolve(examples / "mixture_grpo.yaml", {})
    singles = ["calculator_grpo", "rag_grpo", "workspace_grpo"]
    for spec, name in zip(mix.envs, singles, strict=True):
        one = TrainConfig.resolve(examples / f"{name}.yaml", {})
        assert (spec.env_id, spec.env_kwargs) == (one.env_id, one.env_kwargs)
        assert spec.limits() == {
            "max_turns": one.rollout.max_turns,
            "max_new_tokens": one.rollout.sampling.max_new_tokens,
            "max_episode_tokens": one.rollout.max_episode_tokens,
        }
        assert (mix.steps, one.steps, one.batch_size) == (25, 25, 4)
        agentenv.make(spec.env_id, **spec.env_kwargs).close()
    assert mix.mixture().quotas(0, mix.batch_size) == [4, 4, 4]
    assert mix.rollout.group_size == 8 and mix.grpo.learning_rate == 2e-4


def test_the_schedule_recipe_is_the_bridge_recipe_with_single_hop_questions_first():
    """examples/rag_schedule_grpo.yaml against examples/rag_bridge_grpo.yaml (both
    ``--profile multi-step --steps 32``): the same SFT, learning rate, groups and limits
    for the bridge; single-hop 1 -> 0 and bridge 0 -> 1 over steps 0-12, by hand:
    step 1 needs 8 * 1/12 = 0.67 bridge groups (1, owing 0.33), step 2 1.33 - 0.33 = 1,
    step 3 2, step 4 2.67 (3, owing 0.33), step 5 3, step 6 4, ... step 12 on all 8."""
    from pathlib import Path

    import agentenv

    examples = Path(__file__).parents[3] / "examples"
    flags = {"profile": "multi-step", "steps": 32}
    sched = TrainConfig.resolve(examples / "rag_schedule_grpo.yaml", flags)
    bridge = TrainConfig.resolve(examples / "rag_bridge_grpo.yaml", flags)
    for field in ("init_from", "steps", "batch_size"):
        assert getattr(sched, field) == getattr(bridge, field), field
    assert sched.rollout.group_size == bridge.rollout.group_size == 4
    assert sched.grpo == bridge.grpo and sched.rollout.sampling == bridge.rollout.sampling
    single, two_hop = sched.envs
    assert two_hop.env_kwargs == bridge.env_kwargs
    assert two_hop.limits()["max_turns"] == bridge.rollout.max_turns == 5
    assert single.limits()["max_turns"] == 3 and "question_types" not in single.env_kwargs
    mix = sched.mixture()
    bridge_groups = [mix.quotas(step, 8)[1] for step in range(32)]
    assert bridge_groups[:13] == [0, 1, 1, 2, 3, 3, 4, 5, 5, 6, 7, 7, 8]
    assert bridge_groups[13:] == [8] * 19 and sum(bridge_groups) == 204  # of 256
    for spec in sched.envs:
        agentenv.make(spec.env_id, **spec.env_kwargs).close()
