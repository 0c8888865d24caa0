"""Task rows: the dataset every integration hands to its library.

A row is ``{"prompt": [system, user], "task_id": i}``: the env's opening messages for task
``i`` of a split, and the index that resets an env to the same task
(``env.reset(options={"task_id": i})``). Libraries that keep their data in a dataset
(TRL, verifiers, SkyRL's parquet files) carry ``task_id`` to the env, which re-creates the
task's state (a Workspace's files, RAG's search budget) on reset.
"""

from __future__ import annotations

from typing import Any

from agentenv.env.registration import make
from agentenv.errors import InvalidOptionError


def task_rows(
    env_id: str,
    *,
    split: str = "train",
    num_tasks: int | None = None,
    system_prompt: str = "env",
    **env_kwargs: Any,
) -> list[dict[str, Any]]:
    """One row per task of ``split``: ``{"prompt": [system, user], "task_id": i}``.

    Args:
        env_id: A registered env id (``"Calculator-v0"`` or ``"agentenv/Calculator-v0"``).
        split: ``"train"`` or ``"test"``.
        num_tasks: The first ``num_tasks`` tasks; default all of the split.
        system_prompt: ``"env"`` keeps the env's whole system prompt (instructions and its
            own tool-call format, for libraries that pass the model's text to ``step``);
            ``"instructions"`` keeps only the task instructions, for libraries whose chat
            template lists the tools itself (TRL).
        **env_kwargs: Passed to :func:`agentenv.make` (e.g. ``source=``, ``families=``).
    """
    if system_prompt not in ("env", "instructions"):
        raise InvalidOptionError(
            f"system_prompt must be 'env' or 'instructions', got {system_prompt!r}"
        )
    env = make(env_id, split=split, **env_kwargs)
    try:
        inner = env.unwrapped
        total = inner.num_tasks
        if num_tasks is not None and not 1 <= num_tasks <= total:
            raise InvalidOptionError(
                f"num_tasks={num_tasks} is outside 1..{total}, the number of {split} tasks "
                f"of {env_id}; pass at most {total} or leave it out for all of them"
            )
        rows = []
        for task_id in range(total if num_tasks is None else num_tasks):
            system, user = env.reset(options={"task_id": task_id})[0]
            if system_prompt == "instructions":
                system = {"role": "system", "content": inner.instructions()}
            rows.append({"prompt": [system, user], "task_id": task_id})
        return rows
    finally:
        env.close()
