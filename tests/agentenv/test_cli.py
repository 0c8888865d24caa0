"""The command line's parsers: no abbreviated flags, a misspelt flag or env kwarg named with
the closest valid one, grouped help with one spelling per flag, inputs checked before any
model loads, and serve's token kept off the command line."""

import argparse
import json
import re
from typing import Any

import pytest

import agentenv
from agentenv import Task, ToolEnv
from agentenv.cli import _serve_token, build_parser, main
from agentenv.errors import InvalidOptionError
from agentenv.lm import models


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the command must stop before it."""
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("model loaded"))


def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [parser, *sub.choices.values()]


def test_no_parser_takes_an_abbreviated_flag():
    assert all(not p.allow_abbrev for p in parsers(build_parser()))


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["eval", "--num-task", "5"], "did you mean --num-tasks?"),  # was --num-tasks 5
        (["train", "--temp", "0.5"], "did you mean --temperature?"),  # was --temperature
        (["train", "--lr", "1e-4"], "did you mean --learning-rate or --lora-r?"),  # "ambiguous"
        (["train", "--bs", "8"], "did you mean --batch-size?"),
        (["train", "--learning-rat=1e-4"], "did you mean --learning-rate?"),
        (["sft", "--num-demo", "3"], "did you mean --num-demos?"),
    ],
)
def test_a_misspelt_flag_fails_naming_the_closest_one(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and suggestion in err
    assert f"usage: agentenv {argv[0]}" in err  # the sub-command's usage, short
    assert len(err.splitlines()) == 2


def test_the_underscore_spelling_still_works_but_help_shows_one(capsys):
    args = build_parser().parse_args(["train", "--env_id", "RAG-v0", "--no-use_lora"])
    assert args.env_id == "RAG-v0" and getattr(args, "grpo.use_lora") is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    assert "--env-id STR" in text and "--env_id" not in text and "--use_lora" not in text


def test_train_help_is_grouped_by_section_without_redundant_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    titles = re.findall(r"^(\S[^\n]*):$", text, flags=re.M)
    sections = [t.split(":")[0] for t in titles if not t.startswith(("positional", "options"))]
    assert sections == [
        "top level",
        "top level",
        "rollout",
        "rollout.sampling",
        "grpo",
        "grpo",
        "generation",
        "evolution",
        "pools",
    ]
    assert "(default: None)" not in text
    assert "(default runs/<env>-<time>). (default:" not in text  # a default stated twice
    assert "(default: 20)" in text  # --steps: a default the help does not state
    assert text.count("--steps") == 1  # the usage line does not list every flag


def test_a_misspelt_env_kwarg_fails_before_the_model_loads(no_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where a run directory would go
    bad = json.dumps({"sourc": "word_problems"})
    for command in (["eval"], ["train"], ["sft"], ["demo"]):
        assert main([*command, "--env-kwargs", bad]) == 2
        err = capsys.readouterr().err
        assert "takes no argument 'sourc'" in err and "did you mean 'source'?" in err
        assert "split, source, num_tasks" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no run directory left behind


class NoDemosEnv(ToolEnv):
    """An env without ``demonstration``: nothing for ``agentenv sft`` to learn from."""

    def __init__(self, *, split: str = "train"):
        super().__init__([], split=split)

    @property
    def num_tasks(self) -> int:
        return 2

    def get_task(self, index: int) -> Task:
        return Task(id=str(index), prompt="Say hi.", answer="hi")

    def score(self, answer: str, task: Task) -> tuple[float, dict[str, Any]]:
        return float(answer == "hi"), {"correct": answer == "hi"}


@pytest.fixture
def no_demos_env():
    agentenv.register("NoDemos-v0", entry_point=NoDemosEnv)
    yield "NoDemos-v0"
    agentenv.deregister("NoDemos-v0")


def test_sft_on_an_env_without_demonstrations_fails_before_the_model_loads(
    no_demos_env, no_model, tmp_path, capsys
):
    assert main(["sft", no_demos_env, "--output-dir", str(tmp_path / "sft")]) == 2
    err = capsys.readouterr().err
    assert "NoDemos-v0 offers no demonstrations" in err
    assert "demonstration(task) method" in err and "Calculator" not in err
    assert not (tmp_path / "sft").exists()  # nothing written either


def test_serve_reads_the_token_from_a_file_or_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SECRET_VAR", "from-env")
    args = build_parser().parse_args(["serve", "Calculator-v0"])
    assert _serve_token(args, "SECRET_VAR") == "from-env"
    path = tmp_path / "token"
    path.write_text("from-file\n")
    args = build_parser().parse_args(["serve", "Calculator-v0", "--token-file", str(path)])
    assert _serve_token(args, "SECRET_VAR") == "from-file"
    assert capsys.readouterr().err == ""
    path.write_text("\n")
    with pytest.raises(InvalidOptionError, match="is empty"):
        _serve_token(args, "SECRET_VAR")
    args.token_file = str(tmp_path / "missing")
    with pytest.raises(InvalidOptionError, match="--token-file .*missing: cannot read it"):
        _serve_token(args, "SECRET_VAR")


def test_a_token_on_the_command_line_works_but_warns(capsys):
    args = build_parser().parse_args(["serve", "Calculator-v0", "--token", "s3cret"])
    assert _serve_token(args, "SECRET_VAR") == "s3cret"
    err = capsys.readouterr().err
    assert "warning: --token puts the secret where `ps`" in err
    assert "--token-file PATH" in err and "SECRET_VAR" in err
    with pytest.raises(SystemExit):  # one or the other
        build_parser().parse_args(["serve", "X-v0", "--token", "a", "--token-file", "b"])
