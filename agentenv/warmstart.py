"""``agentenv sft``: a supervised warm start from the env's expert demonstrations.

data (env.demonstration) -> episodes (same tokens/masks as RL) -> masked-NLL SFT
-> checkpoint that `agentenv train --init-from` and `agentenv eval --adapter` accept
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.errors import InvalidOptionError


@dataclass
class SFTRunConfig:
    """Settings of an ``agentenv sft`` run."""

    env_id: str = field(default="Calculator-v0", metadata={"help": "Registered env id."})
    env_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Env constructor arguments."}
    )
    model: str = field(default="smollm2-135m-instruct", metadata={"help": "Base model."})
    num_demos: int = field(default=256, metadata={"help": "Train tasks demonstrated."})
    output_dir: str | None = field(default=None, metadata={"help": "Run directory."})
    device: str | None = field(default=None, metadata={"help": "cpu or cuda."})
    dtype: str = field(
        default="auto",
        metadata={"help": "Compute dtype (auto: bf16 where supported); see TrainConfig.dtype."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of task choice and training."})
    max_episode_tokens: int = field(default=1024, metadata={"help": "Token cap per demo."})
    sft: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "SFTConfig overrides, e.g. {'epochs': 3}."}
    )

    def __post_init__(self) -> None:
        if self.num_demos < 1:
            raise InvalidOptionError(f"num_demos must be >= 1, got {self.num_demos}")


def sft(config: SFTRunConfig) -> Path:
    """Fine-tune on demonstrations; return the checkpoint folder (``RUN/checkpoint``)."""
    import torch

    from agentenv import models
    from agentenv.demos import demonstration_episodes
    from agentenv.episode import ChatFormat
    from agentenv.generation import resolve_dtype
    from agentenv.registration import make
    from agentenv.train import training_dtype
    from algorithms.sft import SFT, SFTConfig

    run_dir = Path(
        config.output_dir
        or f"runs/sft-{config.env_id.split('/')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    torch.manual_seed(config.seed)
    device = config.device or models.default_device()
    compute = resolve_dtype(config.dtype, device)
    sft_config = SFTConfig(**{"seed": config.seed, **config.sft})
    model, tokenizer = models.load(
        config.model, dtype=training_dtype(compute, sft_config.use_lora), device=device
    )
    fmt = ChatFormat(tokenizer)
    episodes = demonstration_episodes(
        lambda: make(config.env_id, split="train", **config.env_kwargs),
        fmt,
        config.num_demos,
        seed=config.seed,
        max_episode_tokens=config.max_episode_tokens,
    )
    trainer = SFT(model, tokenizer, sft_config, dtype=compute)
    history = trainer.fit(episodes)
    with (run_dir / "metrics.jsonl").open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in history)
    path = trainer.save(run_dir / "checkpoint")
    print(
        f"SFT on {len(episodes)} demonstrations: loss {history[0]['sft/loss']:.3f} -> "
        f"{history[-1]['sft/loss']:.3f}; checkpoint: {path}"
    )
    del trainer, model, episodes
    models.release_memory()  # the heap kept ~1 GB of SFT's leftovers (the quickstart's peak)
    return path
