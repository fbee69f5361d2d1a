#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS.md ("On a GPU") in one call of the device tool, on a machine
# with an NVIDIA GPU, PyTorch, no Rust toolchain and no network. Needs what tools/gpu/build.sh
# packs into .gpu/, the Vulkan loader's Debian packages in .gl/ and lucidrains'
# hyper-connections wheels in .whl/ (BENCHMARKS.md says how to fetch both). Writes to $OUT:
#   env.txt    GPU, driver, commit          bench.jsonl  bench_connectivity's and the peer's lines
#   bench.log  their stderr (ratio tables)  counts.log   kernel_counts (table and JSON lines)
#   conformance.log                         lm.log       the LM runs (one process per run)
#
#   bash tools/gpu/measure.sh [SECONDS]     # SECONDS: the whole budget (default 540)
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/gpu-out}
mkdir -p "$OUT"
BUDGET=${1:-540}
END=$((SECONDS + BUDGET))
left() { echo $((END - SECONDS)); }
# step LIMIT CMD...: runs CMD for at most LIMIT seconds (less if the budget runs out).
step() {
    local limit=$1
    shift
    local t
    t=$(left)
    ((t < limit)) && limit=$t
    if ((limit < 5)); then
        echo "== skipped (budget spent): $*"
        return 0
    fi
    echo "== $(date +%T) [${limit}s] $*"
    timeout --kill-after=5 "$limit" "$@"
    echo "== rc=$? after $SECONDS s"
}

# Set-up: the Vulkan loader, the peer's wheels, the binaries.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
if ! ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Each build is one binary (tools/src/bin/gpu_suite.rs) run through links named after its programs.
(cd .gpu && for f in *.xz; do xz -d -f -T0 "$f"; done && chmod +x ./*_suite)
mkdir -p .gpu/gpu
for program in bench_connectivity kernel_counts lm_wrap conformance; do
    ln -sf ../gpu_suite ".gpu/gpu/$program"
done
# The gpu build leaves LLVM's symbols unresolved (tools/gpu/build.sh); a stub library defines them.
GPU="env LD_PRELOAD=$PWD/.gpu/libllvmstub.so"
# NVRTC for the CUDA backend (cudarc loads it at run time).
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 \
    /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; p = list(nvidia.__path__)[0]; print(" ".join(os.path.join(p, d, "lib") for d in os.listdir(p)))' 2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$d"
done
export LD_LIBRARY_PATH
{
    echo "commit $(cat .gpu/COMMIT 2>/dev/null)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    nvidia-smi | head -4 | tail -2
    python3 -c 'import torch, hyper_connections; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    ldconfig -p | grep -E 'libvulkan|libnvrtc' | head
    nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. The model workload, timed with the GPU to itself: PyTorch (residual, lucidrains' HC and mHC)
#    on CUDA, then the crate on wgpu's Vulkan (SPIR-V: every variant) and on CUDA (the variants
#    with GPU targets). Each warm-up compiles and autotunes that backend's kernels.
TARGETS=hacn,ancre,dwa,hc,mhc
bench() { # bench LIMIT DEVICE [VARIANTS]
    step "$1" $GPU .gpu/gpu/bench_connectivity --device "$2" --only model --runs 5 --warmup 2 \
        --variants "${3:-}" >>"$OUT/bench.jsonl" 2>>"$OUT/bench.log"
    tail -12 "$OUT/bench.log"
}
step 60 python3 tools/peer/hyper_connections_peer.py --device cuda --workload model \
    --runs 7 --warmup 3 >>"$OUT/bench.jsonl" 2>>"$OUT/bench.log"
bench 170 vulkan
bench 130 cuda "$TARGETS"

# 2. Untimed, side by side until the budget is spent: kernel counts on the GPU (the fusion
#    engine groups differently than on lavapipe), the golden vectors on every GPU backend, and
#    the LM runs of `reproduce --scale` (8 layers of width 256, 2000 steps, seeds 1-3), one
#    process per run (lm_wrap with reproduce's recipe), the newest methods' claims first.
LM_DEVICE=cuda
grep -q '"device":"cuda"' "$OUT/bench.jsonl" || LM_DEVICE=vulkan
(
    for depth in 4 12; do
        step 90 $GPU .gpu/gpu/kernel_counts --device vulkan --depth "$depth" --variants "$TARGETS"
    done
) >>"$OUT/counts.log" 2>&1 &
(
    step 150 $GPU .gpu/gpu/conformance --dir tests/golden --device vulkan
    step 150 $GPU .gpu/gpu/conformance --dir tests/golden --device cuda
) >>"$OUT/conformance.log" 2>&1 &
LM=/tmp/lm
mkdir -p "$LM"
lm_wave() {
    local pids=()
    for which in "$@"; do
        for seed in 1 2 3; do
            step "$(left)" $GPU .gpu/gpu/lm_wrap --device "$LM_DEVICE" --steps 2000 --layers 8 \
                --width 256 --heads 8 --context 128 --batch 32 --connectivity "$which" \
                --seed "$seed" >"$LM/lm_${which}_$seed.log" 2>&1 &
            pids+=($!)
        done
    done
    wait "${pids[@]}"
}
lm_wave residual attnres mudd
(($(left) > 150)) && lm_wave hc mhc block_attnres
wait
for f in "$LM"/lm_*.log; do
    echo "## $(basename "$f" .log)"
    grep -aE 'valid loss|error|rc=|panicked' "$f" | tail -3
done >"$OUT/lm.log"
tar -czf "$OUT/lm_runs.tar.gz" -C "$LM" .
echo "== done after $SECONDS s"
cat "$OUT/lm.log"
grep -aE 'passed|FAIL' "$OUT/conformance.log" | tail -5
grep -a '"pass": "train_step"' "$OUT/counts.log" | tail -20
