import dataclasses
import json
import statistics
import threading
import time

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import agentenv
from agentenv.env.play import play_episode
from agentenv.errors import InvalidOptionError, TaskSourceError
from envs.rag import QAFileError, QAItem, RAGEnv
from envs.rag.baselines import AnswerWithoutSearch, SearchThenAnswer, parse_top_passage


def search(query, k=None) -> str:
    arguments = {"query": query} if k is None else {"query": query, "k": k}
    return f"<tool_call>{json.dumps({'name': 'search', 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def bundled_test_env():
    """The bundled env's test split (hybrid retrieval, in-memory Chroma)."""
    return agentenv.make("RAG-v0", split="test", chroma="memory")


@pytest.mark.parametrize("retriever", ["hybrid", "bm25", "dense"])
def test_check_env_passes(small_env_kwargs, retriever):
    check_env(gym.make("agentenv/RAG-v0", **small_env_kwargs, retriever=retriever).unwrapped)


def test_check_env_on_the_registered_bundled_env(bundled_test_env):
    check_env(gym.make("agentenv/RAG-v0", split="test", chroma="memory").unwrapped)
    assert bundled_test_env.num_tasks == len(bundled_test_env._items) > 150


def test_seeds_reproduce_and_task_id_is_deterministic(small_env_kwargs):
    a, b = RAGEnv(**small_env_kwargs), RAGEnv(**small_env_kwargs)
    assert a.reset(seed=5) == b.reset(seed=5)
    question = a.task.prompt
    assert a.step(search(question)) == b.step(search(question))
    assert a.reset(options={"task_id": 3})[0] == b.reset(options={"task_id": 3})[0]
    prompts = {a.reset(seed=s)[0][1]["content"] for s in range(8)}
    assert len(prompts) > 1


def test_splits_are_disjoint(small_env_kwargs):
    train, test = RAGEnv(**small_env_kwargs), RAGEnv(**small_env_kwargs, split="test")
    assert train.num_tasks > 0 and test.num_tasks > 0
    q_train = {train.get_task(i).prompt for i in range(train.num_tasks)}
    q_test = {test.get_task(i).prompt for i in range(test.num_tasks)}
    assert not q_train & q_test
    docs = [
        {g for i in range(e.num_tasks) for g in e.get_task(i).metadata["gold_doc_ids"]}
        for e in (train, test)
    ]
    assert not docs[0] & docs[1]
    assert RAGEnv(**small_env_kwargs, num_tasks=2).num_tasks == 2


def test_search_output_is_numbered_with_ids_titles_and_budget(small_env_kwargs):
    env = RAGEnv(**small_env_kwargs, passage_chars=60, default_k=2)
    env.reset(options={"task_id": 0})
    obs, reward, term, trunc, info = env.step(search(env.task.prompt))
    text = obs[0]["content"]
    assert obs[0]["role"] == "tool" and (reward, term, trunc) == (0.0, False, False)
    assert text.startswith("[1] ") and "\n\n[2] " in text and "[3] " not in text
    assert "(doc " in text and "[...]" in text
    title, passage = parse_top_passage(text)
    assert title and len(passage) <= 60 + len(" [...]")
    assert info["num_searches"] == 1 and info["num_tool_errors"] == 0
    obs, *_ = env.step(search("zzzz qqqq", 5))
    assert obs[0]["content"]  # nothing lexical, but dense always finds neighbours


def test_bad_search_input_becomes_error_observations(small_env_kwargs):
    env = RAGEnv(**small_env_kwargs, max_searches=2, max_turns=20)
    env.reset(seed=0)
    cases = [
        (search(""), "empty_query", "query is empty"),
        (search("   \n "), "empty_query", "query is empty"),
        (search("x" * 100_000), "query_too_long", "100000 characters"),
        (search("Vellmark", 0), "k_out_of_range", "between 1 and 10, got 0"),
        (search("Vellmark", 11), "k_out_of_range", "got 11"),
        (search("Vellmark", "3"), "arguments", "must be integer"),
    ]
    for action, _kind, message in cases:
        start = time.perf_counter()
        obs, reward, term, trunc, info = env.step(action)
        assert time.perf_counter() - start < 2.0
        content = obs[0]["content"]
        assert content.startswith("Error:") and message in content and len(content) < 500, content
        assert not (term or trunc) and reward == 0.0
    assert info["num_searches"] == 0  # failed calls do not use up the budget
    env.step(search("first"))
    env.step(search("second"))
    obs, *_, info = env.step(search("third"))
    assert "search limit reached (2 per episode)" in obs[0]["content"]
    assert info["tool_errors"] == {
        "empty_query": 2,
        "query_too_long": 1,
        "k_out_of_range": 2,
        "arguments": 1,
        "search_limit": 1,
    }
    assert info["num_searches"] == 2 and info["num_tool_errors"] == 7


def test_max_turns_truncates_with_zero_reward(small_env_kwargs):
    env = RAGEnv(**small_env_kwargs, max_turns=2)
    env.reset(seed=1)
    env.step(search("anything"))
    _, reward, term, trunc, info = env.step("thinking, no tool call")
    assert (reward, term, trunc, info["correct"]) == (0.0, False, True, False)
    with pytest.raises(gym.error.ResetNeeded):
        env.step("<answer>x</answer>")


def _episode_with_answer(env, answer: str, searches=()) -> tuple[float, dict]:
    env.reset(options={"task_id": 0})
    for q in searches:
        env.step(search(q))
    _, reward, term, _, info = env.step(f"<answer>{answer}</answer>")
    assert term
    return reward, info


def test_reward_components_are_documented_and_in_info(small_env_kwargs):
    env = RAGEnv(**small_env_kwargs)
    env.reset(options={"task_id": 0})
    gold, question = env.task.answer, env.task.prompt
    reward, info = _episode_with_answer(env, f"  The {gold[0]}. ", [question])
    assert info["correct"] and info["answer_em"] == 1.0 and info["format_ok"]
    assert info["retrieved_doc_ids"][0] == info["gold_doc_ids"][0]  # found at rank 1
    assert info["reward_answer"] == 1.0 and info["reward_format"] == 0.05
    assert info["reward_retrieval"] == pytest.approx(0.2 * info["retrieval_rr"])
    assert reward == pytest.approx(1.25)
    reward, info = _episode_with_answer(env, gold[0])  # right, without searching
    assert (reward, info["retrieval_rr"], info["retrieved_doc_ids"]) == (1.05, 0.0, [])
    reward, info = _episode_with_answer(env, "", [question])
    assert not info["format_ok"] and reward == pytest.approx(0.2 * info["retrieval_rr"])
    long = "it is probably " + gold[0] + " but I am honestly not at all sure about this"
    reward, info = _episode_with_answer(env, long)
    assert not info["correct"] and 0 < info["answer_f1"] < 1 and not info["format_ok"]
    assert info["qtype"] and info["gold"] == list(gold)


def test_a_search_that_outlives_its_step_adds_nothing_to_the_reward(small_env_kwargs):
    """A search past the tool's time limit is reported as a timeout; when it finishes later,
    during the next step, its hits must not count as retrieved (the policy never saw them)."""
    env = RAGEnv(**small_env_kwargs, tool_timeout_s=0.3)
    env.reset(options={"task_id": 0})
    real = env.retriever.search
    started = threading.Event()

    def slow(query, k=5):  # noqa: ANN001, ANN202
        started.set()
        time.sleep(0.8)
        return real(query, k)

    env.retriever = type("Slow", (), {"search": staticmethod(slow)})()
    obs, _, _, _, info = env.step(search(env.task.prompt))
    assert "timed out" in obs[0]["content"] and info["tool_errors"] == {"timeout": 1}
    assert started.is_set()
    time.sleep(1.0)  # the abandoned search finishes now, between steps
    _, _, term, _, info = env.step(f"<answer>{env.task.answer[0]}</answer>")
    assert term and info["num_searches"] == 1  # it was made (and counted against the limit)
    assert info["retrieved_doc_ids"] == [] and info["retrieval_rr"] == 0.0


def test_a_wrong_answer_never_beats_a_right_one(small_env_kwargs):
    env = RAGEnv(**small_env_kwargs)
    env.reset(options={"task_id": 0})
    gold, question = env.task.answer[0], env.task.prompt
    wrong = ["unknown", gold + " x", "x", gold.split()[0] + " Smith", "1234", "a"]
    for searches in ([], [question], ["unrelated words", question]):
        right, _ = _episode_with_answer(env, gold, searches)
        for answer in wrong:
            reward, info = _episode_with_answer(env, answer, searches)
            assert not info["correct"] and reward < right, (answer, searches)
    _, info = _episode_with_answer(env, "nonsense")
    assert info["reward_format"] < info["reward_answer"] + 1.0  # format alone is small
    assert _episode_with_answer(env, "nonsense")[0] == 0.05


def test_reward_weights_are_configurable_and_validated(small_env_kwargs):
    env = RAGEnv(**small_env_kwargs, answer_weight=2.0, retrieval_weight=0.0, format_weight=0.0)
    env.reset(options={"task_id": 0})
    reward, info = _episode_with_answer(env, env.task.answer[0], [env.task.prompt])
    assert reward == 2.0 and info["reward_retrieval"] == 0.0
    with pytest.raises(InvalidOptionError, match="format weight .* must be smaller"):
        RAGEnv(**small_env_kwargs, format_weight=1.0)
    with pytest.raises(InvalidOptionError, match="weight must be a number >= 0"):
        RAGEnv(**small_env_kwargs, retrieval_weight=-0.1)
    with pytest.raises(InvalidOptionError, match="default_k <= max_k"):
        RAGEnv(**small_env_kwargs, default_k=5, max_k=4)
    with pytest.raises(InvalidOptionError, match="num_tasks"):
        RAGEnv(**small_env_kwargs, num_tasks=0)
    fresh = {**small_env_kwargs, "chunk_size": 77}  # a new index: must fail before embedding
    start = time.perf_counter()
    with pytest.raises(InvalidOptionError, match="fusion must be one of"):
        RAGEnv(**fresh, fusion="max")
    with pytest.raises(InvalidOptionError, match=r"unknown retriever\(s\) \['sparse'\]"):
        RAGEnv(**fresh, fusion_weights={"sparse": 1.0})
    with pytest.raises(InvalidOptionError, match="retriever must be one of"):
        RAGEnv(**fresh, retriever="colbert")
    with pytest.raises(InvalidOptionError, match="chroma must be"):
        RAGEnv(**{**fresh, "chroma": "sqlite"})
    assert time.perf_counter() - start < 1.0


def test_isolation_instances_share_the_index_not_the_episode(small_env_kwargs):
    envs = [RAGEnv(**small_env_kwargs) for _ in range(4)]
    assert all(e.retriever is envs[0].retriever for e in envs)
    a, b = envs[0], envs[1]
    a.reset(options={"task_id": 0})
    b.reset(options={"task_id": 0})
    a.step(search(a.task.prompt))
    a.step(search("second search"))
    _, _, _, _, info_b = b.step(f"<answer>{b.task.answer[0]}</answer>")
    assert info_b["num_searches"] == 0 and info_b["retrieved_doc_ids"] == []
    _, _, _, _, info_a = a.step(f"<answer>{a.task.answer[0]}</answer>")
    assert info_a["num_searches"] == 2 and info_a["retrieved_doc_ids"]

    results: dict[int, tuple] = {}  # a GRPO-like group: same seed, run concurrently

    def run(i: int) -> None:
        r = play_episode(envs[i], SearchThenAnswer(), seed=42)
        results[i] = (r.reward, tuple(r.info["retrieved_doc_ids"]), r.info["num_searches"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(envs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and len(set(results.values())) == 1
    assert results[0][2] == 1


def test_searching_policy_scores_well_above_answering_blind(bundled_test_env):
    env = bundled_test_env
    tasks = range(0, env.num_tasks, 2)  # every other test question, all question types
    searching = [play_episode(env, SearchThenAnswer(), options={"task_id": i}) for i in tasks]
    blind = [play_episode(env, AnswerWithoutSearch(), options={"task_id": i}) for i in tasks]
    search_reward = statistics.mean(r.reward for r in searching)
    blind_reward = statistics.mean(r.reward for r in blind)
    assert search_reward > 0.6 and blind_reward <= 0.05 + 1e-9
    assert statistics.mean(r.info["correct"] for r in searching) > 0.5
    assert not any(r.info["correct"] for r in blind)
    assert all(r.info["num_searches"] == 1 for r in searching)


def test_custom_corpus_folder_and_qa_file(tmp_path, cache_dir, write_jsonl):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "router.md").write_text("# Router\n\nHold the reset button for 12 seconds.")
    (docs / "modem.txt").write_text("The modem's status light blinks amber when offline.")
    qa = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {"question": "How long to hold reset?", "answers": ["12 seconds"],
             "gold_doc_ids": ["router.md"], "split": "train"},
            {"question": "What colour blinks offline?", "answers": "amber",
             "gold_doc_ids": ["modem.txt"], "split": "test"},
        ],
    )  # fmt: skip
    env = agentenv.make(
        "RAG-v0", corpus=str(docs), qa=qa, split="test", chroma="memory", cache_dir=str(cache_dir)
    )
    assert env.num_tasks == 1
    env.reset(seed=0)
    obs, *_ = env.step(search("status light offline", 1))
    assert "(doc modem.txt, chunk 0)" in obs[0]["content"]
    _, reward, *_, info = env.step("<answer>Amber</answer>")
    assert info["correct"] and reward == pytest.approx(1.25)
    with pytest.raises(InvalidOptionError, match="custom corpus needs questions"):
        RAGEnv(corpus=str(docs), chroma="memory")
    bad_gold = [QAItem("q", "Q?", ("a",), ("nope.md",))]
    with pytest.raises(QAFileError, match="nope.md"):
        RAGEnv(corpus=str(docs), qa=bad_gold, chroma="memory")
    only_train = [QAItem("q", "Q?", ("a",), ("router.md",), "train")]
    with pytest.raises(TaskSourceError, match="'test' split has no questions"):
        RAGEnv(corpus=str(docs), qa=only_train, split="test", chroma="memory")


def test_an_llm_judge_adds_a_graded_reward_component(small_env_kwargs):
    from agentenv.run.judge import LLMJudge

    class Backend:  # grades "Paris"-like answers by whether they contain the reference
        def __init__(self):
            self.chats = []

        def complete(self, chats):
            self.chats += chats
            return [
                "<score>10</score>"
                if c[1]["content"].split("Reference answer:\n")[1].split("\n")[0]
                in c[1]["content"].rsplit("Candidate answer:\n", 1)[1]
                else "<score>2</score>"
                for c in chats
            ]

    backend = Backend()
    env = RAGEnv(**small_env_kwargs, judge=LLMJudge(backend), judge_weight=0.5)
    env.reset(options={"task_id": 0})
    gold = env.task.answer[0]
    reward, info = _episode_with_answer(env, f"I think it is {gold}, probably")  # not EM
    assert info["reward_components"]["judge"] == 1.0 and info["reward_judge"] == 0.5
    plain = info["reward_answer"] + info["reward_retrieval"] + info["reward_format"]
    assert reward == pytest.approx(plain + 0.5) and info["judge_error"] is None
    assert backend.chats[0][1]["content"].startswith(f"Question:\n{env.task.prompt}")
    _, info = _episode_with_answer(env, "no idea")
    assert info["reward_components"]["judge"] == pytest.approx(0.2)
    with pytest.raises(InvalidOptionError, match="judge must be"):
        RAGEnv(**small_env_kwargs, judge="gpt")


def test_demonstrations_search_then_answer_from_retrieval_only(small_env_kwargs, tokenizer):
    from agentenv.rollout.demos import demonstration_episodes
    from agentenv.rollout.episode import ChatFormat

    env = RAGEnv(**small_env_kwargs)
    n = env.num_tasks
    solved = 0
    for i in range(n):
        env.reset(options={"task_id": i})
        task = env.task
        search, answer = env.demonstration(task)
        assert json.loads(search.split("<tool_call>")[1].split("</tool_call>")[0]) == {
            "name": "search",
            "arguments": {"query": task.prompt.strip()},
        }
        env.step(search)
        _, _, terminated, _, info = env.step(answer)
        assert terminated and info["num_searches"] == 1
        solved += bool(info["correct"])
    # a task whose gold is replaced still gets the same demonstration: the gold is never read
    env.reset(options={"task_id": 0})
    blind = dataclasses.replace(env.task, answer=["no such answer"])
    assert env.demonstration(blind) == env.demonstration(env.task)
    episodes = demonstration_episodes(lambda: RAGEnv(**small_env_kwargs), ChatFormat(tokenizer), n)
    assert 0 < solved < n and 0 < len(episodes) < n  # the reader is often wrong ...
    assert abs(len(episodes) - solved) <= n // 4  # ... (tasks drawn by seed, not by index)
    assert all(e.info["correct"] and e.num_turns == 2 for e in episodes)  # only right ones


def test_compact_prompt_shows_a_search_and_the_answer_format(small_env_kwargs, tokenizer):
    full, compact = RAGEnv(**small_env_kwargs), RAGEnv(**small_env_kwargs, prompt_style="compact")
    full_obs, _ = full.reset(seed=0)
    obs, _ = compact.reset(seed=0)
    assert obs[1] == full_obs[1]  # the question is unchanged
    prompt = obs[0]["content"]
    assert len(tokenizer.encode(prompt)) < 100 < len(tokenizer.encode(full_obs[0]["content"]))
    example = prompt.split("<tool_call>")[1].split("</tool_call>")[0]
    assert full.parser.parse(f"<tool_call>{example}</tool_call>").tool_calls[0].name == "search"
    assert "<answer>" in prompt
    with pytest.raises(InvalidOptionError, match="prompt_style must be one of"):
        RAGEnv(**small_env_kwargs, prompt_style="short")
