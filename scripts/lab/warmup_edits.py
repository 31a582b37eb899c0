#!/usr/bin/env python
"""How many real prompts yield a warm-up edit of each kind (carnator_core/learn/edits.py), and a sample to look at.

    .host/venv/bin/python scripts/lab/warmup_edits.py [--data ../shared/data/vidprom_4k.jsonl] [--n 1000] \\
        [--world 500] [--sample 3] [--json artifacts/warmup_edits.json]

For the first ``--n`` prompts of the VidProM sample (one ``{"id", "text"}`` per line) and for ``--world`` captions of
the embedded world (``world.caption`` of ``world.sample_scene``, seed 64), per kind: how many prompts yield an edit
(every edit is classified by ``risk.strata.stratum_of`` as its kind inside ``make_edit``; re-checked here), how
many of those change a word the prompt already had ("replace"/"rotate"/"synonym") and how many insert one
("insert"), and ``--sample`` edits per kind drawn with a fixed seed, printed for a person to read. Fails (exit 1)
when the data file is missing or holds fewer than ``--n`` prompts: a measurement never shrinks silently.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from repo_package import register_package  # noqa: E402  (the one repo-as-package bootstrap)

register_package()

import numpy as np  # noqa: E402

from carnator.carnator_core.embedded import world  # noqa: E402
from carnator.carnator_core.learn.edits import KINDS, make_edits  # noqa: E402
from carnator.carnator_core.risk.strata import stratum_of  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "vidprom_4k.jsonl"


def measure(prompts: list[str], vocabulary: str, sample: int, seed: int = 64) -> dict:
    """Per kind: prompts with an edit, of them by way of change, and a fixed-seed sample of edits."""
    counts = {k: {"edits": 0, "insert": 0, "change": 0} for k in KINDS}
    edits: dict[str, list[dict]] = {k: [] for k in KINDS}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        for kind, e in make_edits(p, 1000 + i, vocabulary=vocabulary).items():
            got = stratum_of(e.prompt, e.source, same_seed=e.seed == e.source_seed)
            if got != kind:
                raise AssertionError(f"edit claims {kind}, strata read {got}: {e}")
            counts[kind]["edits"] += 1
            counts[kind]["insert" if e.how.startswith("insert") else "change"] += 1
            edits[kind].append(e.to_dict())
    secs = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    looked = {k: [v[int(j)] for j in sorted(rng.choice(len(v), size=min(sample, len(v)), replace=False))]
              for k, v in edits.items() if v}
    return {"prompts": len(prompts), "vocabulary": vocabulary, "counts": counts, "seconds": round(secs, 1),
            "ms_per_prompt": round(1000 * secs / max(len(prompts), 1), 1), "sample": looked}


def _window(a: str, b: str, width: int = 150) -> tuple[str, str]:
    """The two prompts cut to ``width`` characters around where they first differ ("…" marks a cut)."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, min(i - width // 2, max(len(a), len(b)) - width))

    def cut(s: str) -> str:
        return ("…" if start > 0 else "") + s[start:start + width] + ("…" if start + width < len(s) else "")

    return cut(a), cut(b)


def table(res: dict) -> str:
    lines = [f"{res['prompts']} prompts ({res['vocabulary']}), {res['ms_per_prompt']} ms per prompt for all kinds",
             "", "| kind | prompts with an edit | of them: a word changed | a word inserted |", "|---|---|---|---|"]
    for k, c in res["counts"].items():
        lines.append(f"| {k} | {c['edits']} ({100 * c['edits'] / max(res['prompts'], 1):.1f} %) | {c['change']} | "
                     f"{c['insert']} |")
    lines.append("")
    for k, es in res["sample"].items():
        for e in es:
            a, b = _window(e["source"], e["prompt"])
            lines.append(f"* {k} ({e['how']}): `{a}` -> `{b}`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--world", type=int, default=500)
    ap.add_argument("--sample", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if not a.data.is_file():
        print(f"no data file {a.data}", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in a.data.read_text(encoding="utf-8").split("\n") if line.strip()]
    if len(rows) < a.n:
        print(f"{a.data} holds {len(rows)} prompts, fewer than --n {a.n}", file=sys.stderr)
        return 1
    out = {"vidprom": measure([r["text"] for r in rows[:a.n]], "english", a.sample)}
    rng = np.random.default_rng(64)
    captions = [world.caption(world.sample_scene(rng), rng) for _ in range(a.world)]
    out["embedded"] = measure(captions, "embedded", a.sample)
    for res in out.values():
        print(table(res))
        print()
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
