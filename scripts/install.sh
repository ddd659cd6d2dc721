#!/usr/bin/env bash
# Installs tokensampler and its test tools into ./.venv.
#
# torch comes first: the CPU build on machines without an NVIDIA GPU (so pip does not pull gigabytes
# of CUDA packages), the default CUDA build otherwise. TORCH_SPEC overrides the choice, e.g.
# TORCH_SPEC="torch==2.11.0". PYTHON picks the interpreter (default python3, 3.10 or newer).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    "${pip[@]}" "$TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" torch
  else
    "${pip[@]}" "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
"${pip[@]}" -e ".[dev]"
.venv/bin/python -c "import torch, tokensampler_server; print('tokensampler', tokensampler_server.__version__, 'torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
