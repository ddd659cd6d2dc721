#!/usr/bin/env bash
# Installs tokensampler (the server and its client, tokensampler-client) and its test tools into ./.venv.
#
# torch comes first: the CPU build on machines without an NVIDIA GPU (so pip does not pull gigabytes
# of CUDA packages), the default CUDA build otherwise. TORCH_SPEC overrides the choice, e.g.
# TORCH_SPEC="torch==2.11.0"; TORCH_INDEX_URL names the index of the CPU builds (PyTorch's own by
# default), which is used only when it answers: machines that cannot reach it take torch from their
# configured indexes and wheel folders instead of retrying it for every package.
# PYTHON picks the interpreter (default python3, 3.10 or newer).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
torch_index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# Progress stays visible: torch and its dependencies are large downloads that would otherwise look hung.
pip=(.venv/bin/python -m pip install --disable-pip-version-check --progress-bar on)

reachable() {
  .venv/bin/python - "$1" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=5).close()
except Exception:
    sys.exit(1)
PY
}

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    "${pip[@]}" "$TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" torch
  elif reachable "$torch_index/torch/"; then
    "${pip[@]}" "torch==2.13.0" --extra-index-url "$torch_index"
  else
    echo "install: $torch_index does not answer; taking torch from the configured indexes" >&2
    "${pip[@]}" "torch==2.13.0"
  fi
fi
# The server (the root) depends on tokensampler-client, which carries the contract: both from this checkout. A .venv
# made when one distribution held both loses the `tokensampler` command when pip replaces it: remove it first (-I:
# the installed metadata, not a build folder of the checkout).
if .venv/bin/python -I - <<'PY' 2>/dev/null; then
import importlib.metadata as metadata, sys
sys.exit(0 if "tokensampler" in {e.name for e in metadata.distribution("tokensampler").entry_points} else 1)
PY
  .venv/bin/python -m pip uninstall --disable-pip-version-check -y tokensampler
fi
"${pip[@]}" -e ./client -e ".[dev]"
.venv/bin/python -c "import torch, tokensampler_server; print('tokensampler', tokensampler_server.__version__, 'torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
