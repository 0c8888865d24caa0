"""Expert demonstrations as episodes, for supervised warm starts.

An env that can solve its tasks returns the expert's actions from
``env.demonstration(task)``. :func:`demonstration_episodes` replays them through a
fresh env and records them with the same :class:`~agentenv.rollout.episode.EpisodeBuilder`
as sampled episodes, so SFT trains on exactly the tokens and masks GRPO will see.
"""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym

from agentenv.errors import InvalidOptionError
from agentenv.rollout.episode import ChatFormat, Episode, EpisodeBuilder


def demonstration_episodes(
    make_env: Callable[[], gym.Env],
    fmt: ChatFormat,
    num_episodes: int,
    *,
    seed: int = 0,
    max_episode_tokens: int = 2048,
) -> list[Episode]:
    """Replay expert demonstrations of ``num_episodes`` tasks drawn with seeds ``seed + i``.

    Only demonstrations the env rewards with ``info["correct"]`` are kept, so a
    wrong demonstration can never be learned.

    Raises:
        InvalidOptionError: the env offers no demonstrations for its tasks.
    """
    env = make_env()
    eos = fmt.tokenizer.eos_token_id
    episodes: list[Episode] = []
    for i in range(num_episodes):
        obs, info = env.reset(seed=seed + i)
        actions = env.unwrapped.demonstration(env.unwrapped.task)
        if not actions:
            env.close()
            raise InvalidOptionError(
                f"{env.spec.id if env.spec else type(env).__name__} has no demonstration for "
                "its tasks (demonstration() returned None); choose a task source that "
                "provides them, e.g. Calculator-v0 with source='word_problems'"
            )
        builder = EpisodeBuilder(fmt, obs, max_episode_tokens)
        reward, done = 0.0, False
        for action in actions:
            ids = fmt.encode(action) + [eos]
            builder.add_policy(ids, [0.0] * len(ids), action)
            obs, r, terminated, truncated, info = env.step(action)
            reward += float(r)
            done = terminated or truncated
            if done or not builder.add_env(obs):
                break
        if done and info.get("correct"):
            episodes.append(
                builder.build(reward=reward, stop_reason="terminated", info=info, seed=seed + i)
            )
    env.close()
    return episodes
