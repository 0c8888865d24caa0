"""Errors of the Calculator env, under agentenv's single hierarchy.

:class:`CalculatorError` is a :class:`~agentenv.errors.ToolError`: raised inside a
``calculator`` call, the executor turns it into an ``Error: ...`` observation and
counts it in ``info["tool_errors"]`` under its ``kind`` (``"calculator"``).
"""

from __future__ import annotations

from agentenv.errors import ToolError


class CalculatorError(ToolError, ValueError):
    """An expression the safe calculator refuses (too big, not allowed, division by zero)."""

    kind = "calculator"
