#!/usr/bin/env bash
# Create .venv (when missing) and install the pinned requirements for this machine.
# Called by `make test` / `make demo` only when the requirements changed (see the Makefile stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
stamp="$1"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  req=requirements-gpu.txt
else
  req=requirements-cpu.txt
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check)

extra=()
if [ "$req" = requirements-cpu.txt ] && [ "$(uname -m)" = x86_64 ]; then
  # The CPU torch build lives on PyTorch's own wheel index. Use it only when it answers within
  # a few seconds, so an offline mirror or a pre-seeded wheel cache still installs.
  idx=https://download.pytorch.org/whl/cpu
  if .venv/bin/python - "$idx" <<'PY' 2>/dev/null; then extra=(--extra-index-url "$idx"); fi
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5)
PY
fi

echo "installing $req into .venv ${extra[*]:+(with ${extra[*]})}"
"${pip[@]}" ${extra[@]+"${extra[@]}"} -r "$req"
if [ "$req" = requirements-cpu.txt ]; then
  .venv/bin/python -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
.venv/bin/python -c "import torch, transformers, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
rm -f .venv/.installed-*
touch "$stamp"
