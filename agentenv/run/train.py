"""The training loop: collect B x G episodes, learn with GRPO, log, evaluate, checkpoint.

    run = agentenv.run.train("Calculator-v0", config=TrainConfig(steps=20))

Each step reads as one pass: ``collect -> algorithm.learn -> log -> (eval) -> (save)``.

Under ``accelerate launch`` (or ``torchrun``) with N processes, each process collects its
own share of every step's ``batch_size`` tasks (``batch_size`` must be a multiple of N),
the gradients are reduced across processes inside :meth:`GRPO.learn`, and only the main
process writes the run directory: config, metrics, episodes, evaluations, plots and
checkpoints (the others wait for it). The logged rollout statistics are the main
process's share; the loss, KL and clip metrics are global.
The run directory holds ``config.json``, ``metrics.jsonl``, TensorBoard events,
``episodes/step_N.jsonl``, ``checkpoints/step_N`` (written atomically) and, at the end,
``plots/*.png`` and ``eval/{before,after}.json``. ``resume=True`` continues from the
last complete checkpoint; task seeds and sampling seeds are functions of ``(seed, step)``
(a population member's also of its lineage, :mod:`agentenv.run.population`; dynamic
sampling's extra tasks also of the round, :mod:`agentenv.run.dynamic_sampling`), so a
resumed run sees the same tasks, and draws the same tokens, as an uninterrupted one.
With dynamic sampling the ``rollout/*`` and ``episodes/*`` metrics describe the step's
first draw (the policy as a plain step sees it), the learner's those of the groups
trained, and ``sampling/*`` what filling the batch cost.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from agentenv import config as config_lib
from agentenv.env.mixture import Mixture
from agentenv.env.registration import env_name
from agentenv.errors import EnvFailureError, InvalidOptionError
from agentenv.lm.precision import resolve_dtype, training_dtype
from agentenv.run import population as population_lib
from agentenv.run.config import TrainConfig
from agentenv.run.dynamic_sampling import extra_budget, extra_task_seeds, fill_batch
from agentenv.run.export import load_from_checkpoint
from agentenv.run.no_signal import SignalWatch, env_offers, no_signal_message
from agentenv.run.pools import TaskPool, group_results
from agentenv.run.recorded import check_checkpoint, run_record


def task_seeds(seed: int, step: int, n: int) -> list[int]:
    """The reset seeds of step ``step``'s tasks (a pure function: resumes see the same)."""
    rng = random.Random(f"{seed}-{step}")
    return [rng.randrange(2**31) for _ in range(n)]


def sampling_seed(seed: int, step: int) -> int:
    """Step ``step``'s sampling seed: with the task seed, group member and turn it seeds each
    policy turn (:func:`agentenv.rollout.collect.trajectory_seed`), so an episode is the same
    whichever process collects it and a resumed run samples what an uninterrupted one did."""
    return random.Random(f"{seed}-{step}-sampling").getrandbits(63)


def task_share(seed: int, step: int, batch_size: int, rank: int = 0, world: int = 1) -> list[int]:
    """Process ``rank``'s share of step ``step``'s tasks (every ``world``-th one): the
    shares of ``world`` processes are disjoint and together are the step's tasks."""
    return task_seeds(seed, step, batch_size)[rank::world]


def step_share(
    mixture: Mixture, seed: int, step: int, batch_size: int, rank: int = 0, world: int = 1
) -> list[list[int]]:
    """Process ``rank``'s share of step ``step``'s tasks, per env: ``[e]`` holds the task
    seeds of env ``e`` (:meth:`Mixture.step_tasks` assigns the step's :func:`task_seeds`
    to envs by quota; a process takes every ``world``-th task). One env: ``[task_share]``."""
    seeds = task_seeds(seed, step, batch_size)
    mine = list(zip(mixture.step_tasks(seeds, step), seeds, strict=True))[rank::world]
    return [[s for env, s in mine if env == e] for e in range(len(mixture))]


#: Rollout metrics that add up over several ``collect`` calls (a mixture's envs).
_SUMMED = ("_s", "/tokens", "/env_errors", "/prefill_tokens")


def merge_rollout_metrics(parts: list[tuple[list[list[Any]], dict[str, float]]]) -> dict:
    """One step's ``rollout/*`` metrics from each env's ``collect`` (groups, metrics):
    times and counts summed, tool and retrieval rates over every episode, the other
    rates weighted by tokens. One part: its metrics."""
    if len(parts) == 1:
        return dict(parts[0][1])
    from agentenv.rollout.stats import retrieval_stats, tool_call_stats

    keys = {k for _, m in parts for k in m}
    tokens = [max(m.get("rollout/tokens", 0.0), 1e-9) for _, m in parts]
    out = {}
    for k in sorted(keys):
        values = [m.get(k, 0.0) for _, m in parts]
        if k.endswith(_SUMMED):
            out[k] = sum(values)
        else:
            out[k] = sum(v * t for v, t in zip(values, tokens, strict=True)) / sum(tokens)
    generate = out.get("rollout/generate_s", 0.0)
    out["rollout/tokens_per_s"] = out.get("rollout/tokens", 0.0) / generate if generate else 0.0
    episodes = [e for groups, _ in parts for g in groups for e in g]
    calls = {**tool_call_stats(episodes), **retrieval_stats(episodes)}
    out.update({f"rollout/{k}": v for k, v in calls.items()})
    return out


def env_step_metrics(
    name: str, groups: list[list[Any]], metrics: dict[str, float], signal: Any
) -> dict[str, float]:
    """Env ``name``'s share of a step, as ``<metric>/<name>``: its rollout and episode
    metrics, mean reward and the fraction of its groups without a learning signal."""
    episodes = [e for g in groups for e in g]
    has = signal(groups)
    own = {
        **metrics,
        **_episode_stats(groups),
        "rewards/mean": sum(e.reward for e in episodes) / len(episodes),
        "frac_no_signal": 1 - sum(has) / len(has),
        "groups": float(len(groups)),
    }
    return {f"{k}/{name}": v for k, v in own.items()}


def merge_sampling_metrics(parts: list[tuple[str, dict[str, float]]], group_size: int) -> dict:
    """Dynamic sampling's ``sampling/*`` over each env's fill (:func:`fill_batch`), with
    each env's as ``sampling/<metric>/<env>``. One env: its own."""
    if len(parts) == 1:
        return dict(parts[0][1])
    out: dict[str, float] = {}
    for tag, stats in parts:
        out.update({f"{k}/{tag}": v for k, v in stats.items()})
    for k in ("tasks_drawn", "groups_with_signal", "groups_trained", "rounds"):
        out[f"sampling/{k}"] = sum(stats[f"sampling/{k}"] for _, stats in parts)
    kept = sum(s["sampling/groups_trained"] for _, s in parts if s["sampling/groups_with_signal"])
    out["sampling/episodes_per_trained_group"] = (
        out["sampling/tasks_drawn"] * group_size / max(kept, 1)
    )
    return out


def env_limits(rollout: Any, limits: dict[str, int]) -> Any:
    """``rollout`` (a :class:`~agentenv.rollout.config.RolloutConfig`) with an env's own
    turn and token limits (:meth:`~agentenv.env.mixture.EnvSpec.limits`)."""
    if not limits:
        return rollout
    sampling = rollout.sampling
    if "max_new_tokens" in limits:
        sampling = dataclasses.replace(sampling, max_new_tokens=limits["max_new_tokens"])
    own = {k: v for k, v in limits.items() if k != "max_new_tokens"}
    return dataclasses.replace(rollout, sampling=sampling, **own)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def _episode_stats(groups: list[list[Any]]) -> dict[str, float]:
    """Per-episode and per-turn statistics of a step's episodes."""
    eps = [e for g in groups for e in g]
    n = len(eps)
    turns = max(sum(e.num_turns for e in eps), 1)
    return {
        "episodes/correct_rate": sum(bool(e.info.get("correct")) for e in eps) / n,
        "episodes/answer_rate": sum("answer" in e.info for e in eps) / n,
        "episodes/tool_call_rate": sum(e.info.get("num_tool_calls", 0) > 0 for e in eps) / n,
        "episodes/mean_turns": sum(e.num_turns for e in eps) / n,
        "episodes/max_turns": float(max(e.num_turns for e in eps)),
        "episodes/mean_policy_tokens": sum(e.num_policy_tokens for e in eps) / n,
        "episodes/unfinished_rate": sum(e.stop_reason != "terminated" for e in eps) / n,
        "episodes/failed_rate": sum(e.failed for e in eps) / n,
        "turns/policy_tokens_mean": sum(e.num_policy_tokens for e in eps) / turns,
        "turns/tool_calls_mean": sum(e.info.get("num_tool_calls", 0) for e in eps) / turns,
        "turns/tool_errors_mean": sum(e.info.get("num_tool_errors", 0) for e in eps) / turns,
    }


def _check_failures(
    groups: list[list[Any]], budget: float, step: int, ckpt_dir: Path, acc: Any
) -> None:
    """Stop the run, before it learns from step ``step``, if more than ``budget`` of the
    step's episodes (over every process) failed."""
    eps = [e for g in groups for e in g]
    failed = [e for e in eps if e.failed]
    counts = torch.tensor([len(failed), len(eps)], device=acc.device)
    counts = acc.reduce(counts, reduction="sum").tolist()
    if counts[0] <= budget * counts[1]:
        return
    reasons = collections.Counter(e.stop_reason for e in failed)
    first = next((e.info.get("env_error") for e in failed if "env_error" in e.info), None)
    from algorithms.checkpoint import latest_checkpoint

    last = latest_checkpoint(ckpt_dir)
    raise EnvFailureError(
        f"step {step}: {counts[0]} of {counts[1]} episodes failed "
        f"({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}"
        + (f"; first error here: {first}" if first else "")
        + f"), more than max_failed_fraction={budget}. Fix the env or its backend and "
        + (f"continue with --resume (last checkpoint: {last})" if last else "start again")
        + "; or raise --max-failed-fraction (failed episodes carry no learning signal)"
    )


def _prune(ckpt_dir: Path, keep: int) -> None:
    from algorithms.checkpoint import checkpoint_step

    done = sorted((s, p) for p in ckpt_dir.iterdir() if (s := checkpoint_step(p)) is not None)
    for _, path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def train(
    env_id: str | None = None,
    *,
    model: str | None = None,
    config: TrainConfig | None = None,
    resume: bool = False,
) -> Path:
    """Train a policy on ``env_id`` with GRPO; return the run directory.

    Args:
        env_id: Overrides ``config.env_id``.
        model: Overrides ``config.model``.
        config: The run's settings (default :class:`TrainConfig`).
        resume: Continue the run in ``config.output_dir`` from its last complete checkpoint.
    """
    from agentenv.lm import models
    from agentenv.lm.engines import check_engine, make_policy
    from agentenv.rollout.collect import collect
    from agentenv.rollout.episode import ChatFormat
    from agentenv.run.config import EvalConfig
    from agentenv.run.evaluate import evaluate_mixture, format_table
    from agentenv.run.plots import plot_run
    from agentenv.run.tracking import RunLogger
    from algorithms.checkpoint import latest_checkpoint
    from algorithms.grpo import GRPO

    config = config or TrainConfig()
    config = dataclasses.replace(
        config, env_id=env_id or config.env_id, model=model or config.model
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    mixture = config.mixture()  # one env, or several (agentenv.env.mixture)
    name = env_name(config.env_id) if len(mixture) == 1 else "mixture"
    run_dir = Path(config.output_dir or f"runs/{name}-{stamp}")
    if resume and not (run_dir / "config.json").exists():
        raise InvalidOptionError(f"--resume needs an existing run in {run_dir} (no config.json)")
    world, rank = processes()
    check_sharding(os.environ)
    if config.batch_size % world:
        raise InvalidOptionError(
            f"batch_size={config.batch_size} must be a multiple of the {world} processes "
            f"(each collects batch_size / {world} tasks a step); set batch_size to "
            f"{world * -(-config.batch_size // world)}"
        )
    for spec in mixture.specs:  # fail fast on bad env args
        spec.make("train").close()
    check_checkpoint(config.init_from, "--init-from")
    main = rank == 0
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / "config.json", config_lib.to_dict(config))  # the effective one
    if config.generation.engine == "server" and not config.grpo.use_lora:
        raise InvalidOptionError(
            "engine server can send only a LoRA adapter to the server after each step; full "
            "fine-tuning (grpo.use_lora false) would need the whole model sent into the "
            "server's memory, which agentenv does not do: set grpo.use_lora true, or use "
            "engine vllm or agentenv"
        )
    check_engine(config.generation)
    if main and config.grpo.credit == "bandit" and config.grpo.turn_reward_weight > 0:
        print(  # a config.json of a run before turn_weight meant this under bandit, say
            f"note: credit bandit with turn_weight {config.grpo.turn_weight}: each episode's "
            "reward adds that times its per-turn rewards (shaping); unset turn_weight (or 0) "
            "for the outcome alone",
            file=sys.stderr,
        )
    population_lib.check_population(config)
    splits = population_lib.task_splits(config, say=main)  # population > 1: fitness's tasks
    pools = task_pools(config)  # pools.difficulty_pools: which tasks a step draws, per env
    if config.generation.engine != "agentenv" and world > 1:
        raise InvalidOptionError(
            f"engine {config.generation.engine} runs in one process; with {world} processes "
            "use the agentenv engine"
        )

    torch.manual_seed(config.seed)  # LoRA init; episodes draw from sampling_seed()
    device = config.device or models.default_device()
    compute = resolve_dtype(config.dtype, device)
    grpo_cfg, rollout, sampling = config.grpo, config.rollout, config.rollout.sampling
    policy_model, tokenizer = models.load(
        config.model,
        dtype=training_dtype(compute, grpo_cfg.use_lora),
        device=device,
        quantize=config.quantize,
    )
    if config.init_from:
        policy_model = load_from_checkpoint(policy_model, Path(config.init_from))
    algo = GRPO(
        policy_model,
        tokenizer,
        grpo_cfg,
        sampling=sampling,  # the sampler's settings object: one temperature for both
        total_steps=config.steps,
        seed=config.seed,
        dtype=compute,
    )
    algo.run_record = run_record(config_lib.to_dict(config))  # run.json in each checkpoint
    for index, pool in pools.items():  # task_pool.pt (task_pool_<env>.pt) in each checkpoint
        algo.attached[pool_key(mixture, index)] = pool
    population, lineage = None, []  # evolution.population > 1: agentenv.run.population
    if config.evolution.population > 1:
        from algorithms.population import Population

        population = Population(algo, population_lib.start_hyperparameters(config), sampling)
    start = 0
    ckpt_dir = run_dir / "checkpoints"
    if resume and (ckpt := latest_checkpoint(ckpt_dir)) is not None:
        if population is not None:
            lineage = population.load(ckpt).get("lineage", [])
            if main:  # drop the killed run's evolutions after the checkpoint
                population_lib.write_lineage(run_dir, lineage)
        else:
            algo.load(ckpt)
        start = algo.step
    acc = algo.accelerator
    logger = (
        RunLogger(
            run_dir,
            resume_step=start if resume else None,
            tensorboard=config.tensorboard,
            wandb_project=config.wandb_project,
            config=config_lib.to_dict(config),
        )
        if main
        else None
    )
    fmt = ChatFormat(tokenizer)
    policy = make_policy(
        config.generation,
        algo.unwrapped_model,
        tokenizer,
        model_name=config.model,
        dtype=compute,
        record_hidden=grpo_cfg.credit == "gae" and grpo_cfg.critic_input == "sampler",
    )
    eval_cfg = EvalConfig(
        num_tasks=config.eval_tasks or None,
        max_turns=rollout.max_turns,
        max_new_tokens=sampling.max_new_tokens,
        max_episode_tokens=rollout.max_episode_tokens,
    )

    train_envs = [functools.partial(spec.make, "train") for spec in mixture.specs]

    def run_eval(label: str):  # noqa: ANN202
        """The main process evaluates (each env's test split); the others wait for it."""
        report = None
        if population is not None:  # the fittest member so far
            population.activate(population.best())
        policy.refresh()  # every process: gathering sharded weights is a collective
        if main:
            about = {"env_id": config.env_id, "env_kwargs": config.env_kwargs}
            report = evaluate_mixture(
                mixture, "test", policy, fmt, eval_cfg, label=label, about=about
            )
            report.save(run_dir / "eval" / f"{label}.json")
        acc.wait_for_everyone()
        return report

    try:
        before = None
        if config.eval_tasks and start == 0:
            before = run_eval("before")
            if main:
                logger.log(0, {f"eval/{k}": v for k, v in before.metrics.items()})
        steps = range(start, config.steps)
        watch = SignalWatch()  # says once if no group has a learning signal for long
        bar = tqdm(steps, initial=start, total=config.steps, desc="train", disable=not main)

        def one_step(step: int, rollout_cfg: Any, lineage_id: int = 0) -> tuple[list, dict]:
            """Collect the step's episodes (with dynamic sampling, more in place of groups
            without a signal), then learn from them (the active member's, whose lineage
            seeds its draws)."""
            sample_seed = population_lib.member_sample_seed(
                sampling_seed(config.seed, step), lineage_id
            )

            drawn: list[tuple[int, list, list[dict]]] = []  # (env, groups, reset options)

            def draw(env: int, seeds: list[int]) -> tuple[list, dict]:
                """Env ``env``'s groups of ``seeds`` (its own limits and sampling seed)."""
                options, pool, split = None, pools.get(env), splits.get(env)
                if split or pool:
                    options = split.training_options(seeds) if split else pool.options(seeds)
                spec = mixture.specs[env]
                env_rollout = env_limits(rollout_cfg, spec.limits())
                out = collect(
                    train_envs[env], seeds, policy, fmt, env_rollout, options=options,
                    sample_seed=mixture.sample_seed(sample_seed, env),
                )  # fmt: skip
                if len(mixture) > 1:
                    for episode in (e for g in out[0] for e in g):
                        episode.env = spec.name
                drawn.append((env, out[0], options or []))
                return out

            share = step_share(mixture, config.seed, step, config.batch_size, rank, world)
            first = {e: draw(e, seeds) for e, seeds in enumerate(share) if seeds}
            groups = [g for e in first for g in first[e][0]]
            metrics = merge_rollout_metrics([first[e] for e in first])
            _check_failures(groups, config.max_failed_fraction, step + 1, ckpt_dir, acc)
            metrics.update(_episode_stats(groups))  # the first draw's: the policy as it is
            if len(mixture) > 1:
                for e, (env_groups, env_metrics) in first.items():
                    metrics.update(env_step_metrics(
                        mixture.names[e], env_groups, env_metrics, algo.group_signal
                    ))  # fmt: skip
            trained = groups
            if grpo_cfg.dynamic_sampling:
                t_extra = time.perf_counter()
                quotas = mixture.quotas(step, config.batch_size)
                trained, filled = [], []
                for e, quota in enumerate(quotas):  # each env fills its own quota
                    if not quota:  # (on every process alike: the rounds are collectives)
                        continue
                    tag = mixture.names[e] if len(mixture) > 1 else ""
                    kept, stats = fill_batch(
                        first[e][0] if e in first else [],
                        algo.group_signal,
                        lambda r, n, e=e, tag=tag: draw(
                            e, extra_task_seeds(config.seed, step, r, n, rank, tag)
                        )[0],
                        want=len(share[e]),
                        budget=extra_budget(grpo_cfg.max_extra_tasks, quota, world),
                        any_process=any_process,
                    )
                    trained += kept
                    filled.append((tag, stats))
                metrics.update(merge_sampling_metrics(filled, rollout_cfg.group_size))
                metrics["time/extra_draws_s"] = time.perf_counter() - t_extra
            if pools:  # every process's groups, in rank order, on every process
                results = [
                    (e, *r) for e, gs, opts in drawn
                    for r in group_results(gs, [o["task_id"] for o in opts])
                ]  # fmt: skip
                if world > 1:
                    from accelerate.utils import gather_object

                    results = [tuple(r) for r in gather_object(results)]
                for e, pool in pools.items():
                    pool.update([r[1:] for r in results if r[0] == e])
                    suffix = f"/{mixture.names[e]}" if len(mixture) > 1 else ""
                    metrics.update({k + suffix: v for k, v in pool.metrics().items()})
            if hasattr(policy, "release_weights"):  # packed copies the update makes stale
                policy.release_weights()
            models.release_memory()
            t_learn = time.perf_counter()
            metrics.update(algo.learn(trained))
            metrics["time/learn_s"] = time.perf_counter() - t_learn
            models.release_memory()
            return trained, metrics

        def any_process(flag: bool) -> bool:
            """Whether ``flag`` holds on some process (dynamic sampling's rounds)."""
            if world == 1:
                return flag
            mark = torch.tensor([float(flag)], device=acc.device)
            return bool(acc.reduce(mark, reduction="max").item())

        for step in bar:
            t0 = time.perf_counter()
            done = step + 1
            if population is None:
                groups, metrics = one_step(step, rollout)
            else:  # each member in turn: the same tasks, its own weights and settings
                per_member = []
                for index in range(len(population)):
                    population.activate(index)
                    algo.step = step  # the population's step: each member's learn adds 1
                    member_rollout = dataclasses.replace(
                        rollout, sampling=population.sampling(index)
                    )
                    lineage_id = population.members[index].lineage_id
                    groups, member = one_step(step, member_rollout, lineage_id)
                    per_member.append(member)
                metrics = population_lib.mean_metrics(per_member)
                for index, member in enumerate(per_member):
                    metrics.update(population_lib.member_metrics(index, member))
                for index, hp in enumerate(population.hyperparameters):  # the step's own
                    metrics.update({f"member{index}/hp/{k}": v for k, v in hp.items()})
                evo = config.evolution
                evolve_now = evo.evolve_every and done % evo.evolve_every == 0
                if evolve_now or done == config.steps:  # the last step: to pick the best
                    fitness = population_lib.measure_fitness(
                        population, mixture, policy, fmt, config, main, splits
                    )
                    metrics.update({f"member{i}/fitness": f for i, f in enumerate(fitness)})
                    if evolve_now and done < config.steps:
                        lineage.append(population_lib.evolve(population, fitness, config, done))
                        if main:
                            population_lib.write_lineage(run_dir, lineage)
            if (
                config.eval_tasks
                and config.eval_every
                and done % config.eval_every == 0
                and done < config.steps
            ):
                report = run_eval(f"step_{done}")
                if main:
                    metrics.update({f"eval/{k}": v for k, v in report.metrics.items()})
            metrics["time/step_s"] = time.perf_counter() - t0
            if main:
                logger.log(done, metrics)
            if main and watch.update(metrics) and len(mixture) == 1:  # once, after
                message = no_signal_message(config, watch.rewards, env_offers(train_envs[0]))
                tqdm.write(message, file=sys.stderr)
            if main and config.log_episodes:
                n = config.log_episodes
                adv = algo.last_advantages.flatten().tolist()  # the trained ones
                turns = algo.last_turn_advantages  # credit turn/gae: per turn, else None
                eps = [e for g in groups for e in g]
                logger.log_episodes(
                    done, eps[:n], tokenizer, adv[:n], None if turns is None else turns[:n]
                )
            if done % config.save_every == 0 or done == config.steps:
                path = ckpt_dir / f"step_{done:06d}"  # the main process writes, all wait
                if population is None:
                    algo.save(path)
                else:
                    population.save(path, {"lineage": lineage})
                if main:
                    _prune(ckpt_dir, config.keep_checkpoints)
            bar.set_postfix(
                reward=f"{metrics['rewards/mean']:.2f}",
                kl=f"{metrics['kl']:.3g}",
                s_per_step=f"{metrics['time/step_s']:.0f}",
            )
        after = run_eval("after") if config.eval_tasks else None
    finally:  # an engine that holds resources (a vLLM engine, a server's adapter)
        if hasattr(policy, "close"):
            policy.close()
    if not main:
        return run_dir
    if after is not None:
        logger.log(config.steps, {f"eval/{k}": v for k, v in after.metrics.items()})
        before = before or _maybe_load(run_dir / "eval" / "before.json")
        print(format_table([before, after]) if before else format_table([after]))
    logger.close()
    plots = plot_run(run_dir)
    if population is not None and (fitness_plot := population_lib.plot_fitness(run_dir)):
        plots.append(fitness_plot)
    print(f"run directory: {run_dir}\nplots: {', '.join(str(p) for p in plots)}")
    return run_dir


def task_pools(config: TrainConfig) -> dict[int, TaskPool]:
    """The run's task pools, one per env of its mixture over that env's train split
    (none unless ``pools.difficulty_pools``); refused, before any model loads, for an env
    without ``num_tasks``."""
    if not config.pools.difficulty_pools:
        return {}
    pools = {}
    for index, spec in enumerate(config.mixture().specs):
        env = spec.make("train")
        try:
            num_tasks = getattr(env.unwrapped, "num_tasks", None)
        finally:
            env.close()
        if not isinstance(num_tasks, int) or num_tasks < 1:
            raise InvalidOptionError(
                f"difficulty_pools picks tasks by index: {spec.env_id} has no num_tasks (and "
                "reset(options={'task_id': i})); build it on agentenv.AgentEnv, or leave "
                "difficulty_pools off"
            )
        cfg = config.pools
        pools[index] = TaskPool(num_tasks, retire_after=cfg.retire_after, readmit=cfg.readmit)
    return pools


def pool_key(mixture: Mixture, index: int) -> str:
    """The checkpoint name of env ``index``'s pool: ``task_pool`` (one env) or
    ``task_pool_<env>``."""
    return "task_pool" if len(mixture) == 1 else f"task_pool_{mixture.names[index]}"


def processes() -> tuple[int, int]:
    """``(world size, rank)`` of this run, from the launcher's environment (``accelerate
    launch`` and ``torchrun`` set WORLD_SIZE / RANK); ``(1, 0)`` for a plain process.

    Read here, not from ``accelerate.PartialState``: building that initialises the process
    group and picks its device and backend before the model's device is known (the
    trainer's ``Accelerator`` does that later), and this runs before any model loads so
    that a bad ``batch_size`` fails first."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def check_sharding(environ: Mapping[str, str]) -> None:
    """Refuse, before any model loads, an ``accelerate launch`` configuration whose
    parameter sharding the sampler and the checkpoints do not handle: FSDP1 (flat
    parameters) and DeepSpeed ZeRO-3. FSDP2 (``fsdp_version: 2``) is gathered by both."""
    fsdp = environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp and environ.get("FSDP_VERSION", "1") != "2":
        raise InvalidOptionError(
            "agentenv train does not support FSDP1 (flat parameters the sampler cannot "
            "gather); set fsdp_version: 2 in the accelerate config (or accelerate launch "
            "--fsdp_version 2)"
        )
    if environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
        raise InvalidOptionError(
            "agentenv train does not checkpoint parameters sharded by DeepSpeed ZeRO-3 yet; "
            "use FSDP2 (fsdp_version: 2) to shard parameters, or ZeRO-2 (zero_stage: 2), "
            "which shards only the optimizer state and gradients"
        )


def _maybe_load(path: Path) -> Any:
    from agentenv.run.evaluate import EvalReport

    return EvalReport.load(path) if path.exists() else None
