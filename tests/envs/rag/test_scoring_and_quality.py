import pytest

from agentenv.errors import InvalidOptionError
from envs.rag import (
    RewardWeights,
    build_retriever,
    bundled,
    chunk_documents,
    exact_match,
    normalize_answer,
    score_answer,
    split_items,
    token_f1,
)
from envs.rag.baselines import extract_answer
from envs.rag.evaluate import evaluate_by_type, evaluate_retrieval, format_table
from envs.rag.scoring import first_gold_rr


def test_normalisation_exact_match_and_f1():
    assert normalize_answer("  The Vellmark  Institute! ") == "vellmark institute"
    assert normalize_answer("1,843") == "1843"
    assert exact_match("the vellmark institute.", ["Vellmark Institute", "Vellmark"]) == 1.0
    assert exact_match("Vellmark Inst", ["Vellmark Institute"]) == 0.0
    assert token_f1("Oriane Thask", ["Thask"]) == pytest.approx(2 / 3)
    assert token_f1("Oriane Thask", ["Oriane Thask", "Thask"]) == 1.0
    assert token_f1("", ["x"]) == 0.0 and token_f1("x", [""]) == 0.0
    assert first_gold_rr(["a", "b", "c"], ["c", "z"]) == pytest.approx(1 / 3)
    assert first_gold_rr(["a"], []) == 0.0


def test_score_answer_terms_sum_to_the_reward():
    weights = RewardWeights(answer=1.0, retrieval=0.5, format=0.1, max_answer_words=3)
    reward, info = score_answer("Thask", ["Oriane Thask", "Thask"], ["d2", "d1"], ["d1"], weights)
    assert info["correct"] and info["retrieval_rr"] == 0.5 and reward == pytest.approx(1.35)
    parts = info["reward_answer"] + info["reward_retrieval"] + info["reward_format"]
    assert reward == pytest.approx(parts)
    reward, info = score_answer("one two three four", ["x"], [], ["d1"], weights)
    assert reward == 0.0 and not info["format_ok"]
    long_gold = "a very long gold answer of many words"
    _, info = score_answer(long_gold, [long_gold], [], [], weights)
    assert info["format_ok"]  # a right answer is always well formed


def test_the_reward_pays_the_first_gold_rank_and_recall_is_reported_beside_it():
    weights = RewardWeights(retrieval=0.2)
    retrieved, gold = ["d9", "d1", "d8", "d7"], ["d1", "d2"]
    _, one = score_answer("x", ["y"], retrieved, gold, weights)
    assert (one["retrieval_rr"], one["retrieval_recall"]) == (0.5, 0.5)  # d1 at rank 2
    assert one["reward_retrieval"] == pytest.approx(0.1)
    assert one["reward_components"]["retrieval"] == 0.5
    _, both = score_answer("x", ["y"], [*retrieved, "d2"], gold, weights)
    assert (both["retrieval_rr"], both["retrieval_recall"]) == (0.5, 1.0)
    assert both["reward_retrieval"] == pytest.approx(0.1)  # the second hop is not paid
    _, none = score_answer("x", ["y"], retrieved, [], weights)
    assert none["retrieval_recall"] == 0.0 and none["reward_retrieval"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"answer": 0.0}, "answer weight must be > 0"),
        ({"format": 1.0}, "must be smaller than the answer weight"),
        ({"retrieval": -1}, "retrieval weight must be a number >= 0"),
        ({"max_answer_words": 0}, "max_answer_words"),
    ],
)
def test_reward_weights_validation(kwargs, message):
    with pytest.raises(InvalidOptionError, match=message):
        RewardWeights(**kwargs)


def test_rule_based_reader_answers_from_the_gold_article():
    docs, qa = bundled()
    by_id = {d.id: d for d in docs}
    right = [
        exact_match(extract_answer(q.question, by_id[q.gold_doc_ids[0]].title,
                                   by_id[q.gold_doc_ids[0]].text), q.answers)
        for q in qa
    ]  # fmt: skip
    assert sum(right) / len(right) > 0.95


@pytest.fixture(scope="module")
def bundled_hybrid():
    docs, qa = bundled()
    chunks = chunk_documents(docs)
    return build_retriever(chunks, chunking=(128, 32), chroma="memory"), split_items(qa, "test")


def test_retrieval_quality_on_the_bundled_test_split(bundled_hybrid):
    """RRF fusion beats both retrievers on the mixed question set at k = 3, 5, 10."""
    hybrid, items = bundled_hybrid
    by_type = evaluate_by_type(hybrid, items)
    overall = by_type["all"]
    assert overall["bm25"]["n"] == len(items) > 150
    bm25, dense, fused = overall["bm25"], overall["dense"], overall["hybrid"]
    for k in (3, 5, 10):  # RRF wins at the depths an agent reads
        assert fused[f"recall@{k}"] > max(bm25[f"recall@{k}"], dense[f"recall@{k}"]), k
    # Per type, each retriever has its niche: ids are lexical, paraphrases semantic.
    assert by_type["id"]["bm25"]["recall@1"] > 0.95 > 0.3 > by_type["id"]["dense"]["recall@1"]
    assert by_type["paraphrase"]["bm25"]["recall@10"] == 0.0
    assert by_type["paraphrase"]["dense"]["recall@10"] > 0.6
    assert "| all | " in format_table(by_type)


def test_weighted_fusion_beats_both_on_every_metric(bundled_hybrid):
    from envs.rag import HybridRetriever

    rrf, items = bundled_hybrid
    weighted = HybridRetriever(rrf.retrievers, fusion="weighted")
    scores = evaluate_retrieval(weighted, items)
    for metric in ("recall@1", "recall@3", "recall@5", "recall@10", "mrr"):
        assert scores["hybrid"][metric] > max(scores["bm25"][metric], scores["dense"][metric])
