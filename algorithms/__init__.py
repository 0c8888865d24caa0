"""Learning algorithms that consume tokenized episodes; they never import ``envs``.

- ``config``: :class:`GRPOConfig`, :class:`SFTConfig`, :class:`TrainerConfig` (torch-free).
- ``losses``: advantages, KL estimates, the policy loss of each loss type, masked NLL.
- ``batching``: episodes into token-budgeted micro-batches (GRPO and SFT).
- ``logprobs``: per-token log-probs of a forward pass (chunked LM head, shared prefixes).
- ``rewards``: combining an env's named reward components.
- ``trainer`` (model preparation, AdamW, LR schedule, accelerate), ``grpo``, ``sft``,
  ``lora``, ``checkpoint`` (atomic save, resume).
- ``evolution`` (tournament and mutations, torch-free) and ``population`` (LoRA adapters on
  one base, swapped into one trainer): evolutionary hyper-parameter search.

The names below are loaded on first use, so ``algorithms.config`` (what the command line
needs) does not load torch.
"""

import importlib

_LAZY = {
    "GRPOConfig": "algorithms.config",
    "SFTConfig": "algorithms.config",
    "TrainerConfig": "algorithms.config",
    "EvolutionConfig": "algorithms.config",
    "next_generation": "algorithms.evolution",
    "Population": "algorithms.population",
    "compute_advantages": "algorithms.losses",
    "kl_estimate": "algorithms.losses",
    "masked_nll": "algorithms.losses",
    "policy_loss": "algorithms.losses",
    "EpisodeLike": "algorithms.batching",
    "MicroBatch": "algorithms.batching",
    "pack_micro_batches": "algorithms.batching",
    "pack_prefix_trees": "algorithms.batching",
    "PrefixTree": "algorithms.prefix_tree",
    "forward_logprobs": "algorithms.logprobs",
    "selective_log_softmax": "algorithms.logprobs",
    "token_logprobs": "algorithms.logprobs",
    "apply_lora": "algorithms.lora",
    "Trainer": "algorithms.trainer",
    "GRPO": "algorithms.grpo",
    "SFT": "algorithms.sft",
    "checkpoint_step": "algorithms.checkpoint",
    "latest_checkpoint": "algorithms.checkpoint",
    "load_checkpoint": "algorithms.checkpoint",
    "load_model_weights": "algorithms.checkpoint",
    "save_checkpoint": "algorithms.checkpoint",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'algorithms' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = list(_LAZY)
