"""The offline lab: tooling that makes and measures the runtime's inputs, never imported by the runtime core.

* ``pairs``:         labelled (request, candidate) pairs from a real model (the data a risk rule is made from).
* ``calibrate_cli``: ``python -m carnator_core.lab.calibrate_cli``: calibrate and certify a rule file.
* ``plan``:          choosing the calibration level by cross-validation (``calibrate_cli --plan``).
* ``synthetic``:     synthetic labelled pairs for tests of the calibration maths (no model).
* ``workload``:      the embedded-world request workload (warm set + disjoint stream with realistic repetition).
* ``metrics``:       per-request quality/safety measures (checker verdicts, PSNR/SSIM vs dense) and table summaries.

The lab may import anything in ``carnator_core``; nothing outside ``lab`` may import the lab
(tests/test_import_boundaries.py pins it). Scripts, tests and docs use it.
"""
