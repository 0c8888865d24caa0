"""The environment contract: loads no torch, so other RL libraries can import it cheaply.

- ``core``: :class:`TextEnv` (chat messages in, text out) and :class:`ToolEnv` (tools plus a
  final answer), and :class:`Task`.
- ``spaces``: the observation and action spaces (``Messages``, ``FreeText``).
- ``tools`` / ``parsers`` / ``executor``: a tool from a typed function, tool calls parsed out
  of the model's text, and run with a time limit, never raising into the episode.
- ``registration``: ``make`` / ``register`` on gymnasium's registry, ``agentenv/`` namespace.
- ``play``: play one episode with any ``messages -> text`` callable.
- ``splits``: stable hashes that put a task on the train or test side on every machine.
"""
