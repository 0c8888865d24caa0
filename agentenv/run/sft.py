"""``agentenv sft``: a supervised warm start from the env's expert demonstrations.

data (env.demonstration) -> episodes (same tokens/masks as RL) -> masked-NLL SFT
-> checkpoint that `agentenv train --init-from` and `agentenv eval --adapter` accept
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

from agentenv import config as config_lib
from agentenv.env.registration import env_name
from agentenv.errors import InvalidOptionError
from agentenv.lm.precision import resolve_dtype
from agentenv.run.config import SFTRunConfig
from agentenv.run.recorded import run_record


def sft(config: SFTRunConfig) -> Path:
    """Fine-tune on demonstrations; return the checkpoint folder (``RUN/checkpoint``)."""
    import torch

    from agentenv.lm import models
    from agentenv.lm.precision import training_dtype
    from agentenv.rollout.demos import demonstration_episodes
    from agentenv.rollout.episode import ChatFormat
    from agentenv.run.train import processes
    from algorithms.sft import SFT

    check_demonstrations(config)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    mixture = config.mixture()
    name = env_name(config.env_id) if len(mixture) == 1 else "mixture"
    run_dir = Path(config.output_dir or f"runs/sft-{name}-{stamp}")
    main = processes()[1] == 0  # under several processes, only the main one writes
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config_lib.to_dict(config), indent=2))
    torch.manual_seed(config.seed)
    device = config.device or models.default_device()
    compute = resolve_dtype(config.dtype, device)
    sft_config = config.sft
    model, tokenizer = models.load(
        config.model,
        dtype=training_dtype(compute, sft_config.use_lora),
        device=device,
        quantize=config.quantize,
    )
    fmt = ChatFormat(tokenizer)
    episodes = []  # a mixture: num_demos split over its envs by their weights at step 0
    counts = mixture.largest_remainder(config.num_demos)
    for spec, count in zip(mixture.specs, counts, strict=True):
        demos = demonstration_episodes(
            functools.partial(spec.make, "train"),
            fmt,
            count,
            seed=config.seed,
            max_episode_tokens=config.max_episode_tokens,
        )
        for episode in demos if len(mixture) > 1 else ():
            episode.env = str(spec.name)
        episodes += demos
    trainer = SFT(model, tokenizer, sft_config, seed=config.seed, dtype=compute)
    trainer.run_record = run_record(config_lib.to_dict(config))  # the checkpoint's run.json
    history = trainer.fit(episodes)
    if main:
        with (run_dir / "metrics.jsonl").open("w") as f:
            f.writelines(json.dumps(row) + "\n" for row in history)
    path = trainer.save(run_dir / "checkpoint")  # the main process writes, all wait
    if main:
        print(
            f"SFT on {len(episodes)} demonstrations: loss {history[0]['sft/loss']:.3f} -> "
            f"{history[-1]['sft/loss']:.3f}; checkpoint: {path}"
        )
    del trainer, model, episodes
    models.release_memory()  # the heap kept ~1 GB of SFT's leftovers (the quickstart's peak)
    return path


def check_demonstrations(config: SFTRunConfig) -> None:
    """Raise, before any model loads, if an env offers no demonstration for the first task
    ``sft`` would replay (its ``demonstration(task)`` returns None)."""
    for spec in config.mixture().specs:
        _check_demonstrations(spec.make("train"), spec.env_id, spec.env_kwargs, config.seed)


def _check_demonstrations(env: Any, env_id: str, env_kwargs: dict, seed: int) -> None:
    try:
        env.reset(seed=seed)
        demonstration = getattr(env.unwrapped, "demonstration", None)
        task = getattr(env.unwrapped, "task", None)
        actions = demonstration(task) if demonstration is not None else None
    finally:
        env.close()
    if not actions:
        kwargs = f" {json.dumps(env_kwargs)}" if env_kwargs else ""
        raise InvalidOptionError(
            f"{env_id}{kwargs} offers no demonstrations (its demonstration(task) "
            "returned None), and `agentenv sft` learns from them: give the env a "
            "demonstration(task) method returning the expert's actions, one string per turn "
            "(examples/custom_env.py has one), or choose env kwargs whose tasks have them; "
            "or skip SFT and start `agentenv train` from the base model"
        )
