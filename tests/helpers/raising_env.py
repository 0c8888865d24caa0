"""``RaisingCalculator-v0``: a Calculator whose every step raises (a tool backend that is
down), for the tests of how integrations end such an episode."""

import agentenv
from envs.calculator import CalculatorEnv


class RaisingCalculator(CalculatorEnv):
    def step(self, action):
        raise RuntimeError("the tool's backend is down")


agentenv.register("RaisingCalculator-v0", entry_point=RaisingCalculator, override=True)
