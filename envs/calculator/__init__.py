"""Calculator env: math word problems with a safe calculator tool (``agentenv/Calculator-v0``)."""

from envs.calculator.env import CalculatorEnv, calculator, parse_number
from envs.calculator.errors import CalculatorError
from envs.calculator.safe_eval import evaluate, format_number
from envs.calculator.tasks import SOURCES, load_tasks, parse_gsm8k_answer, split_of

__all__ = [
    "SOURCES",
    "CalculatorEnv",
    "CalculatorError",
    "calculator",
    "evaluate",
    "format_number",
    "load_tasks",
    "parse_gsm8k_answer",
    "parse_number",
    "split_of",
]
