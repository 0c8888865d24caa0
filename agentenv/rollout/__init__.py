"""Episodes: envs played by a policy, recorded token for token.

- ``episode``: the chat template's deltas turned into ``input_ids`` and an ``action_mask``
  that is 1 exactly on the tokens the policy sampled.
- ``collect``: the rollout loop (``collect``, ``RolloutConfig``, ``ScriptedPolicy``).
- ``demos``: scripted demonstrations recorded as episodes, for the supervised warm start.
"""
