# Carnator — two commands: `make demo` and `make test`. Both set up the local ComfyUI host first (idempotent).
PY := .host/venv/bin/python
PYTEST := $(PY) -m pytest

.PHONY: setup setup-host setup-registry-tools demo lint test test-reversed test-fast test-core test-server bench registry-check \
	clean-host

setup-host:
	@bash scripts/setup_host.sh

setup-registry-tools:
	@bash scripts/setup_registry_tools.sh

setup: setup-host setup-registry-tools
	@bash scripts/setup_browser.sh

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
	$(PY) scripts/bench_reuse.py --model embedded --repeats 5 --json artifacts/bench_reuse_embedded.json
	$(PY) scripts/bench_signature.py
	$(PY) scripts/bench_table1.py --warm 24 --stream 24

# Comfy Registry: `comfy node validate` + `comfy node pack` (comfy-cli, offline) on a copy of the tracked files,
# then checks of the package (what ships, what stays in the repo, size) -> artifacts/registry/node.zip, pack.json.
registry-check: setup-host setup-registry-tools
	$(PY) scripts/check_registry.py

clean-host:
	rm -rf .host
