"""``agentenv sft``: a supervised warm start from the env's expert demonstrations.

data (env.demonstration) -> episodes (same tokens/masks as RL) -> masked-NLL SFT
-> checkpoint that `agentenv train --init-from` and `agentenv eval --adapter` accept
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from agentenv import config as config_lib
from agentenv.env.registration import env_name
from agentenv.lm.precision import resolve_dtype
from agentenv.run.config import SFTRunConfig


def sft(config: SFTRunConfig) -> Path:
    """Fine-tune on demonstrations; return the checkpoint folder (``RUN/checkpoint``)."""
    import torch

    from agentenv.env.registration import make
    from agentenv.lm import models
    from agentenv.lm.precision import training_dtype
    from agentenv.rollout.demos import demonstration_episodes
    from agentenv.rollout.episode import ChatFormat
    from agentenv.run.train import processes
    from algorithms.sft import SFT

    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.output_dir or f"runs/sft-{env_name(config.env_id)}-{stamp}")
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
    episodes = demonstration_episodes(
        lambda: make(config.env_id, split="train", **config.env_kwargs),
        fmt,
        config.num_demos,
        seed=config.seed,
        max_episode_tokens=config.max_episode_tokens,
    )
    trainer = SFT(model, tokenizer, sft_config, seed=config.seed, dtype=compute)
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
