"""TRL's side of ``grpo_step.py``: ``GRPOTrainer.train()`` on the same tasks and settings.

``grpo_step.py`` runs :func:`run_trl` in its own subprocess (``--worker trl``). The phases
are timed by a ``GRPOTrainer`` subclass that wraps TRL's private ``_generate_single_turn``,
``_tool_call_loop``, ``_calculate_rewards`` and ``_generate_and_score_completions``, and
each optimizer step by a ``TrainerCallback``; it returns the same figures as agentenv's side.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

from _common import peak_memory, peak_rss_mb
from _grpo_step_settings import (
    TOOL_SLACK,
    all_task_ids,
    compute_dtype,
    lora_settings,
    make_env,
    token_hash,
)


def _timed_trainer_class() -> type:
    """GRPOTrainer that adds up time spent generating, in the tool loop and in rewards."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.clock: dict[str, float] = defaultdict(float)

        def _generate_single_turn(self, prompt_ids: list, *a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **kw)
            self.clock["generate_s"] += time.perf_counter() - start
            self.clock["tokens"] += sum(len(x) for x in ids)
            self.clock["sequences"] += len(ids)
            return ids, logprobs

        def _tool_call_loop(self, *a: Any, **kw: Any) -> Any:
            start, gen = time.perf_counter(), self.clock["generate_s"]
            out = super()._tool_call_loop(*a, **kw)  # its generation is counted above
            gen_inside = self.clock["generate_s"] - gen
            self.clock["env_s"] += time.perf_counter() - start - gen_inside
            return out

        def _calculate_rewards(self, *a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            out = super()._calculate_rewards(*a, **kw)
            self.clock["env_s"] += time.perf_counter() - start
            return out

        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            self.clock["collect_s"] += time.perf_counter() - start
            return out

    return TimedGRPOTrainer


def _step_timer(episodes_per_step: int) -> Any:
    """A TrainerCallback that records each optimizer step's time and phase split."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None  # set once the trainer exists
            self.steps: list[dict[str, float]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._start, self._clock = time.perf_counter(), dict(self.trainer.clock)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            total = time.perf_counter() - self._start
            d = {k: v - self._clock.get(k, 0.0) for k, v in self.trainer.clock.items()}
            self.steps.append(
                {
                    "total_s": total,
                    "generate_s": d.get("generate_s", 0.0),
                    "env_s": d.get("env_s", 0.0),
                    "learn_s": total - d.get("collect_s", 0.0),
                    "tokens": d.get("tokens", 0.0),
                    "turns": d.get("sequences", 0.0) / episodes_per_step,
                }
            )

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if self.steps and logs and "reward" in logs:
                self.steps[-1]["reward"] = logs["reward"]
                self.steps[-1]["frac_reward_zero_std"] = logs.get("frac_reward_zero_std", 0.0)

    return StepTimer()


def _tool_tokenizer(tokenizer: Any) -> tuple[Any, str]:
    """The tokenizer with a tool-capable template (agentenv.integrations.trl), and its name."""
    from agentenv.integrations.trl import tool_chat_template

    own = tokenizer.chat_template
    tokenizer = tool_chat_template(tokenizer)
    return (
        tokenizer,
        "the model's own" if tokenizer.chat_template == own else "trl/chat_templates/qwen2_5.jinja",
    )


def _trl_prompt(env: Any, task_id: int, prompt_style: str) -> list[dict[str, str]]:
    """The env's opening messages; with ``full``, TRL's template lists the tool itself."""
    system, user = env.reset(options={"task_id": task_id})[0]
    if prompt_style == "full":  # keep the instructions, drop agentenv's own tool section
        system = {"role": "system", "content": env.unwrapped.instructions()}
    return [system, user]


def _reward_fn(env: Any, reward_noise: float) -> Any:
    """TRL reward: the Calculator env's own parser and ``score`` on the first answer given."""
    inner = env.unwrapped

    def calculator_reward(
        completions: list, completion_ids: list, task_id: list, **kw: Any
    ) -> list[float]:
        rewards = []
        for messages, ids, tid in zip(completions, completion_ids, task_id, strict=True):
            answers = [
                inner.parser.parse(m.get("content") or "").answer
                for m in messages
                if m["role"] == "assistant"
            ]
            answer = next((a for a in answers if a is not None), None)
            score = inner.score(answer, inner.get_task(tid))[0] if answer is not None else 0.0
            rewards.append(score + reward_noise * token_hash(ids))
        return rewards

    return calculator_reward


def _trl_config(args: argparse.Namespace, output_dir: str) -> Any:
    from trl import GRPOConfig

    vllm = {}
    if args.engine == "vllm":  # TRL's own vLLM, in the trainer's process
        vllm = {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": 0.1,  # on a CPU: the share of RAM for its cache
            "vllm_max_model_length": 4096,
        }
    return GRPOConfig(
        **vllm,
        output_dir=output_dir,
        max_steps=args.steps,
        seed=args.seed,
        per_device_train_batch_size=args.batch_size * args.group_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        # per turn, like agentenv (vLLM's SamplingParams names it max_tokens)
        generation_kwargs={"max_tokens" if vllm else "max_new_tokens": args.max_new_tokens},
        max_completion_length=args.max_turns * (args.max_new_tokens + TOOL_SLACK),
        max_tool_calling_iterations=args.max_turns - 1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        num_iterations=1,
        scale_rewards="group",
        use_cpu=args.device == "cpu",
        bf16=compute_dtype(args) == "bfloat16",  # TRL's mixed precision: fp32 weights
        fp16=compute_dtype(args) == "float16",
        gradient_checkpointing=False,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    """Setup, then ``trainer.train()`` for ``steps`` optimizer steps, timed by a callback."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from agentenv.lm import models
    from envs.calculator import calculator

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model, tokenizer = models.load(args.model, dtype="float32", device=args.device)
    tokenizer, template = _tool_tokenizer(tokenizer)
    env = make_env(args)
    ids = all_task_ids(args)
    rows = [{"prompt": _trl_prompt(env, i, args.prompt_style), "task_id": i} for i in ids]
    prompt_tokens = [
        len(
            tokenizer.apply_chat_template(
                r["prompt"], tools=[calculator.fn], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for r in rows
    ]
    lora = lora_settings()
    peft_config = (
        None
        if args.full_finetune
        else LoraConfig(
            task_type="CAUSAL_LM",
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["targets"],
        )
    )
    timer = _step_timer(args.batch_size * args.group_size)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = _timed_trainer_class()(
            model=model,
            reward_funcs=_reward_fn(env, args.reward_noise),
            args=_trl_config(args, output_dir),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=peft_config,
            tools=[calculator.fn],
            callbacks=[timer],
        )
        timer.trainer = trainer
        result: dict[str, Any] = {"setup_s": time.perf_counter() - t0, "template": template}
        result["setup_rss_mb"] = peak_rss_mb()
        result["prompt_tokens"] = statistics.mean(prompt_tokens)
        trainer.train()
    env.close()
    return {**result, "steps": timer.steps, **peak_memory(args.device)}
