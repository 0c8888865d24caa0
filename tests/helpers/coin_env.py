"""A test env registered on import: the Calculator, one turn, reward = parity of the
reply's length, so a tiny random model's groups disagree and GRPO has something to learn.

Train it from the command line with ``--import coin_env`` (``tests/helpers`` on the path)
or the env id ``coin_env:CoinCalculator-v0``.
"""

import agentenv
from envs.calculator import CalculatorEnv


class CoinCalculator(CalculatorEnv):
    def step(self, action):
        obs, _, _, _, info = super().step(action)
        return obs, float(len(action) % 2), True, False, info


agentenv.register("CoinCalculator-v0", entry_point=CoinCalculator, override=True)
