"""Test utilities: N gloo ranks inside pytest, reference comparisons, a snippet in a fresh interpreter.
Only tests import this."""

from megalith.testing.compare import assert_states_close, max_abs_diff, state_of
from megalith.testing.script import run_python, run_triton
from megalith.testing.spawn import free_port, run_distributed

__all__ = [
    "assert_states_close",
    "free_port",
    "max_abs_diff",
    "run_distributed",
    "run_python",
    "run_triton",
    "state_of",
]
