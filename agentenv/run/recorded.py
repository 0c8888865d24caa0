"""What a checkpoint records of the run that wrote it: the env it trained on and the rollout
settings, so that ``agentenv eval|demo|export`` given a checkpoint use them.

``agentenv train`` and ``agentenv sft`` write ``run.json`` into each checkpoint folder,
atomically with the rest (:data:`algorithms.checkpoint.RUN_FILE`)::

    {"env_id": "Calculator-v0", "env_kwargs": {"source": "word_problems"},
     "quantize": null, "max_turns": 2, "max_new_tokens": 48, "max_episode_tokens": 384}

A checkpoint written before that is read through its run directory's ``config.json``
(``RUN/checkpoint``, ``RUN/checkpoints/step_N``, ``RUN/checkpoints/step_N/member_i``).
Torch-free until a population checkpoint needs its fittest member resolved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentenv.env.registration import env_name
from agentenv.errors import InvalidOptionError

RUN_FILE = "run.json"  # algorithms.checkpoint.RUN_FILE (that module imports torch)
ROLLOUT_SETTINGS = ("max_turns", "max_new_tokens", "max_episode_tokens")
RECORDED = ("env_id", "env_kwargs", "envs", "quantize", *ROLLOUT_SETTINGS)


def run_record(config: dict[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint records, from a run's config as a dict (``config.json``:
    a ``TrainConfig``'s or an ``SFTRunConfig``'s). An SFT run has no rollout: its record
    holds the env and ``quantize`` only. A mixture's (``envs``) records its envs."""
    rollout = config.get("rollout") or {}
    record = {
        "env_id": config.get("env_id"),
        "env_kwargs": config.get("env_kwargs") or {},
        "envs": config.get("envs") or None,
        "quantize": config.get("quantize"),
        "max_turns": rollout.get("max_turns"),
        "max_new_tokens": (rollout.get("sampling") or {}).get("max_new_tokens"),
        "max_episode_tokens": rollout.get("max_episode_tokens"),
    }
    return {k: v for k, v in record.items() if v is not None or k == "quantize"}


def _run_dir_config(folder: Path) -> Path | None:
    """The ``config.json`` of the run directory a checkpoint folder sits in: ``RUN/checkpoint``
    (sft), ``RUN/checkpoints/step_N`` (train), ``RUN/checkpoints/step_N/member_i``."""
    folder = folder.resolve()
    if folder.name == "checkpoint":
        return folder.parent / "config.json"
    if folder.parent.name == "checkpoints":
        return folder.parent.parent / "config.json"
    if folder.parent.parent.name == "checkpoints":
        return folder.parent.parent.parent / "config.json"
    return None


def recorded_run(checkpoint: str | Path) -> tuple[dict[str, Any], Path] | None:
    """``(record, the file it came from)`` of the run that wrote ``checkpoint``, or None
    where nothing is recorded. A population's checkpoint: its fittest member's."""
    folder = Path(checkpoint)
    if (folder / "population.json").is_file():  # algorithms.population.POPULATION_FILE
        from algorithms.population import best_member

        folder = best_member(folder)[0]
    candidates = [folder / RUN_FILE, _run_dir_config(folder)]
    for path in filter(None, candidates):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("env_id"):
            return (data if path.name == RUN_FILE else run_record(data)), path
    return None


def checkpoint_env(checkpoint: str | Path) -> dict[str, Any] | None:
    """``{"env_id": ..., "env_kwargs": {...}}`` of the env ``checkpoint`` trained on, or
    None where the checkpoint records none."""
    found = recorded_run(checkpoint)
    if found is None:
        return None
    return {"env_id": found[0]["env_id"], "env_kwargs": found[0].get("env_kwargs") or {}}


def check_checkpoint(path: str | Path | None, flag: str) -> None:
    """Raise :class:`InvalidOptionError` naming ``flag`` and ``path`` unless ``path`` is a
    checkpoint folder (``adapter/`` or ``model/`` inside, or a population's); None passes.
    Call it before any model loads."""
    if path is None:
        return
    folder = Path(path)
    example = "pass a checkpoint folder written by `agentenv sft` or `agentenv train` (e.g. "
    example += "RUN/checkpoint or RUN/checkpoints/step_000010)"
    if not folder.is_dir():
        raise InvalidOptionError(f"{flag} {path}: no such folder; {example}")
    if not any((folder / name).exists() for name in ("adapter", "model", "population.json")):
        raise InvalidOptionError(
            f"{flag} {path} is not a checkpoint (it has neither adapter/ nor model/); {example}"
        )


def take_recorded(record: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The recorded settings a command uses: each of :data:`RECORDED` that ``given`` (the
    settings the user gave, by the same names) lacks. The recorded ``env_kwargs`` go with
    the recorded env only: not when another ``env_id`` is given, nor beside given ones;
    a recorded mixture (``envs``) only where neither ``env_id`` nor ``envs`` is given."""
    record = dict(record)
    if record.get("envs") or "envs" in given:  # a mixture's envs stand for env_id/env_kwargs
        record.pop("env_id", None)
        record.pop("env_kwargs", None)
    if "env_id" in given or "envs" in given:
        record.pop("envs", None)
    other_env = (
        "env_id" in given
        and "env_id" in record
        and env_name(given["env_id"]) != env_name(record["env_id"])
    )
    taken = {k: record[k] for k in RECORDED if k in record and k not in given}
    if other_env:
        taken.pop("env_kwargs", None)
    if "env_id" in given:
        taken.pop("env_id", None)
    if taken.get("quantize", "") is None:  # trained unquantized: as the default
        del taken["quantize"]
    return taken


def one_env_record(record: dict[str, Any], env_id: str | None) -> tuple[dict[str, Any], str]:
    """A mixture's record (``envs``) as the record of one of its envs, for a command that
    runs one env (``demo``): the member whose name or env id is ``env_id``, else the
    first; its own turn and token limits win over the run's. Returns the record and a
    line naming the choice ("" where ``record`` is no mixture, or ``env_id`` is none of
    its envs: then the record goes through unchanged)."""
    from agentenv.env.mixture import EnvSpec

    specs = [EnvSpec.coerce(e, "run.json") for e in record.get("envs") or []]
    chosen = [
        s
        for s in specs
        if env_id is None or env_id == s.name or env_name(env_id) == env_name(s.env_id)
    ]
    if not chosen:
        return record, ""
    spec, names = chosen[0], [s.name for s in specs]
    one = {k: v for k, v in record.items() if k != "envs"}
    one.update(env_id=spec.env_id, env_kwargs=spec.env_kwargs, **spec.limits())
    line = f"note: the checkpoint trained on a mixture ({', '.join(names)}); this plays {spec.name}"
    others = [n for n in names if n != spec.name]
    if others:
        line += f" (name another, e.g. `{others[0]}`, as ENV_ID)"
    return one, line


def recorded_note(checkpoint: str | Path, taken: dict[str, Any], source: Path, env_id: str) -> str:
    """The one line saying which settings a command took from ``checkpoint``'s run
    (``env_id``: the env the command runs)."""
    settings = ", ".join(f"{k} {taken[k]}" for k in ("quantize", *ROLLOUT_SETTINGS) if k in taken)
    if "envs" in taken:
        names = ", ".join(e.get("name") or e["env_id"] for e in taken["envs"])
        what = f"the envs the checkpoint trained on: {names}"
        what += f", and its {settings}" if settings else ""
    elif "env_id" in taken or "env_kwargs" in taken:
        kwargs = f" {json.dumps(taken['env_kwargs'])}" if "env_kwargs" in taken else ""
        what = f"the env the checkpoint trained on: {env_id}{kwargs}"
        what += f", and its {settings}" if settings else ""
    else:
        what = f"the checkpoint's {settings}"
    flags = "/".join(f"--{k.replace('_', '-')}" for k in RECORDED if k in taken)
    return f"note: using {what} (from {source}); pass {flags} to override"
