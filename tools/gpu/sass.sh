#!/usr/bin/env bash
# The machine code of the crate's heaviest CubeCL kernels on an NVIDIA H100 (sm_90a), read
# without a GPU: kernel_sources writes their CUDA C++ (CubeCL's own C++ compiler, as its CUDA
# runtime uses with NVRTC), then tools/gpu/sass.py compiles it with NVRTC and ptxas from
# NVIDIA's pip wheels and reports registers, spills, cubes per SM and each innermost loop's
# instructions. Static: no timing.
#
#   bash tools/gpu/sass.sh            # report on stdout, details in target/sass/sass.json
#   KEEP=1 bash tools/gpu/sass.sh     # and keep each kernel's .ptx, .cubin and .sass
#
# The wheels (about 140 MB: NVRTC 12.9, ptxas 12.9, the CUDA runtime's headers, cuobjdump and
# nvdisasm 13) are unpacked once into $SASS_KIT (default target/sass-kit); only PyPI is needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit="${SASS_KIT:-target/sass-kit}"
out="${SASS_OUT:-target/sass}"
if [ ! -d "$kit/nvidia/cuda_nvrtc" ]; then
    mkdir -p "$kit/wheels"
    python3 -m pip download --no-deps --only-binary=:all: -d "$kit/wheels" \
        nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86 \
        nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
    for wheel in "$kit"/wheels/*.whl; do
        python3 -m zipfile -e "$wheel" "$kit"
    done
    chmod +x "$kit"/nvidia/*/bin/* 2>/dev/null || true
fi
cargo run --release -p burn-connectivity-tools --features kernel-source --bin kernel_sources -- --out "$out"
python3 tools/gpu/sass.py --kit "$kit" --sources "$out" ${KEEP:+--keep}
