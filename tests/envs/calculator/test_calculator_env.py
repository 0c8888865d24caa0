import json
import time

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import agentenv
from agentenv.errors import InvalidOptionError, TaskSourceError
from envs.calculator import CalculatorEnv, load_tasks, parse_gsm8k_answer, parse_number, split_of


def call(expression: str) -> str:
    payload = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(payload)}</tool_call>"


@pytest.mark.parametrize("source", ["gsm_symbolic", "basic_arithmetic"])
def test_check_env_passes(source):
    check_env(gym.make("agentenv/Calculator-v0", source=source, num_tasks=20).unwrapped)


def test_seed_gives_same_task_and_task_id_is_deterministic():
    a = agentenv.make("Calculator-v0")
    b = agentenv.make("Calculator-v0")
    assert a.reset(seed=11) == b.reset(seed=11)
    assert a.reset(options={"task_id": 42})[0] == b.reset(options={"task_id": 42})[0]
    assert a.reset(seed=1)[0] != a.reset(seed=2)[0]


@pytest.mark.parametrize("source", ["gsm_symbolic", "basic_arithmetic"])
def test_splits_are_disjoint_and_stable(source):
    train = load_tasks(source, "train", num_tasks=1000)
    test = load_tasks(source, "test", num_tasks=250)
    assert len(train) == 1000 and len(test) == 250
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    assert all(split_of(t.prompt) == "test" for t in test)
    assert len({t.prompt for t in train}) == len(train)  # no duplicates within a split
    from envs.calculator import tasks as tasks_module

    tasks_module._load_cached.cache_clear()
    assert load_tasks(source, "test", num_tasks=250) == test  # regenerated identically


def test_solving_with_the_calculator_gets_reward_one():
    env = agentenv.make("Calculator-v0", source="basic_arithmetic")
    obs, info = env.reset(seed=3)
    expression = env.task.metadata["expression"]
    obs, reward, term, trunc, info = env.step(call(expression))
    assert obs[0]["role"] == "tool" and not term
    assert parse_number(obs[0]["content"]) == pytest.approx(float(env.task.answer))
    obs, reward, term, trunc, info = env.step(f"<answer>{obs[0]['content']}</answer>")
    assert (reward, term, trunc) == (1.0, True, False)
    assert info["correct"] and info["num_tool_calls"] == 1 and info["num_tool_errors"] == 0
    assert info["turn"] == 2 and info["gold"] == env.task.answer


def test_wrong_answer_and_format_bonus():
    env = agentenv.make("Calculator-v0", format_bonus=0.1)
    env.reset(seed=0)
    gold = float(env.task.answer)
    _, reward, term, _, info = env.step(f"<answer>{gold + 1}</answer>")
    assert term and info["correct"] is False and reward == pytest.approx(0.1)
    env.reset(seed=0)
    assert env.step("<answer>no idea</answer>")[1] == 0.0
    env.reset(seed=0)
    assert env.step(f"<answer>{gold:,.0f}</answer>")[1] == pytest.approx(1.1)


def test_hostile_calculator_calls_are_refused_in_episode():
    env = agentenv.make("Calculator-v0")
    env.reset(seed=0)
    for expr in ["9**9**9**9", "__import__('os').system('x')", "1/0", "x" * 100_000]:
        start = time.perf_counter()
        obs, reward, term, trunc, info = env.step(call(expr))
        assert time.perf_counter() - start < 0.5
        assert obs[0]["content"].startswith("Error:") and len(obs[0]["content"]) < 300
        if trunc:
            break
    assert info["num_tool_errors"] == info["num_tool_calls"]
    assert info["tool_errors"].keys() == {"calculator"}


def test_a_model_that_echoes_the_format_reminder_gives_no_answer():
    """The reminder held a literal "<answer>...</answer>": echoed, it answered "..."."""
    env = agentenv.make("Calculator-v0", source="word_problems")
    env.reset(seed=0)
    reminder, *_ = env.step("The total is 12.")
    assert reminder[0]["role"] == "user" and "<answer>" in reminder[0]["content"]
    assert env.parser.parse(reminder[0]["content"]).answer is None
    _, reward, term, trunc, info = env.step(reminder[0]["content"])
    assert (term, "answer" in info) == (False, False)  # the episode goes on, unanswered


def test_max_turns_truncates():
    env = agentenv.make("Calculator-v0", max_turns=2)
    env.reset(seed=0)
    env.step(call("1+1"))
    _, reward, term, trunc, info = env.step(call("2+2"))
    assert (reward, term, trunc, info["correct"]) == (0.0, False, True, False)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("72", 72),
        ("1,234.5", 1234.5),
        ("$18", 18),
        ("50%", 50),
        ("3/4", 0.75),
        ("The answer is 72 apples", 72),
        ("-4", -4),
        ("1e3", 1000),
        ("none", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_gsm8k_local_jsonl_and_parquet(tmp_path):
    rows = [
        {
            "question": f"Tom has {i} apples and buys {i + 1} more. How many?",
            "answer": f"{i} + {i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}\n#### {2 * i + 1:,}",
        }
        for i in range(400, 600)
    ]
    jsonl = tmp_path / "gsm.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    train = agentenv.make("Calculator-v0", source="gsm8k", path=str(jsonl))
    test = agentenv.make("Calculator-v0", source="gsm8k", path=str(jsonl), split="test")
    assert train.num_tasks + test.num_tasks == 200 and test.num_tasks > 10
    assert not {t.prompt for t in train._tasks} & {t.prompt for t in test._tasks}
    obs, _ = test.reset(options={"task_id": 0})
    i = int(obs[1]["content"].split()[2])
    assert test.task.answer == str(2 * i + 1)
    assert test.step(f"<answer>{2 * i + 1}</answer>")[1] == 1.0

    import datasets

    parquet = tmp_path / "gsm.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    from_parquet = load_tasks("gsm8k", "test", path=str(parquet))
    assert [t.prompt for t in from_parquet] == [t.prompt for t in test._tasks]


def test_gsm8k_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(TaskSourceError, match="not found"):
        load_tasks("gsm8k", "train", path=str(tmp_path / "missing.jsonl"))
    bad_cols = tmp_path / "cols.jsonl"
    bad_cols.write_text(json.dumps({"q": "x", "a": "1"}) + "\n")
    with pytest.raises(TaskSourceError, match="lacks column"):
        load_tasks("gsm8k", "train", path=str(bad_cols))
    bad_answer = tmp_path / "answer.jsonl"
    bad_answer.write_text(json.dumps({"question": "q?", "answer": "#### none"}) + "\n")
    with pytest.raises(TaskSourceError, match="row 0"):
        load_tasks("gsm8k", "train", path=str(bad_answer))


def test_bad_options_name_the_value():
    with pytest.raises(InvalidOptionError, match="source must be one of"):
        CalculatorEnv(source="mathqa")
    with pytest.raises(InvalidOptionError, match="only used with source='gsm8k'"):
        CalculatorEnv(path="x.jsonl")
    with pytest.raises(InvalidOptionError, match="num_tasks"):
        CalculatorEnv(num_tasks=0)
    assert parse_gsm8k_answer("so 5 * 2 = 10\n#### 1,000") == "1000"


@pytest.mark.parametrize("source", ["word_problems", "basic_arithmetic"])
def test_demonstrations_solve_their_tasks(source):
    env = agentenv.make("Calculator-v0", source=source, prompt_style="compact")
    for task_id in range(20):
        env.reset(options={"task_id": task_id})
        actions = iter(env.demonstration(env.task))
        result = agentenv.play_episode(
            env, lambda _, it=actions: next(it), options={"task_id": task_id}
        )
        assert result.reward == 1.0 and result.info["num_tool_calls"] == 1
    gsm = agentenv.make("Calculator-v0", source="gsm_symbolic")
    gsm.reset(seed=0)
    assert gsm.demonstration(gsm.task) is None  # no expression to demonstrate


def test_word_problems_are_deterministic_two_step_and_disjoint():
    from envs.calculator import word_problems
    from envs.calculator.safe_eval import evaluate

    a, b = word_problems.generate(50, seed=3), word_problems.generate(80, seed=3)
    assert a == b[:50]  # growing the size only appends
    assert all(evaluate(p.expression) == p.answer for p in b)
    assert all(sum(p.expression.count(op) for op in "+-*/") >= 2 for p in b)
    train, test = load_tasks("word_problems", "train"), load_tasks("word_problems", "test")
    assert not {t.prompt for t in train} & {t.prompt for t in test}


def test_compact_prompt_is_short_and_bad_style_refused(tokenizer):
    env = agentenv.make("Calculator-v0", prompt_style="compact")
    obs, _ = env.reset(seed=0)
    assert len(tokenizer.encode(obs[0]["content"])) < 80
    with pytest.raises(InvalidOptionError, match="prompt_style"):
        CalculatorEnv(prompt_style="tiny")
