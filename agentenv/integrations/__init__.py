"""Use agentenv environments from other RL libraries: one small module per library.

Each module imports its library on use; install the extra first:

* :mod:`agentenv.integrations.trl`: ``environment_factory``, dataset and reward for TRL's
  ``GRPOTrainer`` (``pip install 'agentenv[trl]'``).
* :mod:`agentenv.integrations.skyrl`: a skyrl-gym ``BaseTextEnv``
  (``pip install 'agentenv[skyrl]'``).
* :mod:`agentenv.integrations.verifiers`: a verifiers (>= 0.4) taskset, env and harness,
  loaded by verifiers as the plugin ``agentenv-verifiers``
  (``pip install 'agentenv[verifiers]'``).
* :mod:`agentenv.integrations.openenv`: any env served as an OpenEnv server (``agentenv
  serve``), OpenEnv servers as agentenv envs (``OpenEnv-v0``), and TRL on a served env
  (``pip install 'agentenv[openenv]'``).
* :mod:`agentenv.integrations.gem`: the ids in GEM's registry, for ``gem.make`` and its
  vector envs (``pip install --no-deps gem-llm``).
* :mod:`agentenv.integrations.verl`: a verl agent loop (``agent_name: agentenv``) that
  plays one episode per dataset row through verl's inference servers (``pip install
  --no-deps verl==0.9.1 ray ...`` as ``install.sh`` does).

Plain Gymnasium needs no module: ``gymnasium.make("agentenv/Calculator-v0")`` and
``gymnasium.make_vec(..., vectorization_mode="sync" | "async")`` work after ``import agentenv``.
All of them build on :func:`task_rows`: one row per task of a split, the env's opening
messages and the ``task_id`` that resets an env to that task.
"""

from agentenv.integrations.rows import task_rows

__all__ = ["task_rows"]
