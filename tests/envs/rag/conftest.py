"""Fixtures of the RAG tests: a small generated corpus, the registered id, shared caches.

The bundled corpus's embeddings are cached under the normal ``agentenv_home()`` (like
the converted SmolLM2 in tests/conftest.py), so only the first run pays ~20 s to embed
its 360 chunks; every other index lives in a temporary folder.
"""

import json

import pytest

import agentenv
from envs.rag import Document, QAItem, generate


@pytest.fixture(scope="session", autouse=True)
def rag_registered():
    """``agentenv/RAG-v0`` (registered here until the registry bundles it)."""
    if "agentenv/RAG-v0" not in agentenv.registry():
        agentenv.register("RAG-v0", "envs.rag:RAGEnv", override=True)
    return "RAG-v0"


@pytest.fixture(scope="session")
def small_data() -> tuple[list[Document], list[QAItem]]:
    """A 24-article generated encyclopedia and its 66 questions (seed 7)."""
    return generate(num_per_type=6, seed=7)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A session-wide index cache folder for the small corpora."""
    return tmp_path_factory.mktemp("rag_index")


@pytest.fixture(scope="session")
def small_env_kwargs(small_data, cache_dir) -> dict:
    """RAGEnv arguments for the small corpus, in-memory Chroma, temporary cache."""
    docs, qa = small_data
    return {"corpus": docs, "qa": qa, "chroma": "memory", "cache_dir": str(cache_dir)}


@pytest.fixture
def write_jsonl():
    """``write_jsonl(path, rows)``: rows (dicts or raw strings) as lines; returns the path."""

    def write(path, rows) -> str:
        lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return str(path)

    return write
