# Carnator — two commands: `make demo` and `make test`. Both set up the local ComfyUI host first (idempotent).
PY := .host/venv/bin/python
PYTEST := $(PY) -m pytest

.PHONY: setup demo test test-fast test-core test-server bench clean-host

setup:
	@bash scripts/setup_host.sh
	@bash scripts/setup_browser.sh

demo: setup
	$(PY) scripts/demo.py

# The whole suite (core, in-process ComfyUI, live server, browser).
test: setup
	$(PYTEST) -q

test-fast: setup
	$(PYTEST) -q -m "not slow and not server and not browser"

test-server: setup
	$(PYTEST) -q -m "server or browser"

bench: setup
	$(PY) scripts/bench_all.py

clean-host:
	rm -rf .host
