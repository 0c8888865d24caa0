import gymnasium as gym
import pytest

import agentenv
from agentenv.env.registration import full_id
from agentenv.errors import InvalidOptionError, RegistrationError, UnknownEnvError


@pytest.fixture
def tiny_env_id():
    env_id = "TestTiny-v0"
    agentenv.register(env_id, entry_point="envs.calculator:CalculatorEnv", num_tasks=3)
    yield env_id
    agentenv.deregister(env_id)
    assert full_id(env_id) not in gym.registry


def test_bundled_env_is_in_gymnasium_registry():
    assert "agentenv/Calculator-v0" in agentenv.registry()
    env = gym.make("agentenv/Calculator-v0")
    assert env.unwrapped is env  # no wrappers: attributes like num_tasks are reachable
    assert env.spec.id == "agentenv/Calculator-v0"
    assert env.num_tasks > 0


def test_make_accepts_short_id_and_merges_kwargs(tiny_env_id):
    env = agentenv.make(tiny_env_id, split="test")
    assert env.num_tasks == 3  # registered default kept
    assert env.split == "test"  # caller's kwarg applied
    env = agentenv.make(tiny_env_id, num_tasks=2)
    assert env.num_tasks == 2  # caller overrides registered default


def test_unknown_id_suggests_close_matches():
    with pytest.raises(UnknownEnvError) as err:
        agentenv.make("Calculater-v0")
    assert "Did you mean 'agentenv/Calculator-v0'" in str(err.value)
    assert "agentenv list" in str(err.value)


def test_register_refuses_duplicates_and_bad_entry_points(tiny_env_id):
    with pytest.raises(RegistrationError, match="already registered"):
        agentenv.register(tiny_env_id, entry_point="envs.calculator:CalculatorEnv")
    agentenv.register(tiny_env_id, entry_point="envs.calculator:CalculatorEnv", override=True)
    with pytest.raises(RegistrationError, match="package.module:ClassName"):
        agentenv.register("Other-v0", entry_point="envs.calculator.CalculatorEnv")


def test_a_misspelt_constructor_argument_names_the_closest_one():
    with pytest.raises(InvalidOptionError) as err:
        agentenv.make("Calculator-v0", sourc="word_problems")
    message = str(err.value)
    assert "takes no argument 'sourc'" in message and "did you mean 'source'?" in message
    assert "its arguments: split, source, num_tasks" in message
    agentenv.make("Calculator-v0", source="word_problems", max_episode_steps=3).close()


def test_an_env_that_takes_any_keyword_is_not_checked():
    def factory(**kwargs):
        return gym.make("agentenv/Calculator-v0", num_tasks=kwargs["num_tasks"])

    agentenv.register("AnyKwargs-v0", entry_point=factory)
    try:
        assert agentenv.make("AnyKwargs-v0", num_tasks=2, whatever=1).num_tasks == 2
    finally:
        agentenv.deregister("AnyKwargs-v0")


def test_gymnasium_module_prefix_imports_agentenv():
    env = gym.make("agentenv:agentenv/Calculator-v0")
    assert env.spec.namespace == "agentenv"


# Small, offline settings per bundled id (the defaults work too, but build bigger things).
BUNDLED_KWARGS = {
    "agentenv/Calculator-v0": {},
    "agentenv/RAG-v0": {"chroma": "memory", "num_tasks": 4},
    "agentenv/Workspace-v0": {"sandbox": "rlimit", "num_tasks": 4},
    "agentenv/BFCL-v0": {"num_tasks": 4},  # needs bfcl-eval (install.sh installs it)
}


def test_every_bundled_id_is_covered_here():
    bundled = {i for i, s in agentenv.registry().items() if str(s.entry_point).startswith("envs.")}
    assert bundled == set(BUNDLED_KWARGS)


@pytest.mark.parametrize("env_id", sorted(BUNDLED_KWARGS))
def test_check_env_on_every_bundled_id_through_gymnasium(env_id):
    from gymnasium.utils.env_checker import check_env

    if env_id == "agentenv/BFCL-v0":
        pytest.importorskip("bfcl_eval", reason="bfcl-eval is not installed (install.sh does)")
    env = gym.make(env_id, **BUNDLED_KWARGS[env_id])
    try:
        check_env(env.unwrapped, skip_render_check=True)
        obs, info = env.reset(seed=3)
        assert env.observation_space.contains(obs)
        assert obs[0]["role"] == "system" and obs[-1]["role"] == "user"
    finally:
        env.close()
