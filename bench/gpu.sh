#!/usr/bin/env bash
# One prepared GPU check for nanoforge (one H200 or similar; PyTorch with CUDA, no vLLM, no network needed):
# 20 GRPO steps of train_grpo.py on one GPU (colocated, bf16, the torch generator, a random Qwen2.5-0.5B-shaped
# checkpoint made on the spot: needs safetensors, tokenizers, jinja2, tqdm, else that part is skipped), then the
# trainer-step MFU of a Qwen2.5-1.5B-shaped model (FSDP2, bf16), logprob peak memory at T=4096, torch-generator
# tokens/s, one gsm8k.py trainer rank at 1.5B, and the update's levers (compiled blocks, micro-batch 32). Prints a
# table and writes bench/results/gpu.json. All parts take ~9 minutes on one H200 (capped at 9.5; --parts picks).
#   bash bench/gpu.sh               # on the GPU machine
#   bash bench/gpu.sh --cpu-smoke   # anywhere: toy sizes on CPU, checks that the script runs
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if [ "${1:-}" != "--cpu-smoke" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec timeout 570 "$PYTHON" bench/gpu.py "$@"
