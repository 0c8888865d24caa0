"""The commands' settings, torch-free: ``agentenv train|sft|eval`` build their flags from
these without loading torch, and reject bad values before any model loads.

Each run config is one tree of dataclasses: :class:`TrainConfig` holds ``rollout`` (which
holds ``sampling``) and ``grpo``; :class:`SFTRunConfig` holds ``sft``; :class:`EvalRunConfig`
holds ``eval``. Each value is a field of exactly one of them (docs/design.md §5).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agentenv import config as config_lib
from agentenv.config import option
from agentenv.env.mixture import EnvSpec, Mixture
from agentenv.errors import InvalidOptionError
from agentenv.lm.backend import EngineConfig, SamplingConfig
from agentenv.lm.models import DEFAULT_MODEL
from agentenv.lm.precision import check_dtype
from agentenv.lm.quantize import check_quantize
from agentenv.rollout.config import RolloutConfig
from agentenv.run.profiles import profile_settings
from algorithms.config import EvolutionConfig, GRPOConfig, SFTConfig

T = TypeVar("T")


@dataclasses.dataclass
class CommandConfig:
    """The env, the model, its device and dtype: what every command's run config has
    (``TrainConfig``, ``SFTRunConfig`` and ``EvalRunConfig`` extend it). Subclasses'
    ``__post_init__`` call this one: it turns sections given as dicts into their dataclass
    and rejects a bad dtype before any model loads."""

    env_id: str = option("Calculator-v0", "Registered environment id (or module:Name-v0).")
    env_kwargs: dict[str, Any] = option({}, "Constructor arguments of the env (both splits).")
    envs: list[EnvSpec] = option(
        [],
        "Several envs in one run (a mixture, in place of env_id and env_kwargs): items "
        "{env_id, env_kwargs, name, weight, schedule, max_turns} (agentenv.env.mixture); "
        "on the command line JSON objects or NAME=ENV_ID@WEIGHT.",
    )
    model: str = option(DEFAULT_MODEL, "Model alias, Hugging Face id or local path.")
    device: str | None = option(None, "cpu or cuda (default: cuda if available, else cpu).")
    dtype: str = option(
        "auto",
        "Compute dtype of sampling and training: auto (bfloat16 on GPUs and CPUs where it "
        "is faster: native bf16, on Intel AMX too; else float32; never float16), float32, "
        "bfloat16, float16 (GPU only; "
        "trains with dynamic loss scaling). Trained weights stay float32; a LoRA run keeps its "
        "frozen base in this dtype.",
    )
    quantize: str | None = option(
        None,
        "nf4: load the frozen base's linear layers in 4 bits through bitsandbytes (QLoRA: "
        "LoRA trains on top; CPU or GPU; decodes with the reference path). None: in dtype.",
    )

    def __post_init__(self) -> None:
        config_lib.coerce_sections(self)
        check_dtype(self.dtype, self.device)
        check_quantize(self.quantize, self._trains_adapters())
        self.envs = [EnvSpec.coerce(item, type(self).__name__) for item in self.envs]
        if self.envs and (self.env_id != CommandConfig.env_id or self.env_kwargs):
            raise InvalidOptionError(
                f"envs (a mixture of {len(self.envs)}) and env_id {self.env_id!r} / env_kwargs "
                "given together: put every env in envs, or give env_id alone"
            )
        self.mixture()  # two envs of one name fail here

    def mixture(self) -> Mixture:
        """The run's envs: ``envs``, or the one ``env_id`` with ``env_kwargs``."""
        return Mixture(self.envs or [EnvSpec(self.env_id, dict(self.env_kwargs))])

    def _trains_adapters(self) -> bool:
        """Whether this command trains LoRA adapters (a 4-bit base needs them)."""
        return True


def resolve(
    cls: type[T],
    file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
) -> T:
    """``cls`` from its defaults, then ``base`` (e.g. a profile), then ``file`` (if any),
    then ``overrides``, deep-merged.

    The defaults are those of ``cls()``, so a section keeps the defaults its owner gives
    it (a training run's rollout, say) where the file sets only some of its keys.
    """
    data = config_lib.merge(config_lib.to_dict(cls()), base or {})
    data = config_lib.merge(data, config_lib.load_file(file)) if file else data
    where = str(file) if file else "the command line"
    return config_lib.from_dict(cls, config_lib.merge(data, overrides or {}), where)


def _training_rollout() -> RolloutConfig:
    return RolloutConfig(
        max_turns=3,
        max_episode_tokens=1024,
        sampling=SamplingConfig(max_new_tokens=64),
        show_progress=False,
    )


@dataclass
class PoolConfig:
    """Task difficulty pools (:mod:`agentenv.run.pools`): which train tasks a step draws."""

    difficulty_pools: bool = option(
        False,
        "Track each train task's groups and solved episodes, and retire a task whose last "
        "retire_after groups were all solved or all unsolved (no learning signal); steps "
        "draw from the other tasks. Saved in checkpoints.",
    )
    retire_after: int = option(2, "difficulty_pools: groups in a row that retire a task.")
    readmit: float = option(
        0.1,
        "difficulty_pools: share of a step's tasks drawn from the retired ones (a mixed "
        "group makes a task active again).",
    )

    def __post_init__(self) -> None:
        if self.retire_after < 1:
            raise InvalidOptionError(f"retire_after must be >= 1, got {self.retire_after}")
        if not 0 <= self.readmit <= 1:
            raise InvalidOptionError(f"readmit must be in [0, 1], got {self.readmit}")


@dataclass
class TrainConfig(CommandConfig):
    """Everything a training run needs; ``config.json`` in the run directory is this.

    Sections own their values: ``rollout`` (G, turns, token budget and its ``sampling``:
    temperature, top-p/k, tokens per turn) is read by the sampler *and* the trainer, and
    ``grpo`` holds the algorithm's hyper-parameters. A section may be given as a dict of
    its fields (``grpo={"beta": 0.04}``); unknown keys are errors.
    """

    init_from: str | None = option(
        None, "Checkpoint folder (e.g. from `agentenv sft`) to start from."
    )
    profile: str | None = option(
        None,
        "conservative | balanced | aggressive | multi-step: a bundle of settings (LR, clip, "
        "KL, entropy; multi-step: credit, batch and group size; see agentenv.run.profiles) "
        "under --config and flags, which still win.",
    )
    steps: int = option(20, "GRPO steps (one batch of B x G episodes each).")
    batch_size: int = option(4, "Tasks per step (B).")
    eval_every: int = option(0, "Evaluate every N steps (0: only before and after training).")
    eval_tasks: int = option(50, "Test-split tasks per evaluation (0: no evaluation).")
    save_every: int = option(10, "Checkpoint every N steps (and always at the end).")
    keep_checkpoints: int = option(2, "Most recent checkpoints kept.")
    log_episodes: int = option(8, "Episodes written to episodes/step_N.jsonl per step.")
    output_dir: str | None = option(None, "Run directory (default runs/<env>-<time>).")
    seed: int = option(0, "Seed of task sampling, generation and LoRA init.")
    tensorboard: bool = option(True, "Write TensorBoard events.")
    wandb_project: str | None = option(None, "Log to this W&B project (needs `pip install wandb`).")
    max_failed_fraction: float = option(
        0.5,
        "Failure budget: a step whose failed episodes (env raised, or past "
        "rollout.episode_timeout_s) exceed this fraction stops the run before learning "
        "(1: never stop). Failed episodes below it carry no learning signal.",
    )
    rollout: RolloutConfig = option(
        _training_rollout(), "How episodes are collected and sampled (section)."
    )
    grpo: GRPOConfig = option(GRPOConfig(), "GRPO hyper-parameters (section).")
    generation: EngineConfig = option(
        EngineConfig(), "Which engine samples the episodes (section)."
    )
    evolution: EvolutionConfig = option(
        EvolutionConfig(),
        "Evolutionary hyper-parameter search over a population of adapters (section; "
        "population 1: off).",
    )
    pools: PoolConfig = option(
        PoolConfig(), "Task difficulty pools: retire tasks always or never solved (section)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "batch_size", "save_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0 or self.eval_tasks < 0 or self.log_episodes < 0:
            raise InvalidOptionError("eval_every, eval_tasks and log_episodes must be >= 0")
        if not 0 <= self.max_failed_fraction <= 1:
            raise InvalidOptionError(
                f"max_failed_fraction must be in [0, 1] (1: never stop), got "
                f"{self.max_failed_fraction}"
            )
        profile_settings(self.profile)  # an unknown name fails here, naming the profiles
        self.mixture().check(self.steps)
        if self.pools.difficulty_pools and self.evolution.population > 1:
            raise InvalidOptionError(
                "difficulty_pools with population > 1: the members would share one pool of "
                "tasks that each of them solves differently; use one of the two"
            )
        if self.rollout.group_size < 2:
            raise InvalidOptionError(
                f"group_size must be >= 2 for group-relative advantages, got "
                f"{self.rollout.group_size}"
            )
        if self.rollout.sampling.temperature <= 0:
            raise InvalidOptionError(
                f"temperature must be > 0 for training (GRPO learns from sampled episodes), "
                f"got {self.rollout.sampling.temperature}"
            )
        if self.quantize and self.generation.engine in ("vllm", "server"):
            raise InvalidOptionError(
                f"quantize={self.quantize!r} with engine {self.generation.engine}: that engine "
                "samples from its own copy of the base, not the 4-bit one trained on; use "
                "engine agentenv (it decodes a 4-bit model with the reference path)"
            )
        if (
            self.grpo.credit == "gae"
            and self.grpo.critic_input == "sampler"
            and self.generation.engine in ("vllm", "server")
        ):
            raise InvalidOptionError(
                f"critic_input='sampler' with engine {self.generation.engine}: that engine "
                "returns no hidden states for the critic; use engine agentenv (or reference), "
                "or critic_input learner (the learner's own forward)"
            )

    def _trains_adapters(self) -> bool:
        return self.grpo.use_lora

    @classmethod
    def resolve(
        cls, file: str | Path | None = None, overrides: dict[str, Any] | None = None
    ) -> TrainConfig:
        """Defaults, then the ``profile`` (named in ``overrides`` or ``file``), then ``file``
        (YAML/JSON, nested like ``config.json``), then ``overrides`` (a nested dict, e.g.
        from flags), deep-merged; strict keys."""
        overrides = overrides or {}
        named = overrides.get(
            "profile", config_lib.load_file(file).get("profile") if file else None
        )
        return resolve(cls, file, overrides, base=profile_settings(named))


@dataclass
class SFTRunConfig(CommandConfig):
    """Settings of an ``agentenv sft`` run; ``sft`` is the trainer's section (a dict of its
    fields works too, e.g. ``sft={"epochs": 3}``)."""

    num_demos: int = option(256, "Train-split tasks demonstrated.")
    output_dir: str | None = option(None, "Run directory (default runs/sft-<env>-<time>).")
    seed: int = option(0, "Seed of task choice, LoRA init and episode shuffling.")
    max_episode_tokens: int = option(1024, "Token cap per demonstration.")
    sft: SFTConfig = option(SFTConfig(), "SFT hyper-parameters (section).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_demos < 1:
            raise InvalidOptionError(f"num_demos must be >= 1, got {self.num_demos}")
        self.mixture().check(1)  # the demonstrations split by the weights at step 0

    def _trains_adapters(self) -> bool:
        return self.sft.use_lora


@dataclass
class EvalConfig:
    """What to evaluate."""

    split: str = option("test", "Split to evaluate: test or train.")
    num_tasks: int | None = option(200, "The split's first N tasks (none: all of them).")
    samples: int = option(1, "Episodes per task (K); pass@k is reported for k = 1, 2, 4 .. K.")
    temperature: float = option(0.0, "Sampling temperature; 0 = greedy (the default for K=1).")
    max_turns: int = option(3, "Policy turns per episode (the training rollout's default).")
    max_new_tokens: int = option(96, "Tokens per policy turn.")
    max_episode_tokens: int = option(2048, "Token budget per episode.")
    tasks_per_batch: int = option(16, "Tasks whose episodes are generated together.")
    seed: int = option(0, "Base reset seed (task i uses seed + i).")

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise InvalidOptionError(f"samples must be >= 1, got {self.samples}")
        if self.num_tasks is not None and self.num_tasks < 1:
            raise InvalidOptionError(f"num_tasks must be >= 1 or None, got {self.num_tasks}")
        if self.split not in ("train", "test"):
            raise InvalidOptionError(f"split must be 'train' or 'test', got {self.split!r}")
        if self.samples > 1 and self.temperature == 0:
            raise InvalidOptionError(
                "samples > 1 with temperature 0 gives K identical greedy episodes; "
                "set temperature > 0 (e.g. 1.0)"
            )


@dataclass
class EvalRunConfig(CommandConfig):
    """Settings of an ``agentenv eval`` run; ``eval`` is the evaluation's section."""

    adapter: str | None = option(
        None,
        "Checkpoint folder to apply (adapter/ or model/). The env, env kwargs, max_turns, "
        "max_new_tokens, max_episode_tokens and quantize its run trained with apply unless "
        "given.",
    )
    label: str | None = option(None, "Name of the model in the report (default: model+adapter).")
    judge: str | None = option(
        None,
        "Also grade final answers with an LLM judge (metric judge_score, 0..1): 'local' (the "
        "bundled SmolLM2: offline, weak) or an OpenAI-compatible base URL "
        "(http://HOST:PORT/v1; --judge-model names its model).",
    )
    judge_model: str | None = option(None, "The model name an OpenAI-compatible judge expects.")
    output: str | None = option(None, "Write the report as JSON to this path.")
    eval: EvalConfig = option(EvalConfig(), "What to evaluate (section).")
    generation: EngineConfig = option(
        EngineConfig(), "Which engine samples the episodes (section)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.judge is not None and self.judge != "local":
            if not self.judge.startswith(("http://", "https://")) or not self.judge_model:
                raise InvalidOptionError(
                    f"judge must be 'local' or an http(s) base URL with judge_model set, got "
                    f"judge={self.judge!r}, judge_model={self.judge_model!r}"
                )

    def make_judge(self) -> Any:
        """The :class:`~agentenv.run.judge.LLMJudge` this run asked for, or ``None``."""
        from agentenv.run.judge import LLMJudge, OpenAIJudge, TransformersJudge

        if self.judge is None:
            return None
        if self.judge == "local":
            return LLMJudge(TransformersJudge.default())
        assert self.judge_model is not None
        return LLMJudge(OpenAIJudge(self.judge, self.judge_model))
