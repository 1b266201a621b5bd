"""Pipeline schedules: simulated bubble ratio per schedule and measured CPU step time.

    uv run python benchmarks/pp_schedules.py --steps 3    # simulated grid + measured step times
    uv run python benchmarks/pp_schedules.py --simulated-only

Simulated part: `megalith.pipeline.simulate` with F = 1, B = 2 (split B = W = 1) per whole
microbatch (1/v of that per chunk), free communication, non-blocking sends ("buffered" p2p).
bubble_ratio = (makespan − busy) / busy; closed forms: GPipe / 1F1B (p−1)/m, interleaved
(p−1)/(v·m), ZB-H1 (p−1)/(3m). Also records the peak in-flight activations per rank and whether
the schedule also runs with rendezvous (blocking) sends batched between computations.

Measured part (`benchmarks/pp_measure.py`, `measured_rows`): median step time on CPU with gloo
(pp=2 × dp=2, 4 ranks) per schedule, through `booster.execute_pipeline` and an AdamW step.

Writes benchmarks/results/pp_schedules.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

PS = (2, 4)
MS = (4, 8, 16)
VS = (1, 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--simulated-only", action="store_true", help="skip the measured step-time part even if available"
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per schedule in the measured part")
    p.add_argument(
        "--out", default="pp_schedules.json", help="file name of the result under benchmarks/results/"
    )
    return p.parse_args(argv)


def _closed_form(name: str, p: int, m: int, v: int) -> float | None:
    if name in ("gpipe", "1f1b"):
        return (p - 1) / m
    if name == "interleaved":
        return (p - 1) / (v * m)
    if name == "zb-h1":
        return (p - 1) / (3 * m)
    return None


def _row(name: str, p: int, m: int, v: int) -> dict[str, Any]:
    from megalith.pipeline import ScheduleError, make_schedule, simulate

    schedule = make_schedule(name, p, m, v)
    result = simulate(schedule)
    try:
        batched: float | None = simulate(schedule, p2p="batched").bubble_ratio
    except ScheduleError:
        batched = None
    return {
        "schedule": name,
        "p": p,
        "m": m,
        "v": schedule.num_chunks,
        "bubble_ratio": result.bubble_ratio,
        "closed_form": _closed_form(name, p, m, schedule.num_chunks),
        "makespan": result.makespan,
        "busy_per_rank": result.busy[0],
        "peak_activations": list(result.peak_activations),
        "bubble_ratio_batched_rendezvous": batched,
    }


def simulated_rows() -> list[dict[str, Any]]:
    """One row per (schedule, p, m, v) of the grid; fixed-chunk schedules appear once per (p, m)."""
    from megalith.pipeline import SCHEDULES

    rows = []
    for name, spec in SCHEDULES.items():
        vs = VS if spec.chunks is None else (spec.chunks,)
        for p in PS:
            for m in MS:
                if m < p:
                    continue
                for v in vs:
                    if name == "interleaved" and m % p:
                        continue
                    rows.append(_row(name, p, m, v))
    return rows


def measured_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measured step time per schedule on CPU with gloo (pp=2, 4 ranks: dp=2 × pp=2), from
    benchmarks/pp_measure.py (a `torch.distributed.run` child process)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pp_measure import measured_rows as measure

    return measure(args)


def _print_measured(rows: list[dict[str, Any]]) -> None:
    print(f"{'schedule':12s} {'p':>2s} {'dp':>2s} {'m':>3s} {'v':>2s} {'step':>9s}")
    for r in rows:
        print(
            f"{r['schedule']:12s} {r['p']:2d} {r['dp']:2d} {r['m']:3d} {r['v']:2d} {r['step_time_s']:8.3f}s"
        )


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'schedule':12s} {'p':>2s} {'m':>3s} {'v':>2s} {'bubble':>8s} {'closed':>8s} {'peak act.':>14s}")
    for r in rows:
        closed = "" if r["closed_form"] is None else f"{r['closed_form']:8.4f}"
        peak = ",".join(map(str, r["peak_activations"]))
        print(
            f"{r['schedule']:12s} {r['p']:2d} {r['m']:3d} {r['v']:2d} {r['bubble_ratio']:8.4f} {closed:>8s} {peak:>14s}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = simulated_rows()
    _print_table(rows)
    payload: dict[str, Any] = {"simulated": rows, "cost_model": {"F": 1, "B": 2, "B_split": 1, "W": 1}}
    if args.simulated_only:
        print("measured part skipped (--simulated-only)")
    else:
        payload["measured"] = measured_rows(args)
        _print_measured(payload["measured"])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import write_result

    path = write_result(args.out, payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
