"""``python -m megalith.distributed.torchrun ARGS``: `torch.distributed.run` (same arguments) that
reports failed ranks in one line instead of the elastic agent's log lines and traceback.

The ranks print their own errors (megalith's commands print ``error: ...`` and exit 2); what a user
needs from the launcher is which ranks stopped and how. Without this wrapper, a rank that exits 2
on a typo in a path is followed by about forty lines of ``ChildFailedError`` report and agent
warnings. ``LOGLEVEL`` (the agent's log level, default here CRITICAL) brings those back.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any


def describe(failures: dict[int, Any]) -> tuple[str, int]:
    """One line naming the failed ranks (``failures``: rank -> ``ProcessFailure``, whose ``exitcode``
    is negative for a signal), the first (by time) leading: the others are often ranks the agent
    stopped with SIGTERM because of it. Also the exit code the launcher should return: the first
    failure's, or 128 + its signal number as a shell reports a signal."""
    first = min(failures, key=lambda r: failures[r].timestamp)
    code = failures[first].exitcode
    exit_code = 128 - code if code < 0 else code if 0 < code < 256 else 1
    line = f"error: rank {first} {_ended(code)}"
    others = [f"rank {r} {_ended(failures[r].exitcode)}" for r in sorted(failures) if r != first]
    if others:
        line += f", the first of {len(failures)} failed ranks ({'; '.join(others)})"
    return line + ("; each rank's own output is above" if others else "; its own output is above"), exit_code


def _ended(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def main(argv: Sequence[str] | None = None) -> int:
    if "LOGLEVEL" not in os.environ:  # the agent's own loggers read it; the others inherit this one
        os.environ["LOGLEVEL"] = "CRITICAL"
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as exc:
        line, code = describe(exc.failures)
        print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:  # the agent stopped the ranks and itself (Ctrl-C, SIGTERM)
        print(f"error: stopped by {exc.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
