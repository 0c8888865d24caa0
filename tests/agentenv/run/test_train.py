"""End-to-end: the training loop, SFT warm start, resume, artifacts, CLI (tiny model)."""

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from run_metrics import untimed_metrics

import agentenv
from agentenv import config as config_lib
from agentenv.cli import main
from agentenv.errors import InvalidOptionError
from agentenv.run.config import TrainConfig
from agentenv.run.tracking import read_metrics
from agentenv.run.train import task_seeds, train
from algorithms.checkpoint import latest_checkpoint

ENV = {"source": "word_problems", "prompt_style": "compact"}


def config(model_dir, out, **kw):
    base = dict(
        model=model_dir,
        env_kwargs=ENV,
        steps=2,
        batch_size=2,
        rollout={
            "group_size": 2,
            "max_turns": 2,
            "max_episode_tokens": 256,
            "sampling": {"max_new_tokens": 6},
        },
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
        "time/learn_s",
        "rollout/env_errors",
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
        "tool_calls.png",
        "tool_calls_histogram.png",
    }
    assert latest_checkpoint(run / "checkpoints").name == "step_000002"
    assert (run / "eval" / "before.json").exists() and (run / "eval" / "after.json").exists()
    out = capsys.readouterr().out
    assert "accuracy diff (after - before)" in out and "plots:" in out
    assert 'env:     Calculator-v0 {"source": "word_problems"' in out
    assert main(["show", str(run), "--step", "1"]) == 0
    html = (run / "viewer" / "step_000001.html").read_text()
    assert "class='p'" in html and "class='e'" in html
    assert "[turn 1: step reward" in html and "advantage" in html
    assert main(["show", str(run), "--step", "9"]) == 2  # clear error, lists steps
    assert main(["plot", str(run)]) == 0


def test_a_resumed_run_ends_with_the_weights_and_metrics_of_an_uninterrupted_one(
    tiny_model_dir, tmp_path
):
    import coin_env  # noqa: F401  (registers CoinCalculator-v0)
    from safetensors.torch import load_file

    kw = {"env_id": "CoinCalculator-v0", "batch_size": 4, "eval_tasks": 0}
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(config=config(tiny_model_dir, whole, steps=3, **kw))
    train(config=config(tiny_model_dir, split, steps=2, **kw))
    # a kill during the step-3 save leaves a half-written folder: never picked up
    partial = split / "checkpoints" / "step_000003.tmp-999"
    partial.mkdir()
    (partial / "optimizer.pt").write_text("torn")
    train(config=config(tiny_model_dir, split, steps=3, **kw), resume=True)
    assert [r["step"] for r in read_metrics(split)] == [1, 2, 3]  # none repeated or skipped
    state = json.loads(
        (latest_checkpoint(split / "checkpoints") / "trainer_state.json").read_text()
    )
    assert state["step"] == 3
    assert task_seeds(0, 2, 2) == task_seeds(0, 2, 2) != task_seeds(0, 1, 2)
    adapter = "checkpoints/step_000003/adapter/adapter_model.safetensors"
    a, b = (load_file(run / adapter) for run in (whole, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)  # it did learn something
    rows = [untimed_metrics(run) for run in (whole, split)]
    assert rows[0] == rows[1] and len(rows[0]) == 3


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
    recorded = json.loads((ckpt / "run.json").read_text())  # what eval --adapter reuses
    assert recorded == {"env_id": "Calculator-v0", "env_kwargs": ENV, "quantize": None}
    sft_rows = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").open()]
    assert sft_rows and all(r["sft/loss"] > 0 for r in sft_rows)
    run = train(
        config=config(tiny_model_dir, tmp_path / "grpo", steps=1, eval_tasks=0, init_from=str(ckpt))
    )
    recorded = json.loads((latest_checkpoint(run / "checkpoints") / "run.json").read_text())
    assert recorded["env_kwargs"] == ENV and recorded["max_turns"] == 2
    assert recorded["max_new_tokens"] == 6 and recorded["max_episode_tokens"] == 256
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
    assert "+0.0000 ± 0.0000 (paired stderr)" in capsys.readouterr().out


def test_config_file_and_flags_deep_merge_with_one_owner_per_value(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "steps: 7\nrollout: {group_size: 4, sampling: {temperature: 0.5}}\n"
        "grpo: {learning_rate: 2.0e-4, loss_type: grpo}\n"
    )
    cfg = TrainConfig.resolve(path, {"batch_size": 3, "grpo": {"beta": 0.04}})
    assert (cfg.steps, cfg.batch_size, cfg.rollout.group_size) == (7, 3, 4)
    # the flag's beta joins the file's grpo section instead of replacing it
    assert (cfg.grpo.learning_rate, cfg.grpo.loss_type, cfg.grpo.beta) == (2e-4, "grpo", 0.04)
    # keys the file leaves out keep the training defaults, not RolloutConfig's own
    assert (cfg.rollout.max_turns, cfg.rollout.sampling.max_new_tokens) == (3, 64)
    assert cfg.rollout.sampling.temperature == 0.5
    saved = config_lib.to_dict(cfg)
    assert config_lib.from_dict(TrainConfig, saved) == cfg  # config.json reads back


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz: 7\n", "unknown key 'stepz' in the top level .*did you mean 'steps'"),
        ("grpo: {betta: 0.1}\n", "unknown key 'betta' in section 'grpo'.*did you mean 'beta'"),
        (
            "rollout: {sampling: {temprature: 0.1}}\n",
            "'temprature' in section 'sampling'.*did you mean 'temperature'",
        ),
        ("grpo: 0.1\n", "'grpo' in .* is a section"),
        ("rollout: {sampling: {temperature: 0}}\n", "temperature must be > 0 for training"),
        ("grpo: {loss_type: ppo}\n", "loss_type must be one of"),
        ("dtype: float64\n", "float64"),
        ("grpo: {critic_input: both}\n", "critic_input must be one of .*'learner', 'sampler'"),
        (
            "grpo: {credit: gae, critic_input: sampler}\ngeneration: {engine: vllm}\n",
            "critic_input='sampler' with engine vllm.*use engine agentenv",
        ),
    ],
)
def test_bad_config_keys_and_values_name_the_key_and_the_fix(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(InvalidOptionError, match=message):
        TrainConfig.resolve(path)


def test_every_setting_is_a_flag_with_its_help(capsys):
    from agentenv.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for flag, help_words in [
        ("--temperature", "Sampling temperature"),
        ("--learning-rate", "Peak AdamW LR"),
        ("--group-size", "Episodes per task"),
        ("--dtype", "Compute dtype"),
        ("--max-new-tokens", "Most tokens per policy turn"),
        ("--beta", "KL coefficient"),
    ]:
        assert flag in text and help_words in text, flag
    args = build_parser().parse_args(["train", "--temperature", "0.5", "--lora-r", "8"])
    overrides = config_lib.flag_overrides(args, args.config_flags)
    assert overrides == {"rollout": {"sampling": {"temperature": 0.5}}, "grpo": {"lora_r": 8}}


def test_a_misspelt_flag_or_key_fails_before_any_model_loads(tmp_path, monkeypatch, capsys):
    from agentenv.lm import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("model loaded"))
    path = tmp_path / "c.yaml"
    path.write_text("grpo: {betta: 0.1}\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "did you mean 'beta'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--betta", "0.1"])
    assert main(["train", "--temperature", "0"]) == 2
    assert "temperature must be > 0" in capsys.readouterr().err


def test_one_owner_per_value_across_every_command():
    """Flags are flat: a leaf name owned by two fields would fail to build the parser."""
    from agentenv.run.config import EvalRunConfig, SFTRunConfig

    for cfg in (TrainConfig(), SFTRunConfig(), EvalRunConfig()):
        config_lib.add_flags(argparse.ArgumentParser(), cfg)

    @dataclasses.dataclass
    class Twice:
        temperature: float = 1.0
        rollout: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    with pytest.raises(ValueError, match="'temperature' is owned twice"):
        config_lib.add_flags(argparse.ArgumentParser(), Twice())


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
    from agentenv.run.evaluate import EvalReport

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


EXAMPLE = str(Path(__file__).resolve().parents[3] / "examples" / "custom_env.py")


def test_a_users_env_works_from_every_command(tiny_model_dir, tmp_path, capsys):
    assert main(["list", "--import", EXAMPLE]) == 0
    assert "agentenv/Capitals-v0" in capsys.readouterr().out
    out = tmp_path / "run"
    flags = ["--model", tiny_model_dir, "--steps", "1", "--batch-size", "1", "--group-size", "2"]
    flags += ["--max-new-tokens", "4", "--eval-tasks", "0", "--output-dir", str(out)]
    assert main(["train", f"{EXAMPLE}:Capitals-v0", *flags]) == 0
    assert json.loads((out / "config.json").read_text())["env_id"].endswith(":Capitals-v0")
    assert len(read_metrics(out)) == 1
    assert main(["train", "no_such_module_here:Capitals-v0", *flags]) == 2
    assert "could not import 'no_such_module_here'" in capsys.readouterr().err


def test_the_cli_reference_is_up_to_date():
    from agentenv.cli import reference

    path = Path(__file__).resolve().parents[3] / "docs" / "cli.md"
    assert path.read_text() == reference(), (
        "docs/cli.md is stale: python -m agentenv.cli reference > docs/cli.md"
    )


@pytest.mark.parametrize(
    "flags, metrics",
    [
        (
            ["--advantage-baseline", "group_median", "--reward-clip", "0.5"]
            + ["--entropy-coef", "0.01", "--beta", "0.1", "--kl-estimator", "k2"],
            ["advantages/std", "rewards/mean", "entropy", "kl"],
        ),
        (
            ["--advantage-baseline", "global_mean", "--advantage-norm", "mean_only"]
            + ["--loss-type", "cispo", "--epsilon-low", "0.9", "--epsilon-high", "4"]
            + ["--beta", "0.1", "--kl-placement", "reward"],
            ["advantages/std", "clip_ratio/high_mean", "rewards/kl_penalty_mean"],
        ),
        (
            ["--reward-combination", "pca", "--beta", "0.1", "--reference", "base"],
            ["rewards/components/reward", "kl"],  # Calculator: 1 reward component
        ),
    ],
    ids=["median-clip-entropy-k2", "global-cispo-kl-reward", "pca-ref-base"],
)
def test_each_grpo_option_runs_from_the_cli_and_logs_its_metric(
    tiny_model_dir, tmp_path, flags, metrics
):
    """Every GRPO option, from the command line to config.json and a logged metric (three
    runs that each combine compatible options; the options' maths is tested in
    tests/algorithms)."""
    out = tmp_path / "run"
    common = ["--model", tiny_model_dir, "--steps", "1", "--batch-size", "1", "--group-size", "2"]
    common += ["--max-new-tokens", "4", "--eval-tasks", "0", "--output-dir", str(out)]
    assert main(["train", "Calculator-v0", *common, *flags]) == 0
    saved = json.loads((out / "config.json").read_text())["grpo"]
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        saved_value = saved[name.removeprefix("--").replace("-", "_")]
        assert saved_value == (value if isinstance(saved_value, str) else float(value))
    (row,) = read_metrics(out)
    for metric in metrics:
        assert metric in row and row[metric] == row[metric], metric  # logged and not NaN


def test_profiles_sit_under_the_config_file_and_flags(tmp_path, capsys):
    from agentenv.run.profiles import PROFILES

    conservative = TrainConfig.resolve(None, {"profile": "conservative"})
    assert conservative.grpo.beta == 0.04 and conservative.grpo.learning_rate == 2e-5
    assert conservative.grpo.max_grad_norm == 0.5 and conservative.rollout.group_size == 8
    flagged = TrainConfig.resolve(None, {"profile": "aggressive", "grpo": {"learning_rate": 3e-5}})
    assert flagged.grpo.learning_rate == 3e-5  # the flag wins
    assert flagged.grpo.entropy_coef == 0.001 and flagged.grpo.num_iterations == 2
    path = tmp_path / "run.yaml"
    path.write_text("profile: balanced\ngrpo:\n  beta: 0.1\n")
    filed = TrainConfig.resolve(path, {})
    assert filed.grpo.beta == 0.1 and filed.grpo.epsilon_high == 0.28  # file over profile
    for name, bundle in PROFILES.items():  # every bundle is a valid config
        assert TrainConfig.resolve(None, {"profile": name}).profile == name
        assert set(bundle) <= {"batch_size", "rollout", "grpo"}
    multi = TrainConfig.resolve(None, {"profile": "multi-step"})
    assert (multi.batch_size, multi.rollout.group_size) == (8, 4)
    assert (multi.grpo.credit, multi.grpo.critic_input, multi.grpo.turn_reward_weight) == (
        "gae",
        "sampler",
        1.0,
    )
    path.write_text("profile: multi-step\nbatch_size: 4\n")  # a recipe's own batch wins
    assert TrainConfig.resolve(path, {}).batch_size == 4
    examples = Path(__file__).resolve().parents[3] / "examples"
    for recipe in ("rag_bridge_grpo", "calculator_grpo", "calculator_prices_grpo"):
        spread = TrainConfig.resolve(examples / f"{recipe}.yaml", {"profile": "multi-step"})
        assert (spread.batch_size, spread.rollout.group_size) == (8, 4), recipe  # as documented
        plain = TrainConfig.resolve(examples / f"{recipe}.yaml", {})
        assert (plain.batch_size, plain.rollout.group_size, plain.grpo.credit) == (4, 8, "bandit")
    with pytest.raises(InvalidOptionError, match="critic_input='sampler' with engine vllm"):
        TrainConfig.resolve(None, {"profile": "multi-step", "generation": {"engine": "vllm"}})
    with pytest.raises(InvalidOptionError, match="'aggressive', 'balanced', 'conservative'"):
        TrainConfig.resolve(None, {"profile": "wild"})
    assert main(["train", "--profile", "wild"]) == 2  # before any model loads
    assert "profile must be one of" in capsys.readouterr().err


def test_a_profile_run_records_its_values(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    flags = ["--model", tiny_model_dir, "--steps", "1", "--batch-size", "1", "--group-size", "2"]
    flags += ["--max-new-tokens", "4", "--eval-tasks", "0", "--output-dir", str(out)]
    assert main(["train", "Calculator-v0", "--profile", "conservative", *flags]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["profile"] == "conservative"
    assert saved["grpo"]["beta"] == 0.04 and saved["grpo"]["learning_rate"] == 2e-5
    assert saved["rollout"]["group_size"] == 2  # the flag
    assert "kl" in read_metrics(out)[0]


def test_episode_and_per_turn_stats_by_hand():
    from agentenv.rollout.episode import Episode
    from agentenv.run.train import _episode_stats

    def ep(turns, policy, stop, **info):
        mask = [0] + [1] * policy
        return Episode(
            [1] * len(mask), mask, [0.0] * len(mask), num_turns=turns, stop_reason=stop, info=info
        )

    groups = [
        [ep(3, 30, "terminated", answer="4", correct=True, num_tool_calls=2, num_tool_errors=1)],
        [ep(1, 10, "max_tokens", num_tool_calls=0)],
    ]
    stats = _episode_stats(groups)
    assert stats["episodes/mean_turns"] == 2.0 and stats["episodes/max_turns"] == 3.0
    assert stats["episodes/unfinished_rate"] == 0.5 and stats["episodes/correct_rate"] == 0.5
    assert stats["turns/policy_tokens_mean"] == 40 / 4  # per policy turn
    assert stats["turns/tool_calls_mean"] == 2 / 4 and stats["turns/tool_errors_mean"] == 1 / 4


@pytest.mark.parametrize("name", ["calculator_grpo", "rag_grpo", "workspace_grpo"])
def test_the_example_recipes_resolve_and_their_envs_build(name):
    path = Path(__file__).parents[3] / "examples" / f"{name}.yaml"
    cfg = TrainConfig.resolve(path, {})
    assert cfg.init_from and cfg.rollout.group_size >= 2 and cfg.steps > 0
    env = agentenv.make(cfg.env_id, **cfg.env_kwargs)  # every env kwarg is a real argument
    try:
        obs, _ = env.reset(seed=0)
        assert env.unwrapped.prompt_style == "compact" == cfg.env_kwargs["prompt_style"]
    finally:
        env.close()


def _length_reward_env(**kwargs):  # noqa: ANN003, ANN202
    """The word-problems Calculator, but every episode takes two actions: each is paid a
    turn reward from its length (``info["turn_reward"]``) and the second ends the episode
    with an outcome from its length (0, 0.25, 0.5 or 0.75: under 0.5 too, for the
    reward-clip case), so a tiny random model's groups differ in both."""
    from envs.calculator.env import CalculatorEnv

    class LengthReward(CalculatorEnv):
        def reset(self, *, seed=None, options=None):  # noqa: ANN001, ANN202
            self.taken = 0
            return super().reset(seed=seed, options=options)

        def step(self, action):  # noqa: ANN001, ANN202
            obs, _, _, _, info = super().step(action)
            self.taken += 1
            done = self.taken == 2
            info["turn_reward"] = float(len(action) % 2)
            return obs, (len(action) % 4) / 4 if done else 0.0, done, False, info

    return LengthReward(**kwargs)


@pytest.mark.parametrize(
    "grpo",
    [
        {},
        {"advantage_baseline": "group_median", "advantage_norm": "mean_only"},
        {"advantage_baseline": "global_mean"},
        {"reward_clip": 0.5, "advantage_norm": "mean_only"},
        {"credit": "turn"},
        {"credit": "gae"},
        {"credit": "gae", "critic_input": "sampler"},
    ],
    ids=["default", "median", "global", "clip", "turn", "gae", "gae_sampler_states"],
)
def test_logged_advantages_are_the_trained_ones(tiny_model_dir, tmp_path, monkeypatch, grpo):
    from algorithms.grpo import GRPO
    from algorithms.losses import compute_advantages

    agentenv.register("LengthReward-v0", entry_point=_length_reward_env, override=True)
    trained = []
    learn = GRPO.learn

    def spy(self, groups):  # noqa: ANN001, ANN202
        metrics = learn(self, groups)
        turns = self.last_turn_advantages
        trained.append((self.last_advantages.flatten().tolist(), groups, turns))
        return metrics

    monkeypatch.setattr(GRPO, "learn", spy)
    cfg = config(tiny_model_dir, tmp_path / "run", steps=1, eval_tasks=0, log_episodes=4)
    cfg = dataclasses.replace(
        cfg, env_id="LengthReward-v0", grpo={"learning_rate": 1e-3, **grpo}, seed=3
    )
    run = train(config=cfg)
    ((want, groups, turns),) = trained
    logged = [json.loads(x) for x in (run / "episodes" / "step_000001.jsonl").open()]
    assert [e["advantage"] for e in logged] == pytest.approx(want) and any(want)
    assert all(ep.num_turns == 2 for g in groups for ep in g)  # credit over two turns
    episodes = [ep for g in groups for ep in g][:4]
    if turns:  # per-turn credit: the turns of an episode were trained apart
        assert any(len(set(t)) == 2 for t in turns)
    want_turns = (
        turns[:4]
        if turns
        else [[a] * ep.num_turns for a, ep in zip(want[:4], episodes, strict=True)]
    )
    for e, values in zip(logged, want_turns, strict=True):
        assert e["turn_advantages"] == pytest.approx(values)
    assert [e["turn_spans"] for e in logged] == [
        [list(s) for s in ep.turn_spans] for ep in episodes
    ]
    assert [e["step_rewards"] for e in logged] == [ep.step_rewards for ep in episodes]
    assert [e["reward"] for e in logged] == [ep.reward for g in groups for ep in g]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    values = torch.tensor([a for t in turns for a in t] if turns else want, dtype=torch.float64)
    (row,) = [m for m in metrics if "advantages/mean" in m]  # the logged are the trained ones
    assert row["advantages/mean"] == pytest.approx(values.mean().item(), abs=1e-6)
    assert row["advantages/std"] == pytest.approx(values.std(correction=0).item(), abs=1e-6)
    if grpo.get("critic_input") == "sampler":  # the critic read every episode's own states
        assert [m["critic/sampler_states"] for m in metrics if "critic/sampler_states" in m] == [1]
    if grpo.get("reward_clip"):  # what the loop wrote before: advantages of unclipped rewards
        rewards = torch.tensor([[ep.reward for ep in g] for g in groups])
        assert compute_advantages(rewards, "mean_only").flatten().tolist() != pytest.approx(want)


FLAKY = {"fail": "never", "calls": 0}  # what Flaky-v0's steps do: never / every 3rd / always
_flaky_lock = __import__("threading").Lock()


def _flaky_env(**kwargs):  # noqa: ANN003, ANN202
    """The word-problems Calculator behind a backend that fails now and then, as a new
    user's env does: ``step`` raises a connection error (``FLAKY["fail"] == "third"``: every
    third call; ``"always"``) or hangs for 5 s (``"hang"``: every third call)."""
    import time

    from envs.calculator.env import CalculatorEnv

    class Flaky(CalculatorEnv):
        def step(self, action):  # noqa: ANN001, ANN202
            with _flaky_lock:
                FLAKY["calls"] += 1
                hit = FLAKY["fail"] == "always" or (
                    FLAKY["fail"] in ("third", "hang") and FLAKY["calls"] % 3 == 0
                )
            if hit and FLAKY["fail"] == "hang":
                time.sleep(5)
            elif hit:
                raise RuntimeError("flaky backend: connection reset")
            obs, _, _, _, info = super().step(action)
            return obs, float(len(action) % 3), True, False, info  # reward variance

    return Flaky(**kwargs)


@pytest.mark.parametrize("fail", ["third", "hang"])
def test_failed_episodes_end_alone_and_teach_nothing(tiny_model_dir, tmp_path, monkeypatch, fail):
    """A step that raises or hangs ends only its episode (env_error / timeout); the batch
    goes on; the failed episodes get no advantage and no gradient."""
    from algorithms.grpo import GRPO

    agentenv.register("Flaky-v0", entry_point=_flaky_env, override=True)
    monkeypatch.setitem(FLAKY, "fail", fail)
    monkeypatch.setitem(FLAKY, "calls", 0)
    trained = []
    learn = GRPO.learn

    def spy(self, groups):  # noqa: ANN001, ANN202
        metrics = learn(self, groups)
        trained.append((self.last_advantages.flatten().tolist(), groups, metrics))
        return metrics

    monkeypatch.setattr(GRPO, "learn", spy)
    cfg = config(tiny_model_dir, tmp_path / "run", eval_tasks=0, log_episodes=0, seed=3)
    rollout = {"group_size": 3, "max_turns": 1, "sampling": {"max_new_tokens": 6}}
    if fail == "hang":
        rollout["episode_timeout_s"] = 1.5
    cfg = dataclasses.replace(cfg, env_id="Flaky-v0", rollout=rollout, max_failed_fraction=0.5)
    run = train(config=cfg)
    assert len(trained) == 2  # both steps learned
    reason = "env_error" if fail == "third" else "timeout"
    for advantages, groups, metrics in trained:
        episodes = [e for g in groups for e in g]
        failed = [e.failed for e in episodes]
        assert sum(failed) == 2  # 6 single-step episodes, every third step fails
        assert all(e.stop_reason == reason for e in episodes if e.failed)
        assert all(a == 0.0 for a, f in zip(advantages, failed, strict=True) if f)
        assert metrics["frac_failed"] == pytest.approx(2 / 6)
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["episodes/failed_rate"] for r in rows] == pytest.approx([2 / 6, 2 / 6])


def test_a_step_over_the_failure_budget_stops_the_run_and_resume_goes_on(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Step 2's env fails on every action: the run stops before learning from it, naming
    the counts, the first error and the fix; step 1's checkpoint is intact, and once the
    env is healthy ``--resume`` finishes the run."""
    agentenv.register("Flaky-v0", entry_point=_flaky_env, override=True)
    monkeypatch.setitem(FLAKY, "fail", "never")
    cfg = config(tiny_model_dir, tmp_path / "run", eval_tasks=0, log_episodes=0)
    cfg = dataclasses.replace(cfg, env_id="Flaky-v0", max_failed_fraction=0.25)
    from algorithms.grpo import GRPO

    learn = GRPO.learn

    def then_fail(self, groups):  # noqa: ANN001, ANN202
        metrics = learn(self, groups)
        FLAKY["fail"] = "always"  # the backend goes down after step 1
        return metrics

    monkeypatch.setattr(GRPO, "learn", then_fail)
    from agentenv.errors import EnvFailureError

    with pytest.raises(EnvFailureError) as caught:
        train(config=cfg)
    message = str(caught.value)
    assert "step 2: 4 of 4 episodes failed (env_error 4" in message
    assert "first error here: RuntimeError: flaky backend: connection reset" in message
    assert "max_failed_fraction=0.25" in message and "--resume" in message
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_000001"
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1]
    monkeypatch.setattr(GRPO, "learn", learn)
    FLAKY["fail"] = "never"  # the backend is back
    train(config=cfg, resume=True)
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2]
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_000002"


def test_max_failed_fraction_outside_0_1_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidOptionError, match="max_failed_fraction must be in \\[0, 1\\]"):
        config("m", tmp_path, max_failed_fraction=1.5)
