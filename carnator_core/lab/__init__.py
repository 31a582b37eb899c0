"""Benchmark support shared by the demo and the serving benchmarks (pure core: numpy/scipy/scikit-image only).

* ``workload``: the embedded-world request workload (warm set + disjoint stream with realistic repetition).
* ``metrics``:  per-request quality/safety measures (checker verdicts, PSNR/SSIM vs dense) and table summaries.
"""
