"""agentenv environments as a verifiers (>= 0.4, ``verifiers.v1``) taskset and env.

verifiers 0.4 replaced ``MultiTurnEnv`` with tasksets, envs and harnesses: a taskset
yields tasks, an env's ``run`` drives the conversation through an agent, and a harness
makes the model calls (through verifiers' interception server, which records every turn
for scoring and training). This module is a verifiers plugin (its ``__all__`` exports
one of each); verifiers loads plugins by a top-level module name, which is
``agentenv-verifiers`` (the module ``agentenv_verifiers`` re-exports this one)::

    import verifiers.v1 as vf
    from agentenv.integrations.verifiers import AgentEnvEnvConfig

    env = vf.load_environment(AgentEnvEnvConfig(taskset={
        "id": "agentenv-verifiers", "env_id": "Calculator-v0", "num_tasks": 8,
    }))
    # or: vf-eval agentenv-verifiers --env.taskset.env-id Calculator-v0 -m MODEL ...

* :class:`AgentEnvTaskset` yields one task per task of a split: the env's own opening
  messages (system prompt with its tool-call format, then the task) and its ``task_id``.
* :class:`AgentEnvEnv` runs each rollout against a fresh agentenv env reset to that
  task: the model's reply goes to the env's ``step``, the env's new messages go back as
  the next turn, until the env terminates or truncates (or the agent's ``max_turns``).
  Tool results are sent as ``user`` messages: they answer text tool calls, not
  OpenAI-style ``tool_calls`` with ids, which a server's template may refuse.
* :class:`AgentEnvTask` scores the rollout with the env's own rewards (``env_reward``,
  weight 1) and reports ``correct``, ``env_turns`` and ``num_tool_calls`` as metrics; the
  trace's ``info["turn_rewards"]`` holds the env's per-turn rewards (``info["turn_reward"]``,
  0.0 where none), one per model reply. A :class:`~agentenv.ConversationEnv`'s follow-up
  user turns arrive as the next turn's ``user`` message, like tool results.
* :class:`ChatHarness` calls the model in-process with the OpenAI client, so no rollout
  needs a sandbox, ``uv`` or the network (verifiers' built-in harnesses install ``uv``
  and their packages at run time). Every call still goes through verifiers' endpoint.
"""

from __future__ import annotations

import asyncio
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

from agentenv.env.registration import make
from agentenv.integrations.rows import task_rows

__all__ = [
    "AgentEnvData",
    "AgentEnvEnv",
    "AgentEnvEnvConfig",
    "AgentEnvTask",
    "AgentEnvTaskset",
    "AgentEnvTasksetConfig",
    "ChatHarness",
    "ChatHarnessConfig",
]


class AgentEnvTasksetConfig(vf.TasksetConfig):
    """Which agentenv tasks load (``--env.taskset.*``)."""

    env_id: str = "Calculator-v0"
    """A registered agentenv env id (user envs once their module is imported)."""
    split: str = "test"
    """``train`` or ``test``."""
    num_tasks: int | None = None
    """The first ``num_tasks`` tasks of the split; default all."""
    env_kwargs: dict[str, Any] = {}
    """Passed to ``agentenv.make`` for the task list and every rollout's env."""


class AgentEnvData(vf.TaskData):
    """A task: verifiers' prompt fields plus the agentenv ``task_id`` that resets to it."""

    task_id: int


class AgentEnvTask(vf.Task[AgentEnvData, vf.State, vf.TaskConfig]):
    """Scored by the agentenv env itself (what :class:`AgentEnvEnv` recorded)."""

    @vf.reward(weight=1.0)
    async def env_reward(self, trace: vf.Trace) -> float:
        return float(trace.info.get("env_reward", 0.0))

    @vf.metric
    async def correct(self, trace: vf.Trace) -> float:
        return float(bool(trace.info.get("correct", False)))

    @vf.metric
    async def env_turns(self, trace: vf.Trace) -> float:
        return float(trace.info.get("env_turns", 0))

    @vf.metric
    async def num_tool_calls(self, trace: vf.Trace) -> float:
        return float(trace.info.get("num_tool_calls", 0))


class AgentEnvTaskset(vf.Taskset[AgentEnvTask, AgentEnvTasksetConfig]):
    """The tasks of one agentenv env's split."""

    def load(self) -> Any:
        config = self.config
        rows = task_rows(
            config.env_id, split=config.split, num_tasks=config.num_tasks, **config.env_kwargs
        )
        for row in rows:
            system, user = row["prompt"]
            data = AgentEnvData(
                name=f"{config.env_id}#{row['task_id']}",
                task_id=row["task_id"],
                system_prompt=system["content"],
                prompt=user["content"],
            )
            yield AgentEnvTask(data, config.task)


class ChatHarnessConfig(vf.HarnessConfig):
    """No settings: sampling comes from the run's model context."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat completion per turn, in-process, through verifiers' endpoint."""

    APPENDS_SYSTEM_PROMPT = True  # the system prompt goes as its own system message
    SUPPORTS_RESUME = True  # each turn relaunches on the conversation so far
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: Any,
        data: Any,
        **kwargs: Any,
    ) -> ProgramResult:
        from openai import AsyncOpenAI

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        except Exception as error:  # a refused turn (max_turns, a stop) is an HTTP error
            if trace.stop_condition is None:
                return ProgramResult(exit_code=1, stdout="", stderr=repr(error))
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


class AgentEnvEnvConfig(vf.EnvConfig):
    """One role, ``agent``, run by :class:`ChatHarness` in a local subprocess runtime."""

    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig(), max_turns=20)


class AgentEnvEnv(vf.Env[AgentEnvEnvConfig]):
    """Each rollout plays one agentenv episode: reply -> ``env.step`` -> next turn."""

    async def run(self, task: Any, agents: Any) -> None:
        config: AgentEnvTasksetConfig = self.taskset.config  # type: ignore[assignment]
        env = make(config.env_id, split=config.split, **config.env_kwargs)
        try:
            await asyncio.to_thread(env.reset, options={"task_id": task.data.task_id})
            total, turns, info = 0.0, 0, {}
            turn_rewards: list[float] = []  # info["turn_reward"] of each reply, as in Episode
            async with agents.agent.interaction(task) as interaction:
                segment = await interaction.turn()  # the task has a prompt: the model starts
                while not segment.terminated:
                    # tools may block (a Workspace runs code): keep the event loop free
                    new, reward, terminated, truncated, info = await asyncio.to_thread(
                        env.step, segment.last_reply
                    )
                    total += float(reward)
                    turns += 1
                    turn_rewards.append(float(info.get("turn_reward", 0.0)))
                    if terminated or truncated:
                        break
                    replies = [{"role": "user", "content": m["content"]} for m in new]
                    segment = await interaction.turn(replies)
                interaction.trace.info.update(
                    env_reward=total,
                    env_turns=turns,
                    turn_rewards=turn_rewards,
                    correct=bool(info.get("correct", False)),
                    num_tool_calls=int(info.get("num_tool_calls", 0)),
                )
        finally:
            env.close()
