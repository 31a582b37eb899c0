"""Cost of one excess label by the native judge against one dense run, side by side in one process.

    nice -n 10 .host/venv/bin/python scripts/lab/bench_judge_cost.py [--repeats 3]

For the embedded model (default weights, 20 euler steps, its stock CFG) and a tiny random-weight Wan 2.1 (the test
fixture's, 20 steps, CFG 5): model calls (forward passes of the diffusion backbone; ComfyUI batches cond and uncond
into one) and wall time of (a) a dense generation and (b) one label = the dense clip's reference + one reuse clip's
judge_pair (both with the candidate's source prompt as the alternative), alternating, medians over ``--repeats``.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)


def _side_by_side(dense, label, model, repeats: int) -> dict:
    import tiny_models as tm

    rows = []
    for _ in range(repeats):
        with tm.count_calls(model) as c1:
            t0 = time.perf_counter()
            out = dense()
            t_dense = time.perf_counter() - t0
        with tm.count_calls(model) as c2:
            t0 = time.perf_counter()
            label(out)
            t_label = time.perf_counter() - t0
        rows.append((len(c1), t_dense, len(c2), t_label))
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    return {"dense_calls": med[0], "dense_s": round(med[1], 3), "label_calls": med[2], "label_s": round(med[3], 3),
            "calls_ratio": round(med[2] / med[0], 3),
            "time_ratio": round(statistics.median(r[3] / r[1] for r in rows), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(args.threads)
    import tiny_models as tm

    import nodes as comfy_nodes
    from carnator.carnator_core.embedded import codec, comfy_glue
    from carnator.carnator_core.judge import JudgeRequest, excess_label
    from carnator.carnator_core.judge.native import NativeJudge

    out = {}
    model, enc, _ = comfy_glue.load_embedded()
    prompt = "a big red ball moves to the right in the top left, on green grass"
    source = "a big blue ball moves to the right in the top left, on green grass"
    nj = NativeJudge(model, enc.encode, enc, vae_encode=lambda c: codec.rgb_to_latent(c)[None])
    req = JudgeRequest(prompt, seed=3, source_prompt=source)
    out["embedded"] = _side_by_side(lambda: comfy_glue.generate([prompt], seed=3, model=model).clips[0].numpy(),
                                    lambda clip: excess_label(nj, clip, clip, req), model, args.repeats)
    with tempfile.TemporaryDirectory() as d:
        m = tm.load_tiny_model("wan21", Path(d))

        def encode(p: str):
            return tm.conditioning("wan21", seed=1 + sum(p.encode()) % 1000)[0]

        def dense():
            return comfy_nodes.common_ksampler(m, 3, 20, 5.0, "euler", "simple", encode(prompt), encode(""),
                                               tm.empty_latent("wan21"))[0]["samples"]

        tj = NativeJudge(m, encode, tm.WordTokens())

        def label(lat):
            clip = torch.rand(3, 16, 16, 3).numpy()  # colours only: the tiny model has no VAE
            excess_label(tj, clip, clip, JudgeRequest("a red ball", seed=3, source_prompt="a blue ball",
                                                      extra={"latent": lat, "reuse_latent": lat}))

        out["tiny_wan21"] = _side_by_side(dense, label, m, args.repeats)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
