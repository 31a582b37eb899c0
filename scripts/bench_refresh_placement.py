"""Forced cache hits (scripts/bench_hits.py, same arguments) with the dense refresh calls placed at given
fractions of the resumed calls instead of ``reuse.refresh_plan_calls``' even spacing.

    CARNATOR_REFRESH_AT=0.5,0.833 python scripts/bench_refresh_placement.py --warm 8 --queries 24 --probe-steps 2 \\
        --variant "a15:probe_context=1;context_margin_blocks=0" --json artifacts/hits_late.json

A measurement tool for choosing a placement before certifying one: the runtime has no such setting, and rules
certify the even spacing. It replaces the planning function in this process only.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hits  # noqa: E402  (registers the package)

from carnator.carnator_core import reuse  # noqa: E402


def main() -> int:
    raw = os.environ.get("CARNATOR_REFRESH_AT", "")
    try:
        fractions = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"CARNATOR_REFRESH_AT must be comma-separated fractions in [0, 1), got {raw!r}")
    if not fractions or not all(0.0 <= f < 1.0 for f in fractions):
        raise SystemExit("set CARNATOR_REFRESH_AT to the dense refresh calls' places, fractions in [0, 1) of the "
                         "calls after the probe, e.g. 0.5,0.833")
    even = reuse.refresh_plan_calls

    def placed(steps: int, probe_steps: int, refreshes: int, probe_record: bool = False) -> frozenset:
        n = steps - probe_steps
        calls = frozenset(probe_steps + min(n - 1, int(round(f * n))) for f in fractions)
        print(f"dense refresh calls {sorted(calls)} (even spacing: "
              f"{sorted(even(steps, probe_steps, refreshes, probe_record))})", flush=True)
        return calls

    reuse.refresh_plan_calls = placed
    return bench_hits.main()


if __name__ == "__main__":
    raise SystemExit(main())
