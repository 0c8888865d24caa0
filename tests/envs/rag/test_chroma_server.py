"""RAG-v0 on a real Chroma server (``chroma run``) that stalls, crashes and comes back.

The same env instances, searching from several threads, see a paused server (SIGSTOP)
as a ``timeout`` error observation after ``tool_timeout_s``, a killed one (SIGKILL) as an
``exception`` error observation at once, and, after a restart on the same port over the
same folder, the same passages as before the crash: chromadb's HTTP client reconnects
by itself. benchmarks/chroma_load.py does the same with many workers and processes.
"""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from chroma_server import ChromaServer, chroma_cli

import agentenv

NUM_ENVS = 3
TOOL_TIMEOUT_S = 3.0
# httpx's errors for a refused connection, or a pooled one the crash cut
CONNECTION_ERROR = r"Error: tool 'search' raised (ConnectError|RemoteProtocolError|ReadError): "
TIMED_OUT = f"Error: tool 'search' timed out after {TOOL_TIMEOUT_S:g} s; try a smaller input"


def search(query: str) -> str:
    call = {"name": "search", "arguments": {"query": query}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


@pytest.fixture
def chroma_server(tmp_path):
    """A ``chroma run`` on a free port of 127.0.0.1, persisted in ``tmp_path/db``."""
    exe, why = chroma_cli()
    if exe is None:
        pytest.skip(why)
    server = ChromaServer(exe, tmp_path / "db", tmp_path / "chroma.log").start()
    yield server
    server.kill()  # SIGKILL ends a paused server too


def search_all(envs, queries) -> list[tuple[str, dict, float, bool]]:
    """Each env searches its query in a thread of its own, all at once:
    ``(observation text, info, seconds, episode over)`` per env."""

    def one(env, query):
        start = time.perf_counter()
        obs, reward, terminated, truncated, info = env.step(search(query))
        assert reward == 0.0 and len(obs) == 1 and obs[0]["role"] == "tool"
        return obs[0]["content"], info, time.perf_counter() - start, terminated or truncated

    with ThreadPoolExecutor(len(envs)) as pool:
        return list(pool.map(one, envs, queries))


def test_searches_survive_a_stalled_and_a_crashed_server(small_data, cache_dir, chroma_server):
    docs, qa = small_data
    kwargs = dict(corpus=docs, qa=qa, retriever="dense", chroma=chroma_server.url)
    kwargs.update(cache_dir=str(cache_dir), tool_timeout_s=TOOL_TIMEOUT_S, max_searches=8)
    envs = [agentenv.make("RAG-v0", **kwargs, max_turns=16) for _ in range(NUM_ENVS)]
    for i, env in enumerate(envs):
        env.reset(options={"task_id": i})
    tasks = [env.unwrapped.task for env in envs]
    questions = [t.prompt for t in tasks]

    before = search_all(envs, questions)  # the server is up
    for (text, info, _, over), task in zip(before, tasks, strict=True):
        assert text.startswith("[1] ") and not over
        assert f"(doc {task.metadata['gold_doc_ids'][0]}, chunk " in text, text
        assert (info["num_searches"], info["num_tool_errors"], info["tool_errors"]) == (1, 0, {})

    chroma_server.pause()  # accepts connections, never answers: only the tool timeout ends it
    try:
        stalled = search_all(envs, questions)
    finally:
        chroma_server.resume()
    for text, info, seconds, over in stalled:
        assert text == TIMED_OUT
        assert TOOL_TIMEOUT_S <= seconds < TOOL_TIMEOUT_S + 2 and not over
        assert (info["num_searches"], info["tool_errors"]) == (2, {"timeout": 1})

    chroma_server.kill()  # a crash: connections are refused
    for round_ in (1, 2):
        crashed = search_all(envs, questions)
        for text, info, seconds, over in crashed:
            assert re.match(CONNECTION_ERROR, text), text
            assert seconds < 2.0 and not over
            assert info["num_searches"] == 2 + round_
            assert info["tool_errors"] == {"timeout": 1, "exception": round_}

    chroma_server.start()  # same port, same folder: the index is still there
    after = search_all(envs, questions)
    for (text, info, _, over), (text_before, *_) in zip(after, before, strict=True):
        assert text == text_before and not over  # the same passages, the same envs
        assert (info["num_searches"], info["num_tool_errors"]) == (5, 3)
