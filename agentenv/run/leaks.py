"""Whether an evaluation is held out from what a checkpoint trained on.

Each env keeps its own ``train`` and ``test`` splits apart, but two settings of one env
may not be apart from each other: RAG-v0's single-hop questions and its bridge
questions are split by different rules (:mod:`envs.rag.bridge`), so a single-hop train
question can be about an article a bridge test question needs. A task that names its
gold documents (``Task.metadata["gold_doc_ids"]``, as RAG-v0's do) is *seen* when one of
them is a gold document of a task the checkpoint trained on. Envs whose tasks name no
documents are never flagged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def gold_documents(env: Any) -> list[set[str]]:
    """The gold document ids of each task of ``env``'s split, in task order (empty sets
    for an env without ``get_task`` or whose tasks name none)."""
    env = getattr(env, "unwrapped", env)
    get_task = getattr(env, "get_task", None)
    if get_task is None:
        return []
    return [set(get_task(i).metadata.get("gold_doc_ids") or ()) for i in range(int(env.num_tasks))]


def seen_tasks(trained: Any, tested: Any) -> int:
    """How many of ``tested``'s tasks have a gold document among those of ``trained``'s
    tasks (two env instances: the split a checkpoint trained on and the one evaluated)."""
    train_docs = set().union(*gold_documents(trained))
    return sum(bool(docs & train_docs) for docs in gold_documents(tested))


def seen_warning(
    checkpoint: str | Path, env_id: str, env_kwargs: dict[str, Any], split: str
) -> str | None:
    """The line ``agentenv eval`` prints when some of the evaluated tasks (``env_id`` with
    ``env_kwargs``, ``split``) are about documents that ``checkpoint``'s run trained on
    (:func:`seen_tasks`); None when none are, or the checkpoint records no env. The train
    split is built only when the evaluated tasks name documents and the env differs."""
    from agentenv.env.registration import make
    from agentenv.run.recorded import checkpoint_env

    trained = checkpoint_env(checkpoint)
    if trained is None:
        return None
    same = (trained["env_id"], trained["env_kwargs"]) == (env_id, env_kwargs)
    tested = make(env_id, split=split, **env_kwargs)
    try:
        docs = gold_documents(tested)
        if same and split == "test" or not any(docs):
            return None  # one env's splits are apart by construction
        source = make(trained["env_id"], split="train", **trained["env_kwargs"])
        try:
            train_docs = set().union(*gold_documents(source))
        finally:
            source.close()
    finally:
        tested.close()
    seen = sum(bool(d & train_docs) for d in docs)
    if not seen:
        return None
    return (
        f"warning: {seen} of the {len(docs)} {split} tasks are about documents that "
        f"{checkpoint}'s run trained on ({trained['env_id']} "
        f"{json.dumps(trained['env_kwargs'])}, train split): this score is not held out"
    )
