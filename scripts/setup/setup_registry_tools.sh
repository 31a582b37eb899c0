#!/usr/bin/env bash
# Installs the Comfy Registry tools, idempotently, into their own virtualenv .host/registry-tools/ (comfy-cli has
# many dependencies of its own; none of them may change the ComfyUI host's venv):
#   comfy-cli  `comfy node validate` / `comfy node pack`, what `comfy node publish` runs before uploading
#   ruff       `comfy node validate` runs `python -m ruff` from comfy-cli's own interpreter
# Used by `make registry-check` and tests/test_registry.py (scripts/setup/check_registry.py drives them offline).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOOLS="$ROOT/.host/registry-tools"
PINS="comfy-cli==1.23.0 ruff==0.17.6"
STAMP="$TOOLS/.stamp"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] && [ -x "$TOOLS/bin/comfy" ]; then
  exit 0
fi
echo "setup_registry_tools.sh: installing $PINS into .host/registry-tools/"
mkdir -p "$ROOT/.host"
[ -x "$TOOLS/bin/python" ] || "${PYTHON:-python3}" -m venv "$TOOLS"
# shellcheck disable=SC2086  # PINS is a list of requirements
"$TOOLS/bin/python" -m pip --disable-pip-version-check -q install $PINS
"$TOOLS/bin/comfy" --version >/dev/null
echo "$PINS" > "$STAMP"
