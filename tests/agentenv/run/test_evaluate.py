import json

import pytest

import agentenv
from agentenv.errors import InvalidOptionError
from agentenv.rollout.collect import ScriptedPolicy
from agentenv.rollout.episode import ChatFormat, Episode
from agentenv.run.config import EvalConfig
from agentenv.run.evaluate import (
    EvalReport,
    compare,
    evaluate,
    format_table,
    pass_at_k,
    summarize,
    turn_fractions,
)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),
        (5, 2, 2, 0.7),
        (4, 0, 2, 0.0),
        (4, 4, 1, 1.0),
        (10, 3, 8, 1.0),
        (10, 1, 3, 0.3),
        (2, 1, 2, 1.0),
    ],
)
def test_pass_at_k_known_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def make_env():
    return agentenv.make("Calculator-v0", source="basic_arithmetic", split="test", max_turns=3)


def scripted_policy(tokenizer):
    """Task i: i%3==0 calculator then right answer; i%3==1 wrong answer; i%3==2 never answers."""
    tasks = make_env()._tasks
    index = {t.prompt: i for i, t in enumerate(tasks)}

    def respond(prompt: str) -> str:
        i = next(i for q, i in index.items() if f"<|im_start|>user\n{q}<|im_end|>" in prompt)
        turn = prompt.count("<|im_start|>assistant") - 1
        if i % 3 == 0:
            expr = tasks[i].metadata["expression"]
            call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
            return (
                f"<tool_call>{call}</tool_call>"
                if turn == 0
                else f"<answer>{tasks[i].answer}</answer>"
            )
        if i % 3 == 1:
            return f"<answer>{float(tasks[i].answer) + 1}</answer>"
        return "Let me think about it."

    return ScriptedPolicy(tokenizer, respond)


def test_eval_metrics_equal_hand_computed_values(tokenizer):
    config = EvalConfig(num_tasks=12, max_turns=5, tasks_per_batch=5)
    report = evaluate(
        make_env,
        scripted_policy(tokenizer),
        ChatFormat(tokenizer),
        config,
        label="scripted",
        show_progress=False,
    )
    m = report.metrics
    assert report.per_task == [1.0 if i % 3 == 0 else 0.0 for i in range(12)]
    assert m["accuracy"] == pytest.approx(4 / 12) and m["pass@1"] == pytest.approx(4 / 12)
    assert m["mean_reward"] == pytest.approx(4 / 12)
    assert m["answer_rate"] == pytest.approx(8 / 12)
    assert m["tool_call_rate"] == pytest.approx(4 / 12)
    assert m["tool_error_rate"] == 0.0
    assert m["mean_turns"] == pytest.approx((4 * 2 + 4 * 1 + 4 * 3) / 12)  # env max_turns=3
    assert m["accuracy_stderr"] == pytest.approx(((1 / 3) * (2 / 3) / 12) ** 0.5)


def test_pass_at_k_from_groups():
    def ep(correct):
        return Episode(
            [1, 2], [0, 1], [0.0, -1.0], reward=float(correct), info={"correct": correct}
        )

    groups = [[ep(True), ep(False), ep(False), ep(False)], [ep(False)] * 4]
    m = summarize(groups)
    assert m["pass@1"] == pytest.approx(0.125)
    assert m["pass@2"] == pytest.approx((1 - 3 / 6) / 2)
    assert m["pass@4"] == pytest.approx(0.5)
    assert "pass@8" not in m
    assert m["failed_rate"] == m["env_error_rate"] == m["timeout_rate"] == 0.0


def test_failed_episodes_are_reported_apart_and_count_as_incorrect():
    def ep(stop, correct=False):
        return Episode([1, 2], [0, 1], [0.0, -1.0], stop_reason=stop, info={"correct": correct})

    groups = [[ep("terminated", True), ep("env_error")], [ep("timeout"), ep("max_turns")]]
    m = summarize(groups)
    assert m["failed_rate"] == 0.5
    assert m["env_error_rate"] == m["timeout_rate"] == 0.25
    assert m["accuracy"] == 0.25


def test_a_conversations_turn_accuracy_counts_every_user_turn_of_the_task():
    """Per task, the share of its user turns answered correctly, over its episodes; an
    episode cut short counts what it got (its last info), a failed one 0."""

    def ep(info, stop="terminated"):
        return Episode([1, 2], [0, 1], [0.0, -1.0], stop_reason=stop, info=info)

    done = {"correct": True, "turns_correct": 3, "user_turns": 3}
    cut = {"turns_correct": 1, "user_turns": 4}  # ran out of turns in turn 2 of 4
    groups = [[ep(done), ep(cut, "max_turns")], [ep({}, "env_error"), ep(cut, "max_turns")]]
    assert turn_fractions(groups) == [(1 + 0.25) / 2, (0 + 0.25) / 2]
    m = summarize(groups)
    assert m["turn_accuracy"] == pytest.approx((0.625 + 0.125) / 2) and m["accuracy"] == 0.25
    plain = [[ep({"correct": True})]]  # no conversation: no turn accuracy
    assert turn_fractions(plain) == [] and "turn_accuracy" not in summarize(plain)
    a = EvalReport({}, [0.0, 0.0], per_task_turns=[0.25, 0.5])
    b = EvalReport({}, [1.0, 0.0], per_task_turns=[1.0, 0.5])
    d = compare(a, b)
    assert d["turn_accuracy_diff"] == pytest.approx(0.375)  # (0.75 + 0) / 2
    assert d["turn_accuracy_diff_stderr"] == pytest.approx((2 * 0.375**2 / 1 / 2) ** 0.5)
    assert "turn accuracy diff: +0.3750" in format_table([a, b])
    assert "turn_accuracy_diff" not in compare(EvalReport({}, [0.0, 1.0]), b)


def test_report_roundtrip_and_paired_compare(tmp_path):
    a = EvalReport({"accuracy": 0.25}, [1.0, 0.0, 0.0, 0.0], label="a")
    b = EvalReport({"accuracy": 0.75}, [1.0, 1.0, 1.0, 0.0], label="b")
    a.save(tmp_path / "a.json")
    assert EvalReport.load(tmp_path / "a.json") == a
    d = compare(a, b)
    assert d["accuracy_diff"] == pytest.approx(0.5)
    diffs = [0, 1, 1, 0]  # paired: stderr of the per-task differences
    var = sum((x - 0.5) ** 2 for x in diffs) / 3
    assert d["accuracy_diff_stderr"] == pytest.approx((var / 4) ** 0.5)
    table = format_table([a, b])
    assert "accuracy" in table and "0.5000 ±" in table
    with pytest.raises(InvalidOptionError, match="different task counts"):
        compare(a, EvalReport({}, [1.0]))


def test_compare_part_pairs_a_mixtures_env_with_that_env_run_alone(tmp_path, capsys):
    """`eval --compare ALONE MIX --part calc` pairs the mixture's calc tasks (2 of 4 right)
    with the calc run's (1 of 4): +0.25, not the pooled 6 tasks' count mismatch."""
    from dataclasses import asdict

    from agentenv.cli import main

    calc, rag = EvalReport({}, [1, 0, 0, 1], label="mix"), EvalReport({}, [1, 1], label="mix")
    mix = EvalReport({"accuracy": 4 / 6}, [1, 0, 0, 1, 1, 1], label="mix")
    mix.by_env = {"calc": asdict(calc), "rag": asdict(rag)}
    alone = EvalReport({"accuracy": 0.25}, [0, 0, 0, 1], label="alone")
    mix.save(tmp_path / "mix.json")
    alone.save(tmp_path / "alone.json")
    files = [str(tmp_path / "alone.json"), str(tmp_path / "mix.json")]
    assert main(["eval", "--compare", *files, "--part", "calc"]) == 0
    assert "accuracy diff (mix - alone): +0.2500 ± 0.2500 (paired stderr)" in (
        capsys.readouterr().out
    )
    assert main(["eval", "--compare", *files]) == 2  # pooled: 4 tasks against 6
    assert "different task counts (4 vs 6)" in capsys.readouterr().err
    assert main(["eval", "--compare", *files, "--part", "files"]) == 2
    assert "has no env 'files'; it has calc, rag" in capsys.readouterr().err
    assert main(["eval", "--part", "calc"]) == 2  # before any model loads
    assert "--part calc goes with --compare" in capsys.readouterr().err


def test_the_table_heads_with_what_was_evaluated_and_names_the_diff():
    """The env, kwargs, split and adapter lead the table; the difference is labelled with
    the reports' names (it said "(b-a)" under columns named "before" and "after")."""
    env = {"env_id": "Calculator-v0", "env_kwargs": {"source": "word_problems"}}
    config = {**env, "model": "m", "split": "test", "seed": 0}
    before = EvalReport({"accuracy": 0.0}, [0.0, 0.0], {**config, "adapter": None}, "before")
    after = EvalReport({"accuracy": 0.5}, [1.0, 0.0], {**config, "adapter": "ck"}, "after")
    lines = format_table([before, after]).splitlines()
    assert lines[:4] == [
        'env:     Calculator-v0 {"source": "word_problems"}',
        "split:   test (2 tasks, seed 0)",
        "model:   m",
        "adapter: before: none; after: ck",
    ]
    assert lines[4].split() == ["metric", "before", "after"]
    assert lines[-1].startswith("accuracy diff (after - before): +0.5000 ± 0.5000")
    # a report from before the heading (no env in its config) still prints
    assert format_table([EvalReport({"accuracy": 1.0}, [1.0])]).startswith("metric")


def test_eval_config_validation():
    with pytest.raises(InvalidOptionError, match="temperature"):
        EvalConfig(samples=4, temperature=0.0)
    with pytest.raises(InvalidOptionError, match="samples"):
        EvalConfig(samples=0)


def test_an_llm_judge_grades_each_answer_against_the_reference(tokenizer):
    from agentenv.run.judge import LLMJudge

    class Backend:  # 10 when the candidate equals the reference, else 4
        def complete(self, chats):
            grades = []
            for chat in chats:
                text = chat[1]["content"]
                reference = text.split("Reference answer:\n")[1].split("\n")[0]
                candidate = text.rsplit("Candidate answer:\n", 1)[1]
                grades.append("<score>10</score>" if candidate == reference else "<score>4</score>")
            return grades

    config = EvalConfig(num_tasks=6, max_turns=5)
    report = evaluate(
        make_env,
        scripted_policy(tokenizer),
        ChatFormat(tokenizer),
        config,
        show_progress=False,
        judge=LLMJudge(Backend()),
    )
    # tasks 0, 3 right (1.0), tasks 1, 4 wrong (0.4), tasks 2, 5 unanswered (0)
    assert report.metrics["judge_score"] == pytest.approx((1 + 0.4 + 1 + 0.4) / 6)
    assert report.metrics["judge_failures"] == 0.0


def test_eval_judge_settings_fail_before_the_model_loads(capsys):
    from agentenv.cli import main

    assert main(["eval", "--judge", "localhost:8000"]) == 2
    assert "judge must be 'local' or an http(s) base URL" in capsys.readouterr().err


def test_a_sampled_eval_gives_the_same_episodes_however_its_tasks_are_batched(
    tiny_model, tokenizer, monkeypatch
):
    """Without a seeded draw per episode, tasks batched 3 at a time and one at a time
    sampled other tokens (the global generator advanced by the other rows)."""
    import torch
    from draws import assert_same_episode_draws

    from agentenv.lm.backend import SamplingConfig
    from agentenv.lm.sampler import TransformersPolicy
    from agentenv.run import evaluate as evaluate_module

    seen: list = []

    def recording(*args, **kwargs):
        groups, metrics = evaluate_module.collect.__wrapped__(*args, **kwargs)
        seen[-1].extend(groups)
        return groups, metrics

    recording.__wrapped__ = evaluate_module.collect
    monkeypatch.setattr(evaluate_module, "collect", recording)
    policy = TransformersPolicy(tiny_model, tokenizer, dtype="float32")
    reports = []
    for per_batch in (3, 1):
        seen.append([])
        torch.manual_seed(per_batch)  # the global generator must not matter
        config = EvalConfig(
            num_tasks=3, samples=2, max_turns=2, max_new_tokens=12, temperature=1.0,
            tasks_per_batch=per_batch, seed=5,
        )  # fmt: skip
        reports.append(
            evaluate(make_env, policy, ChatFormat(tokenizer), config, show_progress=False)
        )
    assert reports[0].metrics["mean_tokens"] == reports[1].metrics["mean_tokens"]
    assert_same_episode_draws(
        seen[1], seen[0], model=tiny_model, sampling=SamplingConfig(12, temperature=1.0),
        sample_seed=5,
    )  # fmt: skip
