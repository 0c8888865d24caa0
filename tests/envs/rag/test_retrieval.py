import socket
import threading
import time

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from envs.rag import (
    BM25Retriever,
    ChromaConnectionError,
    Chunk,
    CorpusError,
    DenseRetriever,
    Document,
    FastBM25,
    Hit,
    HybridRetriever,
    RAGEnv,
    RetrieverConfigError,
    build_retriever,
    chunk_documents,
    clear_retriever_cache,
    generate,
    make_chroma_client,
    rrf_fuse,
    tokenize,
    weighted_fuse,
)
from envs.rag.index_cache import MANIFEST, index_key
from envs.rag.retrieval import top_k_indices


@pytest.fixture(scope="module")
def small_chunks(small_data):
    return chunk_documents(small_data[0])


def _chunk(i: int) -> Chunk:
    return Chunk(f"c{i}", f"d{i}", "", f"text {i}")


def test_tokenizer_is_documented_behaviour():
    assert tokenize("KX-4471, the Lantern's ÉCOLE_x of") == [
        "kx",
        "4471",
        "lantern",
        "s",
        "école",
        "x",
    ]
    assert tokenize("the of and") == []


def test_fast_bm25_scores_equal_rank_bm25_bit_for_bit():
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(40)]
    corpus = [list(rng.choice(vocab, size=rng.integers(1, 30), p=_zipf(40))) for _ in range(60)]
    corpus.append([])  # an empty document
    reference, fast = BM25Okapi(corpus), FastBM25(corpus)
    assert any(v < 0 for v in _raw_idf(corpus).values())  # the epsilon floor is exercised
    queries = [["w0"], ["w1", "w1", "w5"], ["w39", "unknown"], ["unknown"], vocab[:12], []]
    for query in queries:
        expected = reference.get_scores(query)
        assert np.array_equal(fast.get_scores(query), expected), query


def _zipf(n: int) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1)
    return p / p.sum()


def _raw_idf(corpus):
    import math

    n = len(corpus)
    df = {}
    for doc in corpus:
        for w in set(doc):
            df[w] = df.get(w, 0) + 1
    return {w: math.log(n - f + 0.5) - math.log(f + 0.5) for w, f in df.items()}


def test_bm25_backends_rank_identically(small_data, small_chunks):
    fast = BM25Retriever(small_chunks, backend="fast")
    slow = BM25Retriever(small_chunks, backend="rank_bm25")
    for item in small_data[1]:
        a, b = fast.search(item.question, 5), slow.search(item.question, 5)
        assert [h.chunk.id for h in a] == [h.chunk.id for h in b]
        assert [h.score for h in a] == [h.score for h in b]
    assert fast.search("zzz qqq", 5) == []  # nothing matches: nothing returned
    with pytest.raises(RetrieverConfigError, match="backend must be one of"):
        BM25Retriever(small_chunks, backend="lucene")
    with pytest.raises(CorpusError, match="empty corpus"):
        BM25Retriever([])
    with pytest.raises(CorpusError, match="empty after tokenization"):
        BM25Retriever([Chunk("a#0", "a", "", "the of !!")])


def test_top_k_keeps_positive_scores_and_breaks_ties_by_index():
    scores = np.array([0.0, 2.0, 1.0, 2.0, -1.0, 1.0])
    assert top_k_indices(scores, 3) == [1, 3, 2]
    assert top_k_indices(scores, 10) == [1, 3, 2, 5]
    assert top_k_indices(np.zeros(4), 2) == []


def test_rrf_and_weighted_fusion_math():
    a = [Hit(_chunk(1), 9.0), Hit(_chunk(2), 5.0)]
    b = [Hit(_chunk(2), 0.8), Hit(_chunk(3), 0.7)]
    fused = rrf_fuse([a, b], [1.0, 1.0], k=3, rrf_k=60)
    assert [h.chunk.id for h in fused] == ["c2", "c1", "c3"]
    assert [h.score for h in fused] == pytest.approx([1 / 62 + 1 / 61, 1 / 61, 1 / 62])
    only_a = rrf_fuse([a, b], [1.0, 0.0], k=2, rrf_k=60)
    assert [(h.chunk.id, h.score) for h in only_a] == [("c1", 1 / 61), ("c2", 1 / 62)]
    fused = weighted_fuse([a, b], [1.0, 1.0], k=2)  # c1: 1 + 0, c2: 0 + 1 -> tie, c1 first
    assert [(h.chunk.id, h.score) for h in fused] == [("c1", 1.0), ("c2", 1.0)]
    assert [h.score for h in weighted_fuse([a, b], [1.0, 0.5], k=3)] == pytest.approx([1, 0.5, 0])
    assert weighted_fuse([[Hit(_chunk(5), 3.0)], []], [1.0, 1.0], k=2)[0].score == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fusion": "max"}, "fusion must be one of"),
        ({"weights": {"sparse": 1.0}}, "unknown retriever"),
        ({"weights": {"a": -1.0}}, ">= 0 and not all 0"),
        ({"weights": {"a": 0.0, "b": 0.0}}, ">= 0 and not all 0"),
        ({"fetch_k": 0}, "fetch_k >= 1"),
    ],
)
def test_hybrid_config_errors_name_the_value(small_chunks, kwargs, message):
    bm25 = BM25Retriever(small_chunks)
    with pytest.raises(RetrieverConfigError, match=message):
        HybridRetriever({"a": bm25, "b": bm25}, **kwargs)


@pytest.fixture
def no_chroma_download(monkeypatch):
    """Make any use of chromadb's default (downloading) embedding function fail loudly."""
    from chromadb.api.types import DefaultEmbeddingFunction
    from chromadb.utils.embedding_functions.onnx_mini_lm_l6_v2 import ONNXMiniLM_L6_V2

    def boom(*args, **kwargs):
        raise AssertionError("chromadb's default embedding function was triggered")

    monkeypatch.setattr(DefaultEmbeddingFunction, "__call__", boom)
    monkeypatch.setattr(ONNXMiniLM_L6_V2, "__call__", boom)
    monkeypatch.setattr(ONNXMiniLM_L6_V2, "_download_model_if_not_exists", boom)


@pytest.mark.filterwarnings("ignore:legacy embedding function config:DeprecationWarning")
def test_dense_and_hybrid_find_paraphrases_without_chroma_downloads(
    small_data, small_chunks, cache_dir, no_chroma_download
):
    hybrid = build_retriever(small_chunks, chunking=(128, 32), chroma="memory", cache_dir=cache_dir)
    dense = hybrid.retrievers["dense"]
    assert isinstance(dense, DenseRetriever)
    assert dense.collection.configuration["hnsw"]["space"] == "cosine"
    paraphrases = [q for q in small_data[1] if q.metadata["qtype"] == "paraphrase"]
    found = sum(
        q.gold_doc_ids[0] in [h.doc_id for h in dense.search(q.question, 5)] for q in paraphrases
    )
    assert found >= 0.6 * len(paraphrases)
    lists = hybrid.search_all(paraphrases[0].question, 3)
    assert set(lists) == {"bm25", "dense", "hybrid"} and len(lists["hybrid"]) == 3
    hits = dense.search("anything at all", 4)
    assert len(hits) == 4 and all(-1.0 <= h.score <= 1.0 for h in hits)
    assert hits == sorted(hits, key=lambda h: -h.score)
    with pytest.raises(RetrieverConfigError, match="shape"):
        DenseRetriever(small_chunks[:3], np.zeros((2, 384)), collection_name="agentenv-badshape")


def test_index_cache_reuses_embeddings_and_retrievers(small_chunks, tmp_path, monkeypatch):
    from envs.rag.dense import Embedder

    encoded: list[int] = []
    original = Embedder.encode
    monkeypatch.setattr(
        Embedder,
        "encode",
        lambda self, texts, **kw: encoded.append(len(texts)) or original(self, texts, **kw),
    )
    chunks = small_chunks[:10]
    first = build_retriever(chunks, retriever="dense", chroma="persistent", cache_dir=tmp_path)
    key = index_key(chunks, (0, 0), None)
    assert (tmp_path / key / MANIFEST).is_file() and (tmp_path / key / "chroma").is_dir()
    assert encoded == [10]
    assert (
        build_retriever(chunks, retriever="dense", chroma="persistent", cache_dir=tmp_path) is first
    )
    clear_retriever_cache()
    again = build_retriever(chunks, retriever="dense", chroma="persistent", cache_dir=tmp_path)
    assert again is not first and encoded == [10]  # Chroma folder reused: nothing embedded
    in_memory = build_retriever(chunks, retriever="dense", chroma="memory", cache_dir=tmp_path)
    assert encoded == [10]  # vectors from embeddings.npy
    query = chunks[3].text
    assert [h.chunk.id for h in in_memory.search(query, 3)] == [
        h.chunk.id for h in again.search(query, 3)
    ]
    other = build_retriever(chunks[:9], retriever="dense", chroma="memory", cache_dir=tmp_path)
    assert other is not in_memory and encoded[-1] == 9  # a different corpus is a new index
    with pytest.raises(RetrieverConfigError, match="retriever must be one of"):
        build_retriever(chunks, retriever="splade")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_chroma_server_fails_fast_with_a_clear_error(small_data):
    url = f"http://127.0.0.1:{_closed_port()}"
    start = time.perf_counter()
    with pytest.raises(
        ChromaConnectionError, match=f"cannot reach a Chroma server at {url}"
    ) as err:
        make_chroma_client(url, connect_timeout_s=2.0)
    assert time.perf_counter() - start < 3.0
    assert "chroma run" in str(err.value)
    start = time.perf_counter()
    with pytest.raises(ChromaConnectionError):
        RAGEnv(corpus=small_data[0][:4], qa=small_data[1][:4], chroma=url, num_tasks=1)
    assert time.perf_counter() - start < 3.0
    with pytest.raises(RetrieverConfigError, match="server URL like"):
        make_chroma_client("localhost:8000")


def test_silent_server_does_not_hang_past_the_timeout():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts TCP connections (backlog) but never answers HTTP
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        start = time.perf_counter()
        with pytest.raises(ChromaConnectionError, match="did not answer"):
            make_chroma_client(url, connect_timeout_s=1.0)
        assert time.perf_counter() - start < 2.5
    finally:
        listener.close()


def test_concurrent_searches_on_a_shared_retriever(small_chunks, cache_dir):
    hybrid = build_retriever(small_chunks, chunking=(128, 32), chroma="memory", cache_dir=cache_dir)
    queries = [c.text[:60] for c in small_chunks[:8]]
    expected = [[h.chunk.id for h in hybrid.search(q, 3)] for q in queries]
    results: dict[int, list[str]] = {}

    def run(i: int) -> None:
        results[i] = [h.chunk.id for h in hybrid.search(queries[i], 3)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(queries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [results[i] for i in range(len(queries))] == expected


def test_documents_without_text_never_reach_an_index():
    with pytest.raises(CorpusError):
        chunk_documents([Document("a", "", "")])
    docs, _ = generate(num_per_type=1)
    assert len(chunk_documents(docs)) == 4


@pytest.fixture
def chroma_server(tmp_path):
    """A real local Chroma server (the `chroma` CLI of the chromadb package) on a free port."""
    import subprocess
    import urllib.request

    from scripts import console_script

    exe = console_script("chroma")
    if exe is None:
        pytest.skip("the chroma CLI is not installed (beside python or on PATH)")
    port = _closed_port()
    log = (tmp_path / "chroma.log").open("w")
    proc = subprocess.Popen(
        [exe, "run", "--path", str(tmp_path / "db"), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/v2/heartbeat", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.skip("the local Chroma server did not start")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_http_client_shares_one_index_on_a_chroma_server(
    small_chunks, cache_dir, chroma_server, monkeypatch
):
    from envs.rag.dense import Embedder

    chunks = small_chunks[:12]
    first = build_retriever(chunks, retriever="dense", chroma=chroma_server, cache_dir=cache_dir)
    expected = [h.chunk.id for h in first.search(chunks[5].text, 3)]
    assert expected[0] == chunks[5].id
    clear_retriever_cache()  # as if another rollout worker started
    encoded: list[int] = []
    original = Embedder.encode
    monkeypatch.setattr(
        Embedder,
        "encode",
        lambda self, texts, **kw: encoded.append(len(texts)) or original(self, texts, **kw),
    )
    second = build_retriever(chunks, retriever="dense", chroma=chroma_server, cache_dir=cache_dir)
    assert (
        second is not first and [h.chunk.id for h in second.search(chunks[5].text, 3)] == expected
    )
    assert encoded == [1]  # only the query: the server already held the chunk vectors
