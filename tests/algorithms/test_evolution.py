"""Tournament selection, slots and mutation, hand-checked with scripted draws."""

import random

import pytest

from agentenv.errors import InvalidOptionError
from algorithms.config import EvolutionConfig
from algorithms.evolution import assign_slots, mutate, next_generation, tournament


class Scripted:
    """A ``random.Random`` stand-in that returns the scripted draws in order."""

    def __init__(self, samples=(), choices=(), randoms=()):
        self.samples, self.choices, self.randoms = list(samples), list(choices), list(randoms)

    def sample(self, population, k):
        drawn = self.samples.pop(0)
        assert len(drawn) == k and set(drawn) <= set(population)
        return drawn

    def choice(self, seq):
        value = self.choices.pop(0)
        assert value in seq
        return value

    def random(self):
        return self.randoms.pop(0)


FITNESS = [0.1, 0.9, 0.5, 0.3]


def test_tournament_keeps_the_elite_then_takes_each_draws_fittest():
    rng = Scripted(samples=[[0, 3], [2, 0], [3, 2]])
    # elite: member 1 (0.9); {0, 3} -> 3 (0.3); {2, 0} -> 2; {3, 2} -> 2
    assert tournament(FITNESS, rng, tournament_size=2, elitism=True) == [1, 3, 2, 2]
    rng = Scripted(samples=[[0, 1], [0, 3], [2, 3], [0, 2]])
    assert tournament(FITNESS, rng, tournament_size=2, elitism=False) == [1, 3, 2, 2]


def test_ties_go_to_the_lower_index_and_a_large_tournament_takes_everyone():
    rng = Scripted(samples=[[3, 1, 2, 0]] * 3)  # size 9 of 4 members: all 4 each time
    assert tournament([0.5, 0.5, 0.2, 0.5], rng, tournament_size=9, elitism=True) == [0] * 4


def test_winners_keep_their_own_slots_and_losers_take_the_extra_places():
    assert assign_slots([1, 3, 2, 2]) == [2, 1, 2, 3]  # loser 0 gets 2's second place
    assert assign_slots([1, 1, 2, 1]) == [1, 1, 2, 1]  # losers 0 and 3 get 1's copies
    assert assign_slots([2, 0, 2, 2]) == [0, 2, 2, 2]
    assert assign_slots([0, 1, 2]) == [0, 1, 2]  # everyone chosen once: nothing moves


def test_a_mutation_multiplies_one_value_and_clips_it_to_its_bounds():
    hp = {"learning_rate": 1e-4, "beta": 0.0, "temperature": 1.0, "entropy_coef": 0.0}
    bounds = {"learning_rate": [1e-6, 1.5e-4], "temperature": [0.1, 2.0]}
    names = ["learning_rate", "beta", "temperature", "entropy_coef"]
    new, change = mutate(hp, Scripted(choices=["temperature", 0.5]), names, [0.5, 2], bounds)
    assert new == {**hp, "temperature": 0.5} and change == {"temperature": (1.0, 0.5)}
    assert hp["temperature"] == 1.0  # the input is not changed
    new, change = mutate(hp, Scripted(choices=["learning_rate", 2]), names, [0.5, 2], bounds)
    assert new["learning_rate"] == 1.5e-4 and change == {"learning_rate": (1e-4, 1.5e-4)}
    # beta and entropy_coef are 0: never drawn (a product of 0 stays 0)
    zero = {"learning_rate": 1e-4, "beta": 0.0, "temperature": 1.0, "entropy_coef": 0.0}
    new, change = mutate(zero, Scripted(), ["beta", "entropy_coef"], [2.0], bounds)
    assert new == zero and change == {}


def test_the_next_generation_copies_winners_onto_losers_and_spares_the_elite():
    config = EvolutionConfig(population=4, tournament_size=2, mutation_prob=0.5)
    hps = [
        {"learning_rate": lr, "beta": 0.0, "temperature": 1.0, "entropy_coef": 0.0}
        for lr in (1e-5, 2e-5, 3e-5, 4e-5)
    ]
    rng = Scripted(
        samples=[[0, 3], [2, 0], [3, 2]],  # parents [1, 3, 2, 2] -> slots [2, 1, 2, 3]
        randoms=[0.1, 0.9, 0.2],  # slot 0 mutates, slot 2 does not, slot 3 mutates
        choices=["learning_rate", 2.0, "temperature", 0.5],
    )
    children = next_generation(FITNESS, hps, rng, config)
    assert [(c.slot, c.parent, c.elite) for c in children] == [
        (0, 2, False),
        (1, 1, True),
        (2, 2, False),
        (3, 3, False),
    ]
    assert children[0].hyperparameters["learning_rate"] == 6e-5  # 2's 3e-5, doubled
    assert children[0].mutation == {"learning_rate": (3e-5, 6e-5)}
    assert children[1].hyperparameters == hps[1] and children[1].mutation == {}  # the elite
    assert children[2].hyperparameters == hps[2] and children[2].mutation == {}
    assert children[3].hyperparameters == {**hps[3], "temperature": 0.5}
    assert not (rng.samples or rng.randoms or rng.choices)  # every draw was used


def test_an_evolution_is_a_function_of_its_seed():
    config = EvolutionConfig(population=6, tournament_size=3, mutation_prob=1.0)
    hps = [
        {"learning_rate": 1e-5 * (i + 1), "beta": 0.01, "temperature": 1.0, "entropy_coef": 0.0}
        for i in range(6)
    ]
    fitness = [0.2, 0.4, 0.1, 0.8, 0.3, 0.5]
    runs = [next_generation(fitness, hps, random.Random("0-5-evolve"), config) for _ in range(2)]
    assert runs[0] == runs[1]
    other = next_generation(fitness, hps, random.Random("1-5-evolve"), config)
    assert other != runs[0]
    assert runs[0][3].elite and runs[0][3].parent == 3 and runs[0][3].mutation == {}
    assert all(c.mutation for c in runs[0] if not c.elite)  # mutation_prob 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"population": 0}, "population must be >= 1"),
        ({"mutate": ["lr"]}, r"mutate names \['lr'\]"),
        ({"population": 2, "member_start": {"learning_rate": [1e-5]}}, "1 values for a"),
        ({"population": 2, "member_start": {"temperature": [1.0, 0.0]}}, "values > 0"),
        ({"mutation_bounds": {"beta": [1.0, 0.5]}}, r"\[low, high\]"),
        ({"mutation_factors": []}, "mutation_factors must be"),
    ],
)
def test_bad_evolution_settings_are_named(kwargs, match):
    with pytest.raises(InvalidOptionError, match=match):
        EvolutionConfig(**kwargs)
