#!/usr/bin/env bash
# Installs Debian's Chromium for the browser tests (tests/test_browser.py), idempotently.
# The tests drive /usr/bin/chromium with the Python `playwright` package from requirements-dev.txt; Playwright's
# own browser download (`playwright install`) is never used. Needs root (apt-get) on first run only.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
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
