"""Bridge questions (envs/rag/bridge.py): data, splits, selection by type, demonstrations."""

import dataclasses
import hashlib
import json

import pytest

from agentenv.errors import InvalidOptionError
from agentenv.run.leaks import seen_tasks
from envs.rag import QAItem, RAGEnv, bundled, generate
from envs.rag.baselines import search_action
from envs.rag.bridge import (
    RELATIONS,
    bridge_demonstration,
    doc_split,
    match_question,
    vague_queries,
    wants_requery,
    without_bridge_leaks,
)
from envs.rag.data import QUESTION_TYPES, SINGLE_HOP_TYPES
from envs.rag.env import _load_data
from envs.rag.qa import select_types, split_of_item
from envs.rag.retrieval import unique_docs

# sha256 of generate()'s documents and questions as the code before bridge questions made
# them: published recipes depend on these exact tasks.
LANDED = {
    (90, 0): "2c2bb4e01b91a9cfbbb6e82dc39cb9aa8c7dac49aaa9d07c1446c92d75902901",
    (6, 7): "cde60b0c5f7c8c772d86bd6bdb94e11458b7d88d5e97a350ebbbe748d4ee86d0",
    (96, 3): "fafeacb765046e43de66a948cc62eeba48d0b92d32d3b9409a41e83355458eb7",
}


def digest(docs, qa) -> str:
    rows = [["doc", d.id, d.title, d.text, d.metadata] for d in docs]
    rows += [
        ["qa", q.id, q.question, list(q.answers), list(q.gold_doc_ids), q.split, q.metadata]
        for q in qa
    ]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def bridges(qa):
    return [q for q in qa if q.metadata["qtype"] == "bridge"]


@pytest.fixture(scope="module")
def bundled_bridge():
    """The bundled documents and questions with the bridge questions appended."""
    return bundled(bridge=True)


@pytest.mark.parametrize(("num_per_type", "seed"), list(LANDED))
def test_single_hop_data_is_what_the_landed_code_made(num_per_type, seed):
    docs, qa = generate(num_per_type, seed)
    assert digest(docs, qa) == LANDED[num_per_type, seed]
    with_bridge_docs, with_bridge = generate(num_per_type, seed, bridge=True)
    single = with_bridge[: len(qa)]
    assert digest(with_bridge_docs, single) == LANDED[num_per_type, seed]
    assert {q.metadata["qtype"] for q in single} <= set(SINGLE_HOP_TYPES)
    assert len(bridges(with_bridge)) == len(with_bridge) - len(qa) > 0  # appended, last


def test_bridge_questions_need_both_articles_and_never_name_the_second(bundled_bridge):
    docs, qa = bundled_bridge
    by_id = {d.id: d for d in docs}
    items = bridges(qa)
    assert len(items) == 392 and len({q.id for q in items}) == len(items)
    assert {q.metadata["relation"] for q in items} == {r.name for r in RELATIONS}
    for q in items:
        first, second = (by_id[g] for g in q.gold_doc_ids)
        assert q.id.startswith(f"{first.id}-b") and first.id != second.id
        assert first.title.lower() in q.question.lower()  # the question names the first hop
        names = {second.title, *q.metadata["bridge_aliases"]}
        assert all(name in second.text for name in q.metadata["bridge_aliases"])
        assert second.title in first.text  # the first article names the second one ...
        assert first.title.lower() not in second.text.lower()  # ... not the other way round
        assert not any(name.lower() in q.question.lower() for name in names), q.question
        (answer,) = q.answers
        assert answer in second.text and answer.lower() not in q.question.lower()
        relation, subject = match_question(q.question)
        assert relation.name == q.metadata["relation"] and subject.lower().endswith(
            first.title.lower()
        )


def test_bridge_splits_are_leak_free(bundled_bridge):
    _, qa = bundled_bridge

    def gold(items, split):
        return {g for q in items if split_of_item(q) == split for g in q.gold_doc_ids}

    single, items = [q for q in qa if q not in bridges(qa)], bridges(qa)
    assert not gold(single, "train") & gold(single, "test")
    assert not gold(items, "train") & gold(items, "test")
    for q in items:  # both articles on the item's side, which is set explicitly
        assert q.split == doc_split(q.gold_doc_ids[0]) == doc_split(q.gold_doc_ids[1])
    # a single-hop test article is a bridge test article: bridge training never sees it
    assert all(doc_split(g) == "test" for g in gold(single, "test"))
    assert not gold(items, "train") & gold(single, "test")
    # mixing the kinds drops the single-hop train questions about bridge test articles
    mixed = without_bridge_leaks(qa)
    assert not gold(mixed, "train") & gold(mixed, "test")
    assert [q for q in mixed if split_of_item(q) == "test"] == [
        q for q in qa if split_of_item(q) == "test"
    ]
    assert without_bridge_leaks(single) == single and without_bridge_leaks(items) == items


def test_bridge_test_questions_are_held_out_from_bridge_and_mixed_runs_not_single_hop(
    bridge_env,
):
    """Across env settings, as ``agentenv eval`` checks a checkpoint's training env
    against the evaluated one (:mod:`agentenv.run.leaks`): a bridge test question's
    articles are gold documents of no bridge or mixed train question; RAG-v0's default
    (single-hop) train questions are about some of them, so an adapter trained there is
    not held out on bridge questions."""
    bm25 = {"retriever": "bm25", "chroma": "memory"}
    bridge_test = RAGEnv(split="test", question_types="bridge", **bm25)
    single, single_test = RAGEnv(**bm25), RAGEnv(split="test", **bm25)
    mixed = RAGEnv(question_types=[*SINGLE_HOP_TYPES, "bridge"], **bm25)
    assert seen_tasks(bridge_env, bridge_test) == 0
    assert seen_tasks(mixed, bridge_test) == 0
    assert seen_tasks(single, single_test) == 0
    assert seen_tasks(mixed, single_test) == 0
    leaked = seen_tasks(single, bridge_test)
    assert 0 < leaked < bridge_test.num_tasks
    assert seen_tasks(bridge_test, bridge_test) == bridge_test.num_tasks  # it can find them


def test_default_task_list_is_unchanged_and_bridge_is_opt_in(small_data, small_env_kwargs):
    _, bundled_qa = bundled()
    _, loaded = _load_data(None, None)
    assert select_types(loaded, None) == list(bundled_qa)  # RAG-v0's default questions
    docs, qa = generate(6, 7, bridge=True)
    kwargs = {**small_env_kwargs, "qa": qa}
    plain, default = RAGEnv(**small_env_kwargs), RAGEnv(**kwargs)
    assert default._items == plain._items and default.num_tasks == plain.num_tasks
    only = RAGEnv(**kwargs, question_types=["bridge"])
    assert only._items == [q for q in bridges(qa) if q.split == "train"]
    assert RAGEnv(**kwargs, question_types="bridge")._items == only._items
    both = RAGEnv(**kwargs, question_types=["name", "bridge"])
    assert {t.metadata["qtype"] for t in both._items} == {"name", "bridge"}
    names = [q for q in plain._items if q.metadata["qtype"] == "name"]
    kept = [q for q in names if all(doc_split(g) == "train" for g in q.gold_doc_ids)]
    assert 0 < len(kept) < len(names)  # less those about a bridge test article
    assert both.num_tasks == only.num_tasks + len(kept)
    assert both.get_task(both.num_tasks - 1).metadata["qtype"] == "bridge"  # order kept


def test_a_bad_question_type_is_refused_naming_it_and_the_valid_ones(small_env_kwargs):
    _, qa = generate(6, 7, bridge=True)
    with pytest.raises(InvalidOptionError) as bad:
        RAGEnv(**{**small_env_kwargs, "qa": qa}, question_types=["name", "brige"])
    assert "'brige'" in str(bad.value) and "did you mean 'bridge'" in str(bad.value)
    assert str(sorted(QUESTION_TYPES)) in str(bad.value)
    with pytest.raises(InvalidOptionError, match=r"'bridge', which no question .* has"):
        select_types(qa[:3], ["bridge"])  # single-hop questions only
    with pytest.raises(InvalidOptionError, match="question_types is empty"):
        select_types(qa, [])
    untyped = [QAItem("q1", "What?", ("x",))]
    with pytest.raises(InvalidOptionError, match="the questions have no qtype"):
        select_types(untyped, "bridge")
    assert select_types(untyped, None) == untyped


def test_requery_picks_about_a_third_of_the_tasks_stably(bundled_bridge):
    ids = [q.id for q in bridges(bundled_bridge[1])]
    picked = [i for i in ids if wants_requery(i)]
    assert 0.25 < len(picked) / len(ids) < 0.42
    assert picked == [i for i in ids if wants_requery(i)]
    relation = RELATIONS[0]
    assert vague_queries(relation, "Oriane Thask")[0] == relation.question.format(subject="Oriane")
    by_name = {r.name: r for r in RELATIONS}
    assert vague_queries(by_name["maker"], "the Zorth Lantern")[0].endswith("the Lantern born?")
    assert vague_queries(by_name["road"], "Brevonne")[0] == (
        "In what year was the town that the old road to the town starts from founded?"
    )


@pytest.fixture(scope="module")
def bridge_env(bundled_bridge):
    """The bundled train bridge questions (hybrid retrieval, in-memory Chroma), with every
    query the tests and demonstrations make embedded up front in one batch (memoised)."""
    env = RAGEnv(question_types="bridge", chroma="memory")
    titles = {d.id: d.title for d in bundled_bridge[0]}
    queries = []
    for i in range(env.num_tasks):
        task = env.get_task(i)
        relation, subject = match_question(task.prompt)
        queries += [task.prompt, *vague_queries(relation, subject)]
        queries += [titles[g] for g in task.metadata["gold_doc_ids"]]
    env.retriever.retrievers["dense"].embed_queries(queries)
    return env


def test_one_search_with_the_question_finds_the_first_hop_not_the_second(bridge_env):
    """The question alone retrieves the article it names, almost never the answer's:
    the measured rates (benchmarks/rag_bridge.py) are 1.000 and 0.000 on train."""
    sample = range(bridge_env.num_tasks)
    first = second = 0
    for i in sample:
        task = bridge_env.get_task(i)
        found = unique_docs(bridge_env.retriever.search(task.prompt, bridge_env.default_k))
        first += task.metadata["gold_doc_ids"][0] in found
        second += task.metadata["gold_doc_ids"][1] in found
    assert first / len(sample) > 0.9 and second / len(sample) < 0.05


def _replay(env, i):
    env.reset(options={"task_id": i})
    actions = env.demonstration(env.task)
    outputs, info, terminated = [], {}, False
    for action in actions:
        obs, _, terminated, _, info = env.step(action)
        outputs.append(obs[0]["content"] if obs else "")
    return actions, outputs, terminated, info


def test_bridge_demonstrations_search_twice_and_score_1(bridge_env, bundled_bridge):
    titles = {d.id: d.title for d in bundled_bridge[0]}
    sample = range(bridge_env.num_tasks)  # every train bridge question
    requeried = 0
    for i in sample:
        actions, outputs, terminated, info = _replay(bridge_env, i)
        task = bridge_env.task
        first, second = task.metadata["gold_doc_ids"]
        assert terminated and info["correct"] and info["reward_answer"] == 1.0, actions
        hops = [search_action(titles[first]), search_action(titles[second])]
        if wants_requery(task.id) and len(actions) == 4:  # a miss, then the two hops
            requeried += 1
            assert f"(doc {first}," not in outputs[0] and f"(doc {second}," not in outputs[0]
            assert info["num_searches"] == 3 and actions[1:3] == hops
        else:
            assert info["num_searches"] == 2 and actions[:2] == hops
        assert f"(doc {first}," in outputs[-3] and f"(doc {second}," in outputs[-2]
    assert 0.25 < requeried / len(sample) < 0.42  # 68 of 208 when measured


def test_bridge_demonstrations_read_no_gold_and_replay_for_sft(bridge_env, tokenizer):
    from agentenv.rollout.demos import demonstration_episodes
    from agentenv.rollout.episode import ChatFormat

    bridge_env.reset(options={"task_id": 0})
    blind = dataclasses.replace(bridge_env.task, answer=["no such answer"])
    assert bridge_env.demonstration(blind) == bridge_env.demonstration(bridge_env.task)
    make = lambda: RAGEnv(question_types="bridge", chroma="memory")  # noqa: E731
    episodes = demonstration_episodes(make, ChatFormat(tokenizer), 12)
    assert len(episodes) == 12 and {e.num_turns for e in episodes} <= {3, 4}
    assert all(e.info["correct"] for e in episodes)


def test_single_hop_demonstrations_are_unchanged_beside_bridge_ones(small_env_kwargs):
    _, qa = generate(6, 7, bridge=True)
    env = RAGEnv(**{**small_env_kwargs, "qa": qa}, question_types=list(QUESTION_TYPES))
    plain = RAGEnv(**small_env_kwargs)
    by_id = {task.id: task for task in map(plain.get_task, range(plain.num_tasks))}
    checked = 0
    for i in range(0, env.num_tasks, 4):  # single-hop tasks (less leaky ones) come first
        task = env.get_task(i)
        if task.id in by_id:
            assert env.demonstration(task) == plain.demonstration(by_id[task.id])
            checked += 1
    assert checked > plain.num_tasks // 8
    assert len(env.demonstration(env.get_task(env.num_tasks - 1))) in (3, 4)


def test_bridge_demonstration_without_room_for_two_searches():
    question = RELATIONS[0].question.format(subject="Oriane Thask")

    def search(query: str) -> str:
        return "No passages found."

    assert bridge_demonstration(question, "t", search, max_searches=1) is None
    assert bridge_demonstration("Who founded it?", "t", search, max_searches=4) is None
    actions = bridge_demonstration(question, "t", search, max_searches=2)
    assert actions == [search_action("Oriane Thask"), "<answer>unknown</answer>"]


def test_each_step_reports_the_gold_articles_its_searches_found_first(bridge_env):
    """Per-turn reward: the share of gold articles a step's searches found first (0.5 per
    hop of a bridge question, 0 for a miss and for the answer); the searches' gold hits
    and which hops were found, for the retrieval metrics."""
    from types import SimpleNamespace

    from agentenv.rollout.stats import retrieval_stats

    seen = {"plain": 0, "requery": 0}
    finals = []
    for i in range(12):
        bridge_env.reset(options={"task_id": i})
        infos = [bridge_env.step(a)[4] for a in bridge_env.demonstration(bridge_env.task)]
        rewards = [info["turn_reward"] for info in infos]
        if len(infos) == 4:  # a vague search that missed, then the two hops
            seen["requery"] += 1
            assert rewards == [0.0, 0.5, 0.5, 0.0]
            assert infos[-1]["search_gold_hits"][0] == 0
        else:
            seen["plain"] += 1
            assert rewards == [0.5, 0.5, 0.0]
        assert infos[0]["gold_retrieved"] == [len(infos) == 3, False]
        assert infos[-1]["gold_retrieved"] == [True, True]
        finals.append(SimpleNamespace(info=infos[-1]))
    assert seen["plain"] and seen["requery"]
    assert retrieval_stats(finals) == {"requery_after_miss_rate": 1.0, "second_hop_recall": 1.0}


def test_a_bridge_answer_reports_each_hop_in_recall_and_pays_the_first_rank(bridge_env):
    """The reciprocal rank pays one hop and two the same (the first search finds the named
    article at rank 1); ``retrieval_recall`` reports the second hop."""
    for i in range(6):
        bridge_env.reset(options={"task_id": i})
        demo = bridge_env.demonstration(bridge_env.task)
        *searches, _ = demo[-3:]  # the two hop searches (after any missed one)
        for taken, recall in ((searches[:1], 0.5), (searches, 1.0)):
            bridge_env.reset(options={"task_id": i})
            info = [bridge_env.step(a)[4] for a in [*taken, "<answer>no idea</answer>"]][-1]
            assert info["reward_retrieval"] == pytest.approx(0.2)
            assert (info["retrieval_rr"], info["retrieval_recall"]) == (1.0, recall)
            assert info["reward_answer"] == 0.0


def test_eval_warns_when_a_checkpoint_trained_on_the_articles_it_is_tested_on(tmp_path):
    """``agentenv eval --adapter`` of a checkpoint trained on RAG-v0's single-hop
    questions, on its bridge test questions, says that the score is not held out; on the
    single-hop test split, or from a bridge run, it says nothing."""
    from agentenv.run.leaks import seen_warning

    bm25 = {"retriever": "bm25", "chroma": "memory"}
    runs = {}
    for name, kwargs in [("single", bm25), ("bridge", {**bm25, "question_types": "bridge"})]:
        (tmp_path / name).mkdir()
        record = {"env_id": "RAG-v0", "env_kwargs": kwargs}
        (tmp_path / name / "run.json").write_text(json.dumps(record))
        runs[name] = tmp_path / name
    bridge = {**bm25, "question_types": "bridge"}
    n = RAGEnv(split="test", **bridge).num_tasks
    warning = seen_warning(runs["single"], "RAG-v0", bridge, "test")
    assert warning is not None and warning.startswith("warning: ")
    assert f"of the {n} test tasks" in warning and "not held out" in warning
    assert seen_warning(runs["single"], "RAG-v0", bm25, "test") is None
    assert seen_warning(runs["bridge"], "RAG-v0", bridge, "test") is None
    assert seen_warning(tmp_path, "RAG-v0", bridge, "test") is None  # nothing recorded
