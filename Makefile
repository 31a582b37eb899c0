# Carnator — two commands: `make demo` and `make test`. Both set up the local ComfyUI host first (idempotent).
PY := .host/venv/bin/python
PYTEST := $(PY) -m pytest

.PHONY: setup setup-host setup-registry-tools demo lint test test-reversed test-fast test-core test-server bench \
	bench-table1 workload workflows pairs rule-report axes floor registry-check clean-host

setup-host:
	@bash scripts/setup/setup_host.sh

setup-registry-tools:
	@bash scripts/setup/setup_registry_tools.sh

setup: setup-host setup-registry-tools
	@bash scripts/setup/setup_browser.sh

# The demo needs no browser: only the host (keeps a fresh clone's `make demo` inside its 10 minutes).
demo: setup-host
	$(PY) scripts/demo.py

# ruff (config in pyproject.toml): pyflakes, pycodestyle, import order, lines <= 120.
lint: setup-host
	$(PY) -m ruff check .

# The whole suite (core, in-process ComfyUI, live server, browser), after the linter.
test: setup lint
	$(PYTEST) -q

# The whole suite in reverse order (no test may depend on another having run first; tests/pytest_carnator.py).
test-reversed: setup
	$(PYTEST) -q --order reverse

test-fast: setup
	$(PYTEST) -q -m "not slow and not server and not browser"

test-server: setup
	$(PYTEST) -q -m "server or browser"

# The benchmarks that run in minutes on 2 cores (each prints JSON/Markdown; BENCHMARKS.md lists every benchmark
# with its exact command, including the long ones: cache at 1M entries, random-weight Wan at 8k tokens).
bench: setup-host
	$(PY) scripts/bench/bench_reuse.py --model embedded --repeats 5 --json artifacts/bench_reuse_embedded.json
	$(PY) scripts/bench/bench_signature.py
	$(PY) scripts/bench/bench_table1.py --warm 24 --stream 24

# The serving benchmark alone (Table 1 on the embedded model; BENCHMARKS.md "Serving benchmark"), and the workload
# it serves (statistics and digest).
bench-table1: setup-host
	$(PY) scripts/bench/bench_table1.py --warm 24 --stream 24 --json artifacts/table1.json --md artifacts/table1.md

workload: setup-host
	$(PY) scripts/bench/workload.py --warm 24 --stream 24 --seed 0

# Re-render the example workflows (UI and API format) from the node definitions of a temporary server.
workflows: setup-host
	$(PY) scripts/setup/make_workflows.py

# The calibration lab (docs/CALIBRATION.md). Labelled pairs on the embedded model (resumable: re-run to continue),
# what a rule does per kind of request, and the floor of the excess label. Override the variables, e.g.
# `make pairs SEED=82 QUERIES=100 WORKERS=2`, `make rule-report PAIRS=... RULE=...`.
SEED ?= 0
QUERIES ?= 300
WORKERS ?= 1
PAIRS ?= rules/embedded_pairs.jsonl
RULE ?= rules/embedded.json

pairs: setup-host
	OMP_NUM_THREADS=1 $(PY) scripts/lab/make_pairs.py --out artifacts/pairs_s$(SEED).jsonl \
		--work artifacts/pairs_work_s$(SEED) --seed $(SEED) --queries $(QUERIES) --workers $(WORKERS) --threads 1

rule-report: setup-host
	$(PY) scripts/lab/rule_report.py --pairs $(PAIRS) --rule $(RULE)

# Whether the signature's axes separate safe from unsafe reuses where the region cannot repair (rules/protocols/axes.md).
axes: setup-host
	OMP_NUM_THREADS=1 $(PY) scripts/lab/axis_separation.py --out artifacts/axes/pairs.jsonl --work artifacts/axes/work \
		--seed 53 --per-kind 25
	$(PY) scripts/lab/axis_separation.py --out artifacts/axes/pairs.jsonl --report --json artifacts/axes/summary.json

floor: setup-host
	OMP_NUM_THREADS=1 $(PY) scripts/lab/measure_label_floor.py --queries $(QUERIES) --threads 1 \
		--out artifacts/label_floor.jsonl --json artifacts/label_floor.json --png artifacts/label_floor_png

# Comfy Registry: `comfy node validate` + `comfy node pack` (comfy-cli, offline) on a copy of the tracked files,
# then checks of the package (what ships, what stays in the repo, size) -> artifacts/registry/node.zip, pack.json.
registry-check: setup-host setup-registry-tools
	$(PY) scripts/setup/check_registry.py

clean-host:
	rm -rf .host
