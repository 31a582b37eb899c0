#!/usr/bin/env python
"""What Carnator costs and saves on a two-expert split schedule (Wan 2.2 14B's graph), against the stock graph.

    .host/venv/bin/python scripts/bench/bench_two_expert.py [--repeats 5] [--threads 2]

Two random-weight Wan models of the Wan 2.1/2.2-14B architecture family (different weights: a "high-noise" and a
"low-noise" expert, each behind ModelSamplingSD3 shift 8, as the stock workflow loads them), 20 euler steps split
at step 10, cfg 3.5, probe = the first 4 steps. One process, side by side in rotating order, medians of
``--repeats`` runs:

* ``stock``  two ``KSamplerAdvanced`` nodes (ComfyUI's own): [0, 10) on the high-noise expert with leftover noise,
             [10, 20) on the low-noise expert.
* ``miss``   ``request.serve(method="never", second_model=...)``: object extraction, Early Probe on the high-noise
             expert, signature, retrieval, filter, then both Joint Reuse Sampler stages dense (block recording
             included) — what a rejected request on the two-expert graph runs. A new seed every run; each run's
             latent is checked bit for bit against the stock graph's for the same seed.
* ``hit``    ``request.serve(method="prompt_only", exact=False, second_model=...)`` of a request identical to a
             cached one: the probe, then both stages reuse the entry (empty active region: no model call after the
             probe).
* ``exact``  the same request with exact answers on (the default): answered before the probe from the entry's two
             stored stage outputs, no model call.

Prints the medians, the ratios to ``stock`` and the model calls of each variant.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import setup  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)

STEPS, SWITCH, PROBE, CFG = 20, 10, 4, 3.5
LATENT = (16, 5, 16, 24)  # (C, T, H, W): patch (1, 2, 2) -> 5 x 8 x 12 = 480 tokens


def _expert(directory: Path, seed: int):
    """A random-weight Wan T2V model (16-channel latent, as Wan 2.1 / Wan 2.2 14B) loaded through ComfyUI's
    detection, behind ModelSamplingSD3 shift 8."""
    import comfy.ops
    import comfy.sd
    import tiny_models as tm
    from comfy.ldm.wan.model import WanModel
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3
    from safetensors.torch import save_file

    model = WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=256, ffn_dim=1024,
                     freq_dim=256, text_dim=tm.TEXT_DIM, out_dim=16, num_heads=2, num_layers=6,
                     operations=comfy.ops.disable_weight_init)
    tm._fill_(model, seed)
    path = directory / f"expert{seed}.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return ModelSamplingSD3().patch(comfy.sd.load_diffusion_model(str(path)), shift=8.0)[0]


def main() -> int:
    args = setup(__doc__, repeats=5)
    import comfy.utils
    import tiny_models as tm
    import torch

    comfy.utils.PROGRESS_BAR_ENABLED = False  # KSamplerAdvanced's console bar: noise in the output

    import nodes as comfy_nodes
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, ServeOptions, serve
    from carnator.carnator_core.types import Stage

    tmp = Path(tempfile.mkdtemp(prefix="carnator-two-expert-"))
    high, low = _expert(tmp, 0), _expert(tmp, 1)
    pos, neg = tm.conditioning("wan21")
    empty = {"samples": torch.zeros((1,) + LATENT)}
    store = Store.open(tmp / "store", key_path=tmp / "key")  # the entry the hits reuse
    miss_store = Store.open(tmp / "misses", key_path=tmp / "key")  # misses are written here, as the graph does
    calls = {"n": 0}
    for m in (high, low):
        dm = m.model.diffusion_model
        original = dm.forward

        def counting(*a, _orig=original, **kw):
            calls["n"] += 1
            return _orig(*a, **kw)

        dm.forward = counting

    def stock(seed: int) -> torch.Tensor:
        ks = comfy_nodes.KSamplerAdvanced()
        first = ks.sample(high, "enable", seed, STEPS, CFG, "euler", "simple", pos, neg, empty, 0, SWITCH,
                          "enable")[0]
        return ks.sample(low, "disable", seed, STEPS, CFG, "euler", "simple", pos, neg, first, SWITCH, 10000,
                         "disable")[0]["samples"]

    def carnator(seed: int, method: str, st=store, exact: bool = True):
        spec = RequestSpec("a red ball", seed, STEPS, CFG, objects="ball", stage=Stage(0, SWITCH, True, True))
        opts = ServeOptions(method=method, prompt_threshold=0.5, probe=ProbeConfig(probe_steps=PROBE), exact=exact)
        return serve(high, tm.WordTokens(), pos, neg, empty, spec, st, opts, second_model=low)

    stock(1)
    warm = carnator(7, "prompt_only")  # warms every lazy path and writes the entry the hits reuse
    assert warm.entry_id, "the warm-up request was not stored"
    variants = ("stock", "miss", "hit", "exact")
    wall: dict[str, list[float]] = {v: [] for v in variants}
    n_calls: dict[str, list[int]] = {v: [] for v in variants}
    identical = []
    for r in range(args.repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            calls["n"] = 0
            t0 = time.perf_counter()
            if v == "stock":
                stock(100 + r)
            elif v == "miss":
                res = carnator(200 + r, "never", miss_store)
            elif v == "hit":
                res = carnator(7, "prompt_only", exact=False)
                assert res.hit and not res.exact, res.report.summary()
            else:
                res = carnator(7, "prompt_only")
                assert res.exact, res.report.summary()
            wall[v].append(time.perf_counter() - t0)
            n_calls[v].append(calls["n"])
            if v == "miss":
                identical.append(bool(torch.equal(res.latent["samples"], stock(200 + r))))
    med = {v: statistics.median(wall[v]) for v in variants}
    print(f"two experts: Wan T2V dim 256 x 6 blocks, latent {LATENT} = 480 tokens, {STEPS} euler steps split at "
          f"{SWITCH}, cfg {CFG}, probe {PROBE}; {args.repeats} repeats, {args.threads} threads")
    for v in variants:
        print(f"  {v:6s} median {med[v]:.3f} s  = {med[v] / med['stock']:.3f}x stock   model calls "
              f"{statistics.median(n_calls[v]):.0f} (forward passes, CFG batched); runs "
              + " ".join(f"{t:.2f}" for t in wall[v]))
    print(f"  miss latents bit-identical to the stock graph: {sum(identical)}/{len(identical)}")
    return 0 if all(identical) else 1


if __name__ == "__main__":
    raise SystemExit(main())
