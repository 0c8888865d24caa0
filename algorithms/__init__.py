"""Learning algorithms that consume tokenized episodes; they never import ``envs``."""

from algorithms.checkpoint import (
    checkpoint_step,
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from algorithms.grpo import (
    GRPO,
    EpisodeLike,
    GRPOConfig,
    MicroBatch,
    compute_advantages,
    pack_micro_batches,
    policy_loss,
)
from algorithms.logprobs import forward_logprobs, selective_log_softmax, token_logprobs
from algorithms.lora import apply_lora
from algorithms.sft import SFT, SFTConfig, masked_nll
from algorithms.trainer import Trainer, TrainerConfig

__all__ = [
    "Trainer",
    "TrainerConfig",
    "GRPO",
    "SFT",
    "SFTConfig",
    "apply_lora",
    "checkpoint_step",
    "load_model_weights",
    "masked_nll",
    "EpisodeLike",
    "forward_logprobs",
    "GRPOConfig",
    "MicroBatch",
    "compute_advantages",
    "latest_checkpoint",
    "load_checkpoint",
    "pack_micro_batches",
    "policy_loss",
    "save_checkpoint",
    "selective_log_softmax",
    "token_logprobs",
]
