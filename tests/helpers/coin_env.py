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


class RankCrash(CoinCalculator):
    """CoinCalculator whose process is SIGKILLed (a segfaulting tool, the OOM killer) at
    its ``crash_at``-th step on rank 1 of a multi-process run, once: the crash leaves the
    file ``$COIN_CRASH_MARKER`` behind, and a run that finds it does not crash again."""

    calls = 0

    def step(self, action):
        import os
        import signal
        from pathlib import Path

        RankCrash.calls += 1
        marker = Path(os.environ["COIN_CRASH_MARKER"])
        crash_at = int(os.environ.get("COIN_CRASH_AT", "5"))
        if os.environ.get("RANK") == "1" and RankCrash.calls == crash_at and not marker.exists():
            marker.write_text(repr(__import__("time").time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


agentenv.register("RankCrash-v0", entry_point=RankCrash, override=True)
