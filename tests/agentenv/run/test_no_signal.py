"""`agentenv train` says once when no group has had a learning signal for several steps."""

import functools
import shlex
from pathlib import Path

import agentenv
from agentenv.cli import _overrides, build_parser, main
from agentenv.run import train as train_module
from agentenv.run.config import TrainConfig
from agentenv.run.no_signal import (
    NO_SIGNAL_STEPS,
    EnvOffers,
    SignalWatch,
    env_offers,
    no_signal_message,
)

EXAMPLE = str(Path(__file__).resolve().parents[3] / "examples" / "custom_env.py")
FLAT = {"frac_reward_zero_std": 1.0, "rewards/mean": 0.0}  # every group's rewards equal
SOME = {"frac_reward_zero_std": 0.75, "rewards/mean": 0.1}  # one group in four differs


def fires(watch: SignalWatch, steps: list[dict[str, float]]) -> list[bool]:
    return [watch.update(m) for m in steps]


def test_the_watch_fires_once_after_n_steps_without_signal():
    n = NO_SIGNAL_STEPS
    assert n == 3
    assert fires(SignalWatch(), [FLAT] * (n - 1)) == [False] * (n - 1)
    assert fires(SignalWatch(), [FLAT] * (n + 4)) == [False] * (n - 1) + [True] + [False] * 4


def test_a_step_with_signal_restarts_the_count():
    watch = SignalWatch()
    assert fires(watch, [FLAT, FLAT, SOME, FLAT, FLAT]) == [False] * 5
    assert watch.streak == 2
    assert fires(watch, [FLAT]) == [True]
    assert watch.rewards == [0.0, 0.0, 0.0]  # the streak's steps only
    assert not any(fires(SignalWatch(), [SOME] * 10))


def test_under_turn_credit_equal_outcomes_with_different_turn_returns_teach():
    """GRPO's ``frac_no_signal`` counts per-turn returns too; the watch reads it first."""
    turns = {"frac_reward_zero_std": 1.0, "frac_no_signal": 0.75, "rewards/mean": 0.0}
    assert not any(fires(SignalWatch(), [turns] * 5))
    assert fires(SignalWatch(), [{**turns, "frac_no_signal": 1.0}] * 3)[-1]


def test_equal_nonzero_rewards_are_no_signal_either():
    watch = SignalWatch(patience=2)
    solved = {"frac_reward_zero_std": 1.0, "rewards/mean": 1.0}
    assert fires(watch, [solved, solved]) == [False, True]
    message = no_signal_message(TrainConfig(), watch.rewards, EnvOffers(True, True))
    assert "every group's 8 episodes got equal rewards (mean 1.00)" in message
    assert "larger --group-size (now 8)" in message and "--temperature 1.2" in message
    assert "agentenv sft" not in message  # a warm start does not help a solved task


def commands(message: str) -> list[list[str]]:
    """The commands in ``message``: each after its line's ``$ ``."""
    return [shlex.split(line.partition("$ ")[2]) for line in message.splitlines() if "$ " in line]


def test_the_message_gives_commands_that_parse_for_a_users_env():
    from agentenv.env.registration import import_module

    import_module(EXAMPLE)
    config = TrainConfig(env_id=f"{EXAMPLE}:Capitals-v0")
    offers = env_offers(lambda: agentenv.make("Capitals-v0"))
    assert offers == EnvOffers(demonstrations=True, compact_prompt=False)
    message = no_signal_message(config, [0.0] * 3, offers)
    assert message.startswith("agentenv train: every episode of the last 3 steps got reward 0")
    assert "prompt_style" not in message  # Capitals-v0 has no compact prompt
    sft, train = commands(message)
    parser = build_parser()
    assert sft[:3] == ["agentenv", "sft", config.env_id]
    assert _overrides(parser.parse_args(sft[1:])) == {
        "env_id": config.env_id,
        "output_dir": "runs/sft-Capitals-v0",
    }
    assert _overrides(parser.parse_args(train[1:])) == {
        "env_id": config.env_id,
        "init_from": "runs/sft-Capitals-v0/checkpoint",
    }
    assert "--temperature 1.2" in message


def test_the_message_offers_the_compact_prompt_where_the_env_has_one():
    config = TrainConfig(env_kwargs={"source": "word_problems"}, model="some/model")
    offers = env_offers(lambda: agentenv.make("Calculator-v0", **config.env_kwargs))
    assert offers == EnvOffers(demonstrations=True, compact_prompt=True)
    message = no_signal_message(config, [0.0] * 3, offers)
    sft, train, compact = commands(message)
    assert _overrides(build_parser().parse_args(compact[1:])) == {
        "env_id": "Calculator-v0",
        "env_kwargs": {"source": "word_problems", "prompt_style": "compact"},
        "model": "some/model",
    }
    warm = TrainConfig(env_kwargs={"prompt_style": "compact"}, init_from="runs/sft/checkpoint")
    message = no_signal_message(warm, [0.0] * 3, offers)
    assert "a longer warm start than runs/sft/checkpoint" in message
    assert commands(message) == [] and "prompt_style" not in message  # both in use


def test_train_prints_the_message_once(tiny_model_dir, tmp_path, capsys, monkeypatch):
    # a tiny random model writing 4 tokens never calls the tool: reward 0 at every step
    monkeypatch.setattr(train_module, "SignalWatch", functools.partial(SignalWatch, patience=2))
    flags = ["--model", tiny_model_dir, "--steps", "3", "--batch-size", "1", "--group-size", "2"]
    flags += ["--max-new-tokens", "4", "--eval-tasks", "0", "--output-dir", str(tmp_path)]
    flags += ["--save-every", "3", "--log-episodes", "0", "--no-tensorboard"]
    assert main(["train", f"{EXAMPLE}:Capitals-v0", *flags]) == 0
    err = capsys.readouterr().err
    assert err.count("agentenv train: every episode of the last 2 steps got reward 0") == 1
    assert f"agentenv sft {EXAMPLE}:Capitals-v0 --model {tiny_model_dir}" in err
