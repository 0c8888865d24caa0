"""The stable hashes every bundled task set's split depends on: a change here moves tasks
between train and test, so the values are pinned."""

import subprocess
import sys

from agentenv.env.splits import hashed_split, stable_fraction, stable_hash


def test_values_are_pinned():
    assert stable_hash("a") == 4681665781835383343  # BLAKE2b-64 of b"a", big-endian
    assert stable_fraction("a") == 4681665781835383343 / 2**64
    assert 0.0 <= stable_fraction("") < 1.0


def test_the_same_under_another_hash_seed():
    code = "from agentenv.env.splits import stable_hash; print(stable_hash('question 7'))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("0", "1")
    }
    assert runs == {f"{stable_hash('question 7')}\n"}


def test_a_share_of_keys_picks_about_that_share():
    picked = sum(stable_fraction(f"task-{i}") < 0.3 for i in range(10_000))
    assert 2_850 < picked < 3_150  # 0.3 +- 3.3 binomial SE


def test_hashed_split_is_pinned_and_takes_its_share():
    assert 4681665781835383343 % 10_000 == 3343  # stable_hash("a") (pinned above)
    assert hashed_split("a", 0.3344) == "test" and hashed_split("a", 0.3343) == "train"
    tests = sum(hashed_split(f"task-{i}", 0.2) == "test" for i in range(10_000))
    assert 1_870 < tests < 2_130  # 0.2 +- 3.3 binomial SE
