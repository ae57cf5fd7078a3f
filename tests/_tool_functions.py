"""Tool functions of the tool tests, in a module that imports nothing heavy: a tool runs in a process of its own
(`rollout/tool_calling/runner.py`), which imports the tool's module."""

from __future__ import annotations

import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def hang(seconds: float) -> str:
    """Wait.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"
