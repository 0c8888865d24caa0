"""Task generation, splits, scripted solvers and the checkers' teeth."""

import json

import pytest

import agentenv
from agentenv.errors import InvalidOptionError
from envs.workspace import LEVELS, as_actions, family_names, load_tasks, solve_task, split_of
from envs.workspace import tasks as tasks_module

COMBOS = [(f, level) for f in ("files", "data", "bugfix", "rename") for level in LEVELS]


def _sig(task):
    return json.dumps([task.prompt, sorted(task.metadata["files"].items())])


def test_families_and_levels():
    assert family_names() == ("files", "data", "bugfix", "rename")
    assert LEVELS == ("easy", "hard")


def test_splits_are_disjoint_deterministic_and_balanced():
    train = load_tasks("train")
    test = load_tasks("test")
    assert (len(train), len(test)) == (800, 200)
    assert not {_sig(t) for t in train} & {_sig(t) for t in test}
    assert len({_sig(t) for t in train}) == len(train)  # no duplicates within a split
    assert all(split_of(_sig(t)) == "test" for t in test)
    for i, task in enumerate(train[:40]):
        assert (task.metadata["family"], task.metadata["level"]) == COMBOS[i % len(COMBOS)]
    tasks_module._load_cached.cache_clear()
    assert load_tasks("test") == test  # regenerated identically
    assert load_tasks("test", seed=1) != test


def test_subsets_and_bad_options():
    tasks = load_tasks("train", num_tasks=10, families=["data"], levels=["hard"])
    assert {t.id.rsplit("-", 1)[0] for t in tasks} == {"data-hard"}
    with pytest.raises(InvalidOptionError, match="families must be a non-empty subset"):
        load_tasks("train", families=["chess"])
    with pytest.raises(InvalidOptionError, match="levels must be"):
        load_tasks("train", levels=["medium"])
    with pytest.raises(InvalidOptionError, match="num_tasks must be an int >= 1"):
        load_tasks("train", num_tasks=0)
    with pytest.raises(InvalidOptionError, match="split must be"):
        load_tasks("dev")


def _play(env, actions):
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return reward, info, obs
    raise AssertionError("episode did not end")


@pytest.fixture
def env_for(mode, small):
    made = []

    def make(**kwargs):
        made.append(agentenv.make("Workspace-v0", sandbox=mode, limits=small, **kwargs))
        return made[-1]

    yield make
    for env in made:
        env.close()


@pytest.mark.parametrize("split", ["train", "test"])
def test_scripted_solver_scores_one_and_do_nothing_scores_zero(env_for, split):
    env = env_for(split=split)
    for task_id in range(len(COMBOS)):
        env.reset(options={"task_id": task_id})
        reward, info, _ = _play(env, as_actions(solve_task(env.task)))
        assert reward == 1.0, (env.task.id, info["checks_failed"], info["tool_errors"])
        assert info["correct"] and info["checks_failed"] == [] and info["num_tool_errors"] == 0
        env.reset(options={"task_id": task_id})
        reward, info, _ = _play(env, ["<answer>done</answer>"])
        assert reward == 0.0 and not info["correct"] and info["checks_failed"], env.task.id


def _task_of(env, family, level):
    index = COMBOS.index((family, level))
    env.reset(options={"task_id": index})
    return env.task


def _call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_bugfix_checker_is_not_fooled_by_a_faked_test_run(env_for):
    env = env_for()
    task = _task_of(env, "bugfix", "easy")
    module = task.metadata["params"]["module"]
    fake = "import os\nos._exit(0)\n"  # the bundled test "passes": the process exits 0
    reward, info, _ = _play(
        env, [_call("write_file", path=f"{module}.py", content=fake), "<answer>ok</answer>"]
    )
    assert reward == 0.0
    assert any("hidden inputs" in f for f in info["checks_failed"])
    assert not any("unittest" in f for f in info["checks_failed"])


def test_bugfix_checker_notices_an_edited_test(env_for):
    env = env_for()
    task = _task_of(env, "bugfix", "hard")
    test = task.metadata["params"]["test"]
    reward, info, _ = _play(
        env, [_call("write_file", path=f"{test}.py", content="pass\n"), "<answer>ok</answer>"]
    )
    assert reward == 0.0 and f"`{test}.py` is unchanged" in info["checks_failed"]


def test_data_checker_reads_the_file_not_the_answer(env_for):
    env = env_for()
    task = _task_of(env, "data", "easy")
    right = task.metadata["params"]["answer"]
    reward, info, _ = _play(env, [f"<answer>{right}</answer>"])
    assert reward == 0.0 and "`answer.txt` exists" in info["checks_failed"]
    env.reset(options={"task_id": COMBOS.index(("data", "easy"))})
    wrong = _call("write_file", path="answer.txt", content=str(right + 1))
    reward, info, _ = _play(env, [wrong, "<answer>done</answer>"])
    assert reward == 0.0 and info["checks_failed"] == ["the number is correct"]


def test_symlinked_answer_is_not_followed(env_for):
    env = env_for()
    _task_of(env, "data", "easy")
    link = _call("run_python", code="import os\nos.symlink('/etc/hostname', 'answer.txt')")
    reward, info, _ = _play(env, [link, "<answer>done</answer>"])
    assert reward == 0.0 and "`answer.txt` exists" in info["checks_failed"]


def test_rename_checker_runs_the_program(env_for):
    env = env_for()
    task = _task_of(env, "rename", "easy")
    p = task.metadata["params"]
    path = f"{p['pkg']}/{p['mod']}.py"
    source = task.metadata["files"][path].replace(p["old"], p["new"])
    reward, info, _ = _play(
        env, [_call("write_file", path=path, content=source), "<answer>done</answer>"]
    )
    assert reward == 0.0
    assert "`python main.py` prints the same as before" in info["checks_failed"]
    assert f"no .py file mentions `{p['old']}`" in info["checks_failed"]


def test_partial_credit_is_the_share_of_checks(env_for):
    env = env_for(partial_credit=True)
    task = _task_of(env, "files", "easy")
    path = task.metadata["params"]["path"]
    reward, info, _ = _play(
        env, [_call("write_file", path=path, content="wrong\n"), "<answer>done</answer>"]
    )
    assert reward == pytest.approx(0.5) and info["checks_passed"] == 1 and info["checks_total"] == 2
