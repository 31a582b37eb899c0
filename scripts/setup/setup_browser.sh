#!/usr/bin/env bash
# Sets up what the browser tests (tests/test_browser.py) need, idempotently:
#
# 1. Debian's Chromium. The tests drive /usr/bin/chromium with the Python `playwright` package from
#    requirements-dev.txt; Playwright's own browser download (`playwright install`) is never used. Needs root
#    (apt-get) on first run only.
# 2. The newest ComfyUI frontend tested (comfyui-frontend-package from PyPI, pinned below) in its own folder,
#    .host/frontends/<version>/, served by the test server with `--front-end-root`. It must not go into the host
#    venv: there it would replace the frontend ComfyUI 0.3.75 bundles, which the tests also run against.
#    Needs the host (scripts/setup/setup_host.sh) first, for its pip.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# --- 1. chromium ------------------------------------------------------------------------------------------------
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
      echo "setup_browser.sh: chromium is missing and this user cannot run apt-get; install it with:" >&2
      echo "  apt-get install -y --no-install-recommends chromium" >&2
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
  command -v chromium >/dev/null
  echo "setup_browser.sh: $(chromium --version 2>/dev/null || echo chromium installed)"
fi

# --- 2. the newest ComfyUI frontend, beside the bundled one ------------------------------------------------------
# Keep in step with NEW_FRONTEND in tests/test_browser.py.
FRONTEND_VERSION="1.58.1"
FRONTEND_DIR="$ROOT/.host/frontends/$FRONTEND_VERSION"
if [ ! -f "$FRONTEND_DIR/comfyui_frontend_package/static/index.html" ]; then
  PY="$ROOT/.host/venv/bin/python"
  if [ ! -x "$PY" ]; then
    echo "setup_browser.sh: the ComfyUI host is missing: run scripts/setup/setup_host.sh first (make setup does)" >&2
    exit 1
  fi
  echo "setup_browser.sh: installing comfyui-frontend-package==$FRONTEND_VERSION into .host/frontends/"
  rm -rf "$FRONTEND_DIR.tmp"
  # --no-deps --target: a plain folder of static files, nothing in the venv changes. Written aside and moved
  # into place so that an interrupted download never looks installed.
  "$PY" -m pip --disable-pip-version-check -q install --no-deps --no-compile --target "$FRONTEND_DIR.tmp" \
    "comfyui-frontend-package==$FRONTEND_VERSION"
  test -f "$FRONTEND_DIR.tmp/comfyui_frontend_package/static/index.html"
  rm -rf "$FRONTEND_DIR"
  mv "$FRONTEND_DIR.tmp" "$FRONTEND_DIR"
fi
