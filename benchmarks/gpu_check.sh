#!/usr/bin/env bash
# The prepared GPU check of the performance issue: the same benchmark as on the CPU, on one CUDA device,
# bf16, lmserve (engine and HTTP server) against HF transformers in one run. For the `device` tool:
#     bash benchmarks/gpu_check.sh            # JSON lands in $OUT (the tool's result folder) or benchmarks/results
# Needs a CUDA build of torch on the device machine; builds the benchmark model there (random weights).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
python -m pip install -q --no-deps -e . >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python benchmarks/bench_cpu.py --device cuda --dtype bfloat16 --threads "$(nproc)" \
    --offline-requests 1024 --hf-batch 256 --out "${OUT:-benchmarks/results}" "$@"
