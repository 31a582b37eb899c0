#!/usr/bin/env python
"""What the catalogue's open-time integrity check costs, by catalogue size (justifies QUICK_CHECK_MAX_BYTES).

    .host/venv/bin/python scripts/bench/bench_catalog_open.py [--sizes 1000,5000,20000] [--dim 4096] [--repeats 3]

For each size: a catalogue with that many entries (real schema, ``--dim``-float embeddings, as the store writes
them; no entry files) is built in a temp dir, then, side by side in one process, medians of ``--repeats``:

* ``connect``       connect + schema/format checks (what every open does),
* ``quick_check``   the same plus ``PRAGMA quick_check`` (what opens of catalogues up to the limit add).

Prints catalogue MB, both medians (ms, wall and CPU) and the extra cost per MB.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402,F401  (registers the `carnator` package)

from carnator.carnator_core.cache import catalog  # noqa: E402


def build(path: Path, n: int, dim: int) -> None:
    conn = catalog.connect(path, wal=False)
    conn.execute("BEGIN")
    catalog.create(conn)
    conn.execute("INSERT INTO namespaces VALUES ('ns', 'fp', '{}', ?, 'tok', 0, -1, 0)", (dim,))
    rng = np.random.default_rng(0)
    for i in range(n):
        conn.execute("INSERT INTO entries(id, namespace, prompt, prompt_digest, seed, nbytes, meta_digest, work,"
                     " priority, created, last_access, hits) VALUES (?, 'ns', ?, ?, '0', 1, 'd', 1, 1, 0, 0, 0)",
                     (f"{i:016x}", f"prompt {i}", f"{i:064x}"))
        conn.execute("INSERT INTO embeddings(seq, vec) VALUES (?, ?)",
                     (i + 1, rng.standard_normal(dim).astype(np.float32).tobytes()))
    catalog.mark_complete(conn)
    conn.execute("COMMIT")
    conn.close()


def timed(path: Path, integrity: bool) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    conn = catalog.connect(path)
    assert catalog.problem(conn, integrity=integrity) is None
    conn.close()
    return (time.perf_counter() - w) * 1000, (time.process_time() - c) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,5000,20000")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print("| entries | catalogue (MB) | open wall / CPU (ms) | open + quick_check wall / CPU (ms) "
          "| extra CPU ms per MB |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.sizes.split(",")):
            path = Path(tmp) / f"c{n}.sqlite3"
            build(path, n, args.dim)
            mb = path.stat().st_size / 2**20
            runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(args.repeats):
                for integrity in (False, True):  # alternating: both variants see the same page-cache state
                    runs[integrity].append(timed(path, integrity))
            med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
            extra = (med[True][1] - med[False][1]) / mb
            print(f"| {n} | {mb:.0f} | {med[False][0]:.1f} / {med[False][1]:.1f} | {med[True][0]:.1f} / "
                  f"{med[True][1]:.1f} | {extra:.2f} |")


if __name__ == "__main__":
    main()
