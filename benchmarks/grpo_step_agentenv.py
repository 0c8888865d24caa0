"""agentenv's side of ``grpo_step.py``: ``collect`` B x G episodes, then ``GRPO.learn``.

``grpo_step.py`` runs :func:`run_agentenv` in its own subprocess (``--worker agentenv``);
it returns the setup figures and one dict of timings and metrics per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import peak_memory, peak_rss_mb
from _grpo_step_settings import all_task_ids, make_env, task_ids, token_hash


def _stop_without_tool_call(env: Any) -> Any:
    """Wrap ``env`` so a turn with neither tool call nor answer ends the episode (TRL's rule)."""
    import gymnasium as gym

    class StopWithoutToolCall(gym.Wrapper):
        def step(self, action: str) -> tuple[Any, ...]:
            obs, reward, terminated, truncated, info = self.env.step(action)
            if not (terminated or truncated) and obs and all(m["role"] == "user" for m in obs):
                truncated = True  # the env's format reminder: TRL would stop here
            return obs, reward, terminated, truncated, info

    return StopWithoutToolCall(env)


def run_agentenv(args: argparse.Namespace) -> dict[str, Any]:
    """Setup, then ``steps`` x (collect + learn), timed per phase."""
    import torch

    import agentenv
    from agentenv.lm import models
    from agentenv.lm.precision import training_dtype
    from algorithms import GRPO, GRPOConfig

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    compute = agentenv.resolve_dtype(args.dtype, args.device)
    model, tokenizer = models.load(
        args.model,
        dtype=training_dtype(compute, use_lora=not args.full_finetune),
        device=args.device,
    )
    config = GRPOConfig(
        learning_rate=args.learning_rate,
        beta=0.0,
        loss_type="dapo",
        num_iterations=1,
        use_lora=not args.full_finetune,
    )
    rollout = agentenv.RolloutConfig(
        args.group_size,
        args.max_turns,
        4096,  # budget never binds: limits are per turn
        agentenv.SamplingConfig(args.max_new_tokens, temperature=1.0),
        show_progress=False,
    )
    algo = GRPO(model, tokenizer, config, sampling=rollout.sampling, seed=args.seed, dtype=compute)
    fmt = agentenv.ChatFormat(tokenizer)
    from agentenv.lm.backend import EngineConfig
    from agentenv.lm.engines import make_policy

    engine = EngineConfig(engine=args.engine)
    policy = make_policy(
        engine, algo.unwrapped_model, tokenizer, model_name=args.model, dtype=compute
    )

    def env_factory() -> Any:
        env = make_env(args)
        return _stop_without_tool_call(env) if args.turn_rule == "trl" else env

    probe = make_env(args)
    ids = all_task_ids(args)
    prompt_tokens = [len(fmt.prompt_ids(probe.reset(options={"task_id": i})[0])) for i in ids]
    probe.close()
    result: dict[str, Any] = {"setup_s": time.perf_counter() - t0, "steps": []}
    result["setup_rss_mb"] = peak_rss_mb()
    result["prompt_tokens"] = statistics.mean(prompt_tokens)
    for step in range(args.steps):
        tasks = task_ids(args, step)
        start = time.perf_counter()
        groups, m = agentenv.collect(
            env_factory, tasks, policy, fmt, rollout, options=[{"task_id": i} for i in tasks]
        )
        episodes = [ep for group in groups for ep in group]
        for ep in episodes:
            policy_ids = [t for t, a in zip(ep.input_ids, ep.action_mask, strict=True) if a]
            ep.reward += args.reward_noise * token_hash(policy_ids)
        if hasattr(policy, "release_weights"):  # as `agentenv train` does before learning
            policy.release_weights()
        models.release_memory()  # and after each phase
        t_learn = time.perf_counter()
        metrics = algo.learn(groups)
        models.release_memory()
        end = time.perf_counter()
        result["steps"].append(
            {
                "total_s": end - start,
                "generate_s": m["rollout/generate_s"],
                "env_s": m["rollout/env_s"],
                "learn_s": end - t_learn,
                "tokens": m["rollout/tokens"],
                "turns": statistics.mean(ep.num_turns for ep in episodes),
                "reward": metrics["rewards/mean"],
                "frac_reward_zero_std": metrics["frac_reward_zero_std"],
            }
        )
    return {**result, **peak_memory(args.device)}
