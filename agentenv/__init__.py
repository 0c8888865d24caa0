"""agentenv: multi-turn tool-use environments for LLM agents, and GRPO to train on them.

The public API is re-exported here::

    import agentenv
    env = agentenv.make("Calculator-v0")
    obs, info = env.reset(seed=0)
"""

from agentenv.env.conversation import ConversationEnv
from agentenv.env.core import SPLITS, Task, TextEnv, ToolEnv
from agentenv.env.executor import ToolExecutor, ToolResult, truncate
from agentenv.env.mixture import EnvSpec, Mixture
from agentenv.env.parsers import ActionParser, HermesParser, ParsedAction, ReActParser, ToolCall
from agentenv.env.play import ChatModelPolicy, EpisodeResult, play_episode
from agentenv.env.registration import _register_bundled as _register_bundled
from agentenv.env.registration import deregister, make, register, registry, spec
from agentenv.env.spaces import FreeText, Message, Messages
from agentenv.env.tools import Tool, tool, toolset
from agentenv.errors import AgentEnvError

__version__ = "0.1.0"

# Names whose modules import torch/transformers are loaded on first use, so that
# `import agentenv` (e.g. from another RL library that only wants the envs) stays light.
_LAZY = {
    "ChatFormat": "agentenv.rollout.episode",
    "Episode": "agentenv.rollout.episode",
    "EpisodeBuilder": "agentenv.rollout.episode",
    "collate": "agentenv.rollout.episode",
    "Generation": "agentenv.lm.backend",
    "PolicyBackend": "agentenv.lm.backend",
    "RolloutConfig": "agentenv.rollout.collect",
    "SamplingConfig": "agentenv.lm.backend",
    "ScriptedPolicy": "agentenv.rollout.collect",
    "TransformersPolicy": "agentenv.lm.sampler",
    "collect": "agentenv.rollout.collect",
    "resolve_dtype": "agentenv.lm.precision",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentenv' has no attribute {name!r}")


__all__ = [
    *_LAZY,
    "SPLITS",
    "ActionParser",
    "ChatModelPolicy",
    "ConversationEnv",
    "EnvSpec",
    "EpisodeResult",
    "AgentEnvError",
    "FreeText",
    "HermesParser",
    "Message",
    "Messages",
    "Mixture",
    "ParsedAction",
    "ReActParser",
    "Task",
    "TextEnv",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolExecutor",
    "ToolResult",
    "deregister",
    "make",
    "play_episode",
    "register",
    "registry",
    "spec",
    "tool",
    "toolset",
    "truncate",
]

_register_bundled()
