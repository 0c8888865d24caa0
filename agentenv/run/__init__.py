"""Running things: the layer that builds envs, policies and trainers together.

- ``train`` (``agentenv train``), ``sft`` (``agentenv sft``), ``evaluate`` (``agentenv eval``),
  ``judge`` (an LLM grading answers), ``profiles`` (named settings),
  ``tracking`` / ``plots`` / ``viewer`` (run artifacts), ``export`` (a checkpoint as a model).
"""
