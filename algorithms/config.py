"""The algorithms' settings, torch-free: the command line builds its flags from these
without loading torch.

:class:`TrainerConfig` holds what every trainer has (optimisation, LoRA); :class:`GRPOConfig`
and :class:`SFTConfig` extend it. Each validates across its fields on construction, with
messages that name the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentenv.config import option
from agentenv.errors import InvalidOptionError

LR_SCHEDULERS = ("constant", "linear", "cosine")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo")
ADVANTAGE_NORMS = ("mean_std", "mean_only")
ADVANTAGE_BASELINES = ("group_mean", "group_median", "global_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("loss", "reward")
REFERENCES = ("initial", "base")
REFERENCE_ADAPTER = "reference"  # the frozen copy of a warm-started adapter
REWARD_COMBINATIONS = ("weighted", "uniform", "std", "pca", "l2")
CREDITS = ("bandit", "turn", "gae")
TURN_BASELINES = ("group", "loo")  # credit=turn: the baseline of a turn's return
TURN_REWARDS_WHEN = ("always", "terminated")  # whose per-turn rewards count
CRITIC_INPUTS = ("learner", "sampler")  # where credit=gae's critic reads its hidden states
VALUE_LR = 1e-3  # the critic's AdamW LR: a linear head on fixed features learns fast

# What None means for the two settings whose good value depends on the algorithm (declared
# once, in TrainerConfig; each algorithm's config fills in its LR, its trainer the rest).
GRPO_LR = {"lora": 5e-5, "full": 1e-5}
SFT_LR = 2e-4
# micro_batch_tokens=None, by the device the model trains on. A CPU: as fast as any larger
# budget (the matmuls are already big enough to keep 2 cores busy) and a GRPO step stays
# near 3 GB. A GPU: a 768-token pass is launch-bound (H200, SmolLM2: one forward/backward
# per episode, 132 ms of GPU work under 1.5 s of kernel launches); 4096 is the tokens of
# TRL's default micro-batch (8 sequences of 512) and fits large models' logits.
GRPO_MICRO_BATCH_TOKENS = {"cpu": 768, "gpu": 4096}
SFT_MICRO_BATCH_TOKENS = {"cpu": 1024, "gpu": 4096}


def micro_batch_tokens_for(defaults: dict[str, int], device_type: str) -> int:
    """The default of ``micro_batch_tokens`` for a model on ``device_type`` (torch's
    ``device.type``: ``"cpu"``, ``"cuda"``, ...): ``defaults["cpu"]`` on a CPU, else
    ``defaults["gpu"]``."""
    return defaults["cpu" if device_type == "cpu" else "gpu"]


def check_schedule(lr_scheduler: str, warmup_steps: int, total_steps: int | None) -> None:
    """A decaying LR needs the run's length: raise naming the fix if it is missing."""
    if total_steps is not None and total_steps < max(1, warmup_steps):
        raise InvalidOptionError(
            f"total_steps must be >= max(1, warmup_steps={warmup_steps}), got {total_steps}"
        )
    if lr_scheduler != "constant" and total_steps is None:
        raise InvalidOptionError(
            f"lr_scheduler={lr_scheduler!r} decays over the run's steps, got total_steps=None; "
            "pass total_steps=<optimizer steps> to the trainer or use lr_scheduler='constant'"
        )


@dataclass
class TrainerConfig:
    """Optimisation and LoRA settings every trainer has (GRPOConfig and SFTConfig extend it
    and fill in their own ``learning_rate`` where None; ``micro_batch_tokens`` None is
    settled by the trainer, which knows the device: :func:`micro_batch_tokens_for`)."""

    learning_rate: float | None = option(
        None,
        f"Peak AdamW LR. None: the algorithm's (GRPO {GRPO_LR['lora']:g} with LoRA, "
        f"{GRPO_LR['full']:g} full fine-tuning; SFT {SFT_LR:g}): adapters want a larger LR.",
    )
    micro_batch_tokens: int | None = option(
        None,
        "Tokens per forward/backward: GRPO's micro-batch as its prefix tree (a prefix its "
        "episodes share counted once), SFT's sequences x padded length. None: by the "
        f"model's device, on a CPU GRPO {GRPO_MICRO_BATCH_TOKENS['cpu']} / SFT "
        f"{SFT_MICRO_BATCH_TOKENS['cpu']}, on a GPU {GRPO_MICRO_BATCH_TOKENS['gpu']} (raise "
        "it where memory allows).",
    )
    max_grad_norm: float = option(1.0, "Global gradient-norm clip.")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    warmup_steps: int = option(0, "Linear LR warmup, in optimizer steps.")
    lr_scheduler: str = option(
        "constant", "constant | linear | cosine (to 0 at the trainer's total_steps)."
    )
    use_lora: bool = option(True, "Train LoRA adapters (peft); False: full fine-tuning.")
    lora_r: int = option(16, "LoRA rank.")
    lora_alpha: int = option(32, "LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = option(0.0, "Dropout on the LoRA input.")
    lora_target_modules: list[str] = option(LORA_TARGETS, "Module names that get adapters.")
    lora_layers: int | None = option(
        None, "Adapt only the last N layers (None: all); backward then stops there."
    )
    gradient_checkpointing: bool = option(False, "Recompute activations: less memory, slower.")

    def __post_init__(self) -> None:
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise InvalidOptionError(
                f"lr_scheduler must be one of {LR_SCHEDULERS}, got {self.lr_scheduler!r}"
            )
        checks = [
            (self.learning_rate is None or self.learning_rate > 0, "learning_rate", "> 0"),
            (
                self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
                "micro_batch_tokens",
                ">= 1",
            ),
            (self.max_grad_norm > 0, "max_grad_norm", "> 0"),
            (self.weight_decay >= 0, "weight_decay", ">= 0"),
            (self.warmup_steps >= 0, "warmup_steps", ">= 0"),
            (self.lora_r >= 1, "lora_r", ">= 1"),
            (0 <= self.lora_dropout < 1, "lora_dropout", "in [0, 1)"),
            (bool(self.lora_target_modules), "lora_target_modules", "naming >= 1 module"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidOptionError(f"{name} must be {rule}, got {getattr(self, name)!r}")


@dataclass
class GRPOConfig(TrainerConfig):
    """Hyper-parameters of :class:`GRPO` (with :class:`~algorithms.trainer.TrainerConfig`'s
    optimisation and LoRA settings); validated across fields on construction."""

    beta: float = option(0.0, "KL coefficient to the reference; 0: no reference at all.")
    kl_estimator: str = option(
        "k3",
        "k1: log(pi/ref); k2: log(pi/ref)^2 / 2; k3: ref/pi - log(ref/pi) - 1 (unbiased, >= 0; "
        "Schulman's estimators, per policy token).",
    )
    reference: str = option(
        "initial",
        "The KL reference (beta > 0). initial: the policy as training starts; a warm-started "
        "adapter (e.g. --init-from an SFT run) gets a frozen copy of itself as a second "
        "adapter on the same base. base: the adapter-disabled base model, even after a "
        "warm start.",
    )
    kl_placement: str = option(
        "loss",
        "loss: beta * KL per token in the loss (GRPO's); reward: the sequence reward minus "
        "beta * its summed KL before advantages (verl's use_kl_in_reward; one extra "
        "no-grad forward of policy and reference per step).",
    )
    epsilon_low: float = option(0.2, "Ratio clip below, 1 - epsilon_low (gspo: 3e-4).")
    epsilon_high: float = option(
        0.2, "Ratio clip above, 1 + epsilon_high. DAPO clip-higher: 0.28; gspo: 4e-4."
    )
    loss_type: str = option(
        "dapo",
        "grpo | dr_grpo | dapo | gspo | cispo. dapo (TRL's default) normalises per token: every "
        "policy token weighs the same, so long multi-turn episodes are not down-weighted. "
        "cispo (MiniMax-M1): REINFORCE on every token weighted by its importance ratio "
        "clipped to [1 - epsilon_low, 1 + epsilon_high] with no gradient through the weight "
        "(no token is dropped; normalised per token like dapo).",
    )
    advantage_norm: str = option(
        "mean_std",
        "mean_std: (r - baseline) / (std + eps); mean_only: r - baseline (Dr. GRPO's). The std "
        "is the group's, or the batch's with advantage_baseline=global_mean.",
    )
    advantage_baseline: str = option(
        "group_mean",
        "group_mean (GRPO) | group_median (robust to an outlier reward) | global_mean (the "
        "whole batch's mean and std, over processes: all-correct groups still get a signal).",
    )
    reward_clip: float | None = option(
        None, "Clip rewards to [-reward_clip, reward_clip] before advantages; None: no clip."
    )
    reward_combination: str = option(
        "weighted",
        "How an env's named reward components (info['reward_components'], e.g. RAG's answer "
        "/ retrieval / format) become the reward: weighted (the env's own weighted sum) | "
        "uniform (their mean) | std (each divided by its batch std, summed) | pca (projection "
        "on the batch's first principal component, sign-aligned with the sum) | l2 (norm).",
    )
    credit: str = option(
        "bandit",
        "How an episode's tokens share credit. bandit: every policy token gets the episode's "
        "advantage (one reward per episode; with turn_weight > 0 the reward adds turn_weight "
        "x the episode's per-turn rewards: shaping without turn credit). turn: a turn's "
        "tokens also get turn_weight x its return of the env's per-turn rewards "
        "(info['turn_reward'], from that turn on, discounted by turn_gamma), less a baseline "
        "(turn_baseline). "
        "gae: a critic (a value head on the policy's last hidden state) predicts the return "
        "before each turn; a turn's tokens get its GAE(turn_gamma, gae_lambda) advantage over "
        "turns, the rewards being turn_weight x the per-turn rewards plus the outcome at "
        "the last turn (one extra no-grad forward per step).",
    )
    turn_weight: float | None = option(
        None,
        "The weight of the env's per-turn rewards (info['turn_reward']) against the outcome. "
        "bandit: the episode's reward adds turn_weight x their return from the first turn; "
        "turn: of their return's advantage; gae: of each turn's reward. None: 1 under turn "
        "and gae, 0 under bandit (the outcome alone). gae with 0: the critic without "
        "shaping.",
    )
    turn_rewards_when: str = option(
        "always",
        "Which episodes' per-turn rewards count (under every credit that reads them). "
        "always: every episode's. terminated: only those the env ended itself (an answer; "
        "Episode.stop_reason 'terminated'), not those cut at max_turns or the token limit: "
        "gathering facts without ever answering then earns nothing, so the shaping cannot "
        "teach the policy to stop answering.",
    )
    turn_baseline: str = option(
        "group",
        "credit=turn: what a turn's return is compared with. group: the mean of every turn "
        "of the group's episodes, the difference divided by their std (mean_std). loo: the "
        "mean of the other episodes' turns (RLOO's leave-one-out: an episode is never its "
        "own baseline), not divided, so a group of two differing by 0.5 gets +-0.5, not "
        "+-1.",
    )
    turn_gamma: float = option(
        1.0, "credit=turn|gae: the discount of later turns' rewards in a turn's return (0-1)."
    )
    gae_lambda: float = option(
        0.95,
        "credit=gae: GAE's lambda over turns (1: the return less the critic's value, "
        "unbiased; 0: one-turn TD error, lowest variance).",
    )
    value_lr: float = option(
        VALUE_LR, "credit=gae: the critic's AdamW LR (its own optimizer; see value_epochs)."
    )
    value_epochs: int = option(
        4,
        "credit=gae: the critic's full-batch optimizer steps on each batch's turns (its "
        "input, the policy's hidden states, is computed once per step).",
    )
    critic_input: str = option(
        "learner",
        "credit=gae: where the critic's input, the policy's hidden state before each turn, "
        "comes from. learner: one no-grad forward of the batch under the pre-update weights. "
        "sampler: the states the sampler recorded when it drew each turn's first token "
        "(Episode.turn_hidden; recorded only under this setting): no forward, the same "
        "weights through the sampler's kernels, so the values differ by rounding and the "
        "run's numbers with them; engines that record none (vllm, server) are refused.",
    )
    entropy_coef: float = option(
        0.0,
        "Entropy bonus: the loss minus entropy_coef x the policy tokens' entropy, aggregated "
        "like the loss (computed from the same logits chunks; no second forward).",
    )
    num_iterations: int = option(1, "Optimizer steps per batch (mu); > 1 reuses it, clipped.")
    max_completion_length: int | None = option(
        None, "dr_grpo's per-sequence denominator; None: the batch's max policy tokens."
    )
    dynamic_sampling: bool = option(
        False,
        "Re-draw groups without a learning signal (DAPO's dynamic sampling, verl's "
        "filter_groups): a step whose groups' rewards do not differ (GRPO.group_signal: the "
        "outcome, with turn credit also the per-turn returns) draws more tasks of the split "
        "until batch_size groups have a signal or max_extra_tasks are spent; the step "
        "then trains on the groups with a signal it found.",
    )
    max_extra_tasks: float = option(
        2.0,
        "dynamic_sampling: the most extra tasks a step draws, as a multiple of batch_size "
        "(2: up to twice the step's tasks again, each a group of group_size episodes).",
    )

    @property
    def turn_reward_weight(self) -> float:
        """``turn_weight``, with None resolved: 1 under ``turn`` and ``gae``, 0 under
        ``bandit``."""
        if self.turn_weight is not None:
            return self.turn_weight
        return 0.0 if self.credit == "bandit" else 1.0

    def __post_init__(self) -> None:
        if self.learning_rate is None:
            self.learning_rate = GRPO_LR["lora" if self.use_lora else "full"]
        super().__post_init__()
        choices = {
            "loss_type": LOSS_TYPES,
            "advantage_norm": ADVANTAGE_NORMS,
            "advantage_baseline": ADVANTAGE_BASELINES,
            "kl_estimator": KL_ESTIMATORS,
            "kl_placement": KL_PLACEMENTS,
            "reference": REFERENCES,
            "reward_combination": REWARD_COMBINATIONS,
            "credit": CREDITS,
            "critic_input": CRITIC_INPUTS,
            "turn_baseline": TURN_BASELINES,
            "turn_rewards_when": TURN_REWARDS_WHEN,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InvalidOptionError(
                    f"{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        checks = [
            (self.beta >= 0, "beta", "must be >= 0 (0 disables the KL term)"),
            (0 <= self.epsilon_low < 1, "epsilon_low", "must be in [0, 1)"),
            (self.epsilon_high >= 0, "epsilon_high", "must be >= 0"),
            (self.num_iterations >= 1, "num_iterations", "must be >= 1"),
            (self.entropy_coef >= 0, "entropy_coef", "must be >= 0 (0 disables the bonus)"),
            (
                self.turn_weight is None or self.turn_weight >= 0,
                "turn_weight",
                "must be None or >= 0",
            ),
            (0 <= self.turn_gamma <= 1, "turn_gamma", "must be in [0, 1]"),
            (0 <= self.gae_lambda <= 1, "gae_lambda", "must be in [0, 1]"),
            (self.value_lr > 0, "value_lr", "must be > 0"),
            (self.value_epochs >= 1, "value_epochs", "must be >= 1"),
            (self.max_extra_tasks >= 0, "max_extra_tasks", "must be >= 0"),
            (
                self.reward_clip is None or self.reward_clip > 0,
                "reward_clip",
                "must be None or > 0",
            ),
            (
                self.max_completion_length is None or self.max_completion_length >= 1,
                "max_completion_length",
                "must be None or >= 1",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidOptionError(f"{name} {rule}, got {getattr(self, name)!r}")


@dataclass
class SFTConfig(TrainerConfig):
    """Hyper-parameters of :class:`SFT` (with :class:`~algorithms.trainer.TrainerConfig`'s
    optimisation and LoRA settings)."""

    epochs: int = option(2, "Passes over the episodes in :meth:`SFT.fit`.")
    batch_size: int = option(16, "Episodes per optimizer step.")
    total_steps: int | None = option(None, "Optimizer steps, for linear/cosine decay.")

    def __post_init__(self) -> None:
        if self.learning_rate is None:
            self.learning_rate = SFT_LR
        super().__post_init__()
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        check_schedule(self.lr_scheduler, self.warmup_steps, self.total_steps)


# The hyper-parameters a population member may have of its own, and where the run's value
# (every member's start, unless member_start says otherwise) is owned.
HYPERPARAMETERS = {
    "learning_rate": "grpo.learning_rate",
    "beta": "grpo.beta",
    "entropy_coef": "grpo.entropy_coef",
    "temperature": "rollout.sampling.temperature",
}
MUTATION_BOUNDS = {
    "learning_rate": [1e-7, 1e-2],
    "beta": [0.0, 1.0],
    "entropy_coef": [0.0, 0.1],
    "temperature": [0.1, 2.0],
}


@dataclass
class EvolutionConfig:
    """Evolutionary hyper-parameter search (AgileRL's tournament with elitism, and its
    multiplicative mutations) over a population of LoRA adapters on one base model:
    see :mod:`algorithms.evolution` and :mod:`algorithms.population`."""

    population: int = option(
        1,
        "Members trained side by side: each a LoRA adapter (with its own AdamW state, LR "
        "schedule and hyper-parameters) on one shared base model in one process. 1: a "
        "plain run.",
    )
    evolve_every: int = option(
        5,
        "Steps between evolutions: every member's fitness is measured, a tournament picks "
        "the parents and the losers become copies of winners, mutated with mutation_prob, "
        "each drawing its own episodes (0: never; the members train independently).",
    )
    validation_tasks: int = option(
        64,
        "Fitness: a member's mean reward on the validation slice of the train split: N "
        "tasks chosen by a stable hash of their index, never drawn for training while "
        "population > 1; one episode each, sampled at the run's temperature from a fixed "
        "seed (the same draws for every member).",
    )
    tournament_size: int = option(
        2, "Members drawn (without replacement) for each tournament; the fittest wins."
    )
    elitism: bool = option(
        True, "The fittest member survives every evolution as it is (never mutated)."
    )
    mutation_prob: float = option(
        0.5,
        "Chance that a new member (any but the elite) has one hyper-parameter, drawn from "
        "`mutate`, multiplied by a factor drawn from `mutation_factors`.",
    )
    mutate: list[str] = option(
        list(HYPERPARAMETERS),
        f"Hyper-parameters that may mutate, of {list(HYPERPARAMETERS)}. One at 0 stays 0 "
        "(mutations multiply): beta and entropy_coef mutate only where they start above 0.",
    )
    mutation_factors: list[float] = option(
        [0.5, 2.0],
        "A mutation multiplies the value by one of these, then clips it to mutation_bounds "
        "(AgileRL uses 0.8 and 1.2; a short run has few evolutions, hence larger steps).",
    )
    mutation_bounds: dict[str, list[float]] = option(
        MUTATION_BOUNDS, "[low, high] of each hyper-parameter a mutation may reach."
    )
    member_start: dict[str, list[float]] = option(
        {},
        "Each member's starting value of a hyper-parameter, one per member, e.g. "
        '{"learning_rate": [5e-6, 5e-6, 5e-4, 5e-5]}; the others start from the run\'s own '
        "(grpo.learning_rate, grpo.beta, grpo.entropy_coef, rollout.sampling.temperature).",
    )

    def __post_init__(self) -> None:
        checks = [
            (self.population >= 1, "population", "must be >= 1 (1: a plain run)"),
            (self.evolve_every >= 0, "evolve_every", "must be >= 0 (0: never evolve)"),
            (self.validation_tasks >= 1, "validation_tasks", "must be >= 1"),
            (self.tournament_size >= 1, "tournament_size", "must be >= 1"),
            (0 <= self.mutation_prob <= 1, "mutation_prob", "must be in [0, 1]"),
            (
                bool(self.mutation_factors) and all(f > 0 for f in self.mutation_factors),
                "mutation_factors",
                "must be one or more factors > 0",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidOptionError(f"{name} {rule}, got {getattr(self, name)!r}")
        for field, names in (
            ("mutate", self.mutate),
            ("mutation_bounds", list(self.mutation_bounds)),
            ("member_start", list(self.member_start)),
        ):
            unknown = [n for n in names if n not in HYPERPARAMETERS]
            if unknown:
                raise InvalidOptionError(
                    f"{field} names {unknown}, which are not hyper-parameters a member has of "
                    f"its own; use {list(HYPERPARAMETERS)}"
                )
        for name, bounds in self.mutation_bounds.items():
            if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1]:
                raise InvalidOptionError(
                    f"mutation_bounds[{name!r}] must be [low, high] with 0 <= low <= high, "
                    f"got {bounds!r}"
                )
        for name, values in self.member_start.items():
            if len(values) != self.population:
                raise InvalidOptionError(
                    f"member_start[{name!r}] has {len(values)} values for a population of "
                    f"{self.population}; give one per member"
                )
            if any(v < 0 for v in values) or (
                name in ("learning_rate", "temperature") and any(v <= 0 for v in values)
            ):
                raise InvalidOptionError(
                    f"member_start[{name!r}] must hold values > 0 (>= 0 for beta and "
                    f"entropy_coef), got {values!r}"
                )
