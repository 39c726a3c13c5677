#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md), sized to run in under 8 minutes on one H100: training steps of the demo CNN,
# an MLP, a TransformerEncoderLayer and BERT-base on the GPU through stock onnxruntime (the WebGPU plugin EP over the
# GPU's Vulkan driver; the CUDA EP of onnxruntime-gpu), each 5 steps against TrainingSession on the CPU (1e-5) and
# timed against PyTorch CUDA eager on the same weights. Results: benchmarks/out/gpu_check.{md,json}.
#
#   benchmarks/gpu/run.sh             # on the GPU machine, from the repository root (no network needed)
#   benchmarks/gpu/run.sh --dry-run   # anywhere: tiny models, software WebGPU, PyTorch on the CPU (CI runs this)
#
# Wheels come with the working tree in benchmarks/gpu/wheels/ (benchmarks/gpu/prepare.sh fetches and splits them):
# onnxruntime_ep_webgpu-*.whl (7 MB) whole, onnxruntime_gpu-*.whl (244 MB) as parts of at most 60 MiB
# (NAME.whl.part-aa, -ab, ...), carried one per call where a machine takes 64 MiB per call; check.py joins the
# parts with cat and unpacks every wheel into a folder of its own (the machine's onnxruntime stays as it is).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "${PYTHON:-python3}" -m benchmarks.gpu.check "$@"
