#!/usr/bin/env bash
# Fetch the wheels the GPU check installs (on a machine with PyPI) into benchmarks/gpu/wheels/, the CUDA build split
# into parts of at most 60 MiB (a GPU machine here takes 64 MiB of files per call: carry one part per call).
#   benchmarks/gpu/prepare.sh [PYTHON_VERSION]   # default: this python's, e.g. 3.11
set -euo pipefail
cd "$(dirname "$0")"
py="${1:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
mkdir -p wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --platform manylinux_2_28_x86_64 \
    -d wheels onnxruntime-ep-webgpu==0.4.0 onnxruntime-gpu==1.31.1
for w in wheels/onnxruntime_gpu-*.whl; do
    split -b 60M "$w" "$w.part-" && rm "$w"
done
ls -l wheels
