#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS.md in one call of the device tool, on a machine with an
# NVIDIA GPU, PyTorch, no Rust toolchain and no network. Needs what tools/gpu/build.sh packs
# into .gpu/, the Vulkan loader's Debian packages in .gl/ (for the Vulkan stages) and
# lucidrains' hyper-connections wheels in .whl/ (BENCHMARKS.md, "On a GPU machine", says how to
# fetch both). Carry .gpu, .gl, .whl and .gpu-cache.
#
#   bash tools/gpu/measure.sh SECONDS [STAGE ...]
#
# SECONDS is the whole budget: each stage gets its own limit, cut to what is left, and a stage
# that would start with under 5 s is skipped. A stage written with a trailing & (`lm&`) runs
# in the background beside the stages after it: only for stages that time nothing, and only
# where no stage after it times anything either (a background run shares the GPU: the
# 2026-11-27 Vulkan table ran beside the CUDA conformance run). Stages, in the default order
# (what the 2026-11-26 H200 lease taught: compiling and autotuning dominate, about 65 s for a
# forward pass of six variants on CUDA, 105 s for their train step, over 170 s for every
# variant on Vulkan):
#   peer            PyTorch's residual, lucidrains' HC and mHC, model workload (about 15 s)
#   encoder-peer    PyTorch's residual encoder, lucidrains' HC and mHC on each sublayer, the
#                   encoder workload (12 transformer layers, attention included)
#   encoder-train   the encoder workload's train step on CUDA, the targets' variants, each
#                   wrapping burn-nn's layers per sublayer (a transformer's share of the cost)
#   floors          PyTorch's times for the connection tables' products, norms and one pass
#                   over the rows at HC's and mHC's shapes (tools/peer/kernel_floors.py): what
#                   the crate's table kernels compare with (a few seconds)
#   cuda-train      the model workload's train step on CUDA, the targets' variants
#   cuda-forward    its forward pass
#   cuda-profile    per-kernel times of one HC and one mHC train step (CUBECL_DEBUG_OPTION=profile)
#   profile-targets the same for H-ACN, ANCRe and DWA (never profiled on a GPU: H-ACN missed
#                   its 1.02x by 0.001 in the fifth lease)
#   profile-groups  the same for mHC with each row group in $ROW_GROUPS (default "4 2"): the
#                   units per row of the tiled row kernels (BURN_CONNECTIVITY_ROW_GROUP)
#   profile-product the same for HC and mHC with each form of the weights' gradient in
#                   $PRODUCTS (default "matmul 1"; BURN_CONNECTIVITY_WEIGHTS_PRODUCT): Burn's
#                   matmul, or the crate's kernels with that many rows per step (default 8;
#                   1 is the kernel the fifth lease measured)
#   profile-tiles   the same for mHC with the tiled row kernels' earlier forms, each on the
#                   one before: cubes of 128 units (BURN_CONNECTIVITY_TILE_UNITS=128), then the
#                   row gradient one entry at a time (BURN_CONNECTIVITY_ROW_GRADIENT_BATCH=1),
#                   then the tiles' odd padding (BURN_CONNECTIVITY_TILE_PADDING=odd), against
#                   the defaults (256 units, 4 entries a batch, 16-byte aligned entries) in
#                   cuda-profile
#   profile-projection  the same for mHC with Burn's matmul for the normalised table's products
#                   with its weights (BURN_CONNECTIVITY_TABLE_PROJECTION=matmul: forward xΦ,
#                   backward (s δ)Φᵀ), then with the weights' gradient through the matmul too
#   tables-matmul   the train step of mHC and V4 on CUDA with both of those matmuls
#   profile-gated   the profile of HC with each form of its gated table's kernels in
#                   $GATED_FORMS (default "direct:4 staged:4 staged:1"), WEIGHTS:ROWS: the
#                   weights read directly or staged in shared memory
#                   (BURN_CONNECTIVITY_GATED_WEIGHTS), ROWS rows per cube of the backward
#                   (BURN_CONNECTIVITY_GATED_ROWS; the forward takes max(1, ROWS / 4) tokens
#                   of HC's 4 rows a cube, since 5d7d13c); cuda-profile has the default,
#                   direct:1
#   gated-train     the train step of HC on CUDA in the form $GATED_FORM (default staged:4)
#   ncu-tables      Nsight Compute's throughput, occupancy, launch and memory sections for the
#                   first forward, backward and weights' product of mHC's table, then HC's
#                   gated forward and backward, in the default form (direct:1; its forward a
#                   token a cube since 5d7d13c, one row a cube when the fifth lease measured
#                   it) and staged:4 (where ncu exists)
#   conformance     the golden vectors on CUDA in f64 (`--float f64`: f32 matrix products run
#                   in TF32 there, which the f32 tolerances do not allow; each file's checks as
#                   it finishes)
#   conformance-tables  the same, HC, mHC, V4 and mHC-lite only
#   conformance-f32 the golden vectors on CUDA in f32, TF32 products included (a record of
#                   TF32's error, not a pass/fail check)
#   conformance-half  the golden vectors on CUDA in bf16, then f16 (tolerances of a few of the
#                   type's roundoffs: tests/golden/README.md), the crate's kernels in the types
#                   GPUs train in; never run on a GPU before
#   tables-train    the train step of HC and mHC on CUDA
#   tables-train-group  the same with the row kernels' units per row set to $ROW_GROUP (default 32)
#   new-tables      the train step of V4 and mHC-lite on CUDA (their connection tables)
#   vulkan-train    the train step on wgpu's Vulkan path (SPIR-V)
#   counts          kernel counts on Vulkan, depth 12
#   new-variants    the train step of the 2025-26 methods on CUDA
#   cuda-variants   the train step on CUDA of the variants in $VARIANTS (comma-separated)
#   lm              reproduce --scale's LM runs, residual, AttnRes and MUDD, 3 seeds each
#   mudd-probe      20 steps of MUDD's LM run on CUDA with CubeCL's compilation and autotune
#                   logs, each line stamped with the script's seconds (MUDD stayed at step 0
#                   for 5 minutes in the 2026-11-26 H100 lease)
# Writes to $OUT (at most 8 files come back): env.txt, bench.jsonl (the JSON lines of every
# timing stage), bench.log (their stderr), profile.log, conformance.log, counts.log, lm.log,
# mudd.log, and where fewer than 8 are there at the end, autotune-MODEL.tgz: CubeCL's
# persistent cache (target/environment: the autotune choices, keyed by device index, not by
# model) packed for the GPU model MODEL. Copied to .gpu-cache/ and carried, it is restored at
# the start of a later lease on the same model: a fresh machine's first process spent 59 s
# tuning the residual's train step in the fifth lease, later processes 2-3 s. The stages that
# run elsewhere (profile, mudd-probe) name that directory in their cubecl.toml.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/gpu-out}
mkdir -p "$OUT"
BUDGET=${1:?usage: measure.sh SECONDS [STAGE ...]}
shift
STAGES=("$@")
((${#STAGES[@]})) || STAGES=(peer cuda-train cuda-forward cuda-profile conformance vulkan-train counts new-variants lm)
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

# Set-up: the Vulkan loader, the peer's wheels, the binary and its links.
if ls .gl/*.deb >/dev/null 2>&1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
# NVIDIA's Vulkan driver: its ICD file where the loader looks, else one elsewhere, else one
# written here for the driver's library (libGLX_nvidia) if the machine has it. A file is not
# an adapter: on the 2026-11-27 H200 the loader found NVIDIA's file in /usr/share, but the
# driver would not create an instance (BENCHMARKS.md, "Fourth lease").
vulkan_icd() {
    local icd lib
    for icd in /usr/share/vulkan/icd.d/nvidia*.json /etc/vulkan/icd.d/nvidia*.json; do
        [ -e "$icd" ] && { echo "vulkan: $icd (where the loader looks)"; return; }
    done
    icd=$(find /usr/local/nvidia /usr/share /etc /opt -name 'nvidia_icd*.json' 2>/dev/null | head -1)
    if [ -z "$icd" ]; then
        lib=$(find /usr/local/nvidia /usr/lib /usr/lib64 /lib /opt -name 'libGLX_nvidia.so*' \
            2>/dev/null | head -1)
        if [ -n "$lib" ]; then
            icd=/tmp/nvidia_icd.json
            printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' \
                "$lib" >"$icd"
        fi
    fi
    if [ -n "$icd" ]; then
        export VK_DRIVER_FILES=$icd
        echo "vulkan: VK_DRIVER_FILES=$icd: $(tr -d '\n' <"$icd" | head -c 300)"
    else
        echo "vulkan: no ICD file and no libGLX_nvidia on this machine"
    fi
}
vulkan_icd >/tmp/vulkan.txt # not in a subshell: the export must reach the stages
VULKAN=$(cat /tmp/vulkan.txt)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
(cd .gpu && xz -d -f -T0 gpu_suite.xz && chmod +x gpu_suite)
mkdir -p .gpu/bin
for program in bench_connectivity kernel_counts lm_wrap conformance; do
    ln -sf ../gpu_suite ".gpu/bin/$program"
done
# The binary leaves LLVM's symbols unresolved (tools/gpu/build.sh); the stub library defines them.
STUB="$PWD/.gpu/libllvmstub.so"
RUN=(env LD_PRELOAD="$STUB")
BIN=.gpu/bin
# The driver's libcuda and NVRTC (cudarc loads both at run time).
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 \
    /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$d"
done
export LD_LIBRARY_PATH
# CubeCL's cache of an earlier lease on this GPU model, if carried (see the header).
MODEL=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' '_')
[[ $MODEL == NVIDIA* ]] || MODEL= # not an error message for a name
CACHE=.gpu-cache/autotune-${MODEL:-unknown}.tgz
ENVIRONMENT="$PWD/target/environment"
# Packed to a temporary name first: a stage cut off by a signal may still be writing.
save_cache() {
    [ -n "$MODEL" ] && [ -d target/environment ] || return 0
    if (($(ls "$OUT" | wc -l) < 8)); then
        tar -czf /tmp/autotune.tgz -C target environment &&
            mv /tmp/autotune.tgz "$OUT/autotune-$MODEL.tgz" &&
            echo "== autotune cache saved: $(du -h "$OUT/autotune-$MODEL.tgz" | cut -f1)"
    else
        echo "== autotune cache not saved: $OUT already holds 8 files"
    fi
}
trap save_cache EXIT
# Nsight Compute, where the image has a CUDA toolkit (not known for the lent machines).
ncu_path() {
    command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1 | grep .
}
{
    echo "commit $(cat .gpu/COMMIT 2>/dev/null)"
    if [ -f "$CACHE" ] && tar -tzf "$CACHE" >/dev/null 2>&1; then
        mkdir -p target && tar -xzf "$CACHE" -C target && echo "autotune cache: $CACHE restored"
    else
        echo "autotune cache: none for ${MODEL:-an unnamed GPU} (cold)"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    nvidia-smi | head -4 | tail -2
    python3 -c 'import torch, hyper_connections; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    nproc
    echo "$VULKAN"
    # libGLX_nvidia, NVIDIA's Vulkan driver, links glvnd's libGLdispatch: without it the loader
    # cannot create an instance (the 2026-11-27 H200), so .gl carries glvnd too.
    ldconfig -p | grep -E 'libvulkan.so.1|libGLdispatch' | sed 's/^/ldconfig: /'
    echo "ncu: $(ncu_path || echo none)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# with_env NAME=VALUE CMD...: CMD with NAME=VALUE added to the programs' environment through
# RUN, so that step's `== ...` line (the record in the logs) shows it.
with_env() {
    local saved=("${RUN[@]}")
    RUN+=("$1")
    shift
    "$@"
    RUN=("${saved[@]}")
}

# gated_form WEIGHTS:ROWS CMD...: CMD with HC's gated table kernels in that form (see the
# header's profile-gated).
gated_form() {
    local form=$1
    shift
    with_env BURN_CONNECTIVITY_GATED_WEIGHTS="${form%%:*}" \
        with_env BURN_CONNECTIVITY_GATED_ROWS="${form#*:}" "$@"
}

TARGETS=hacn,ancre,dwa,hc,mhc
NEW=attnres,block_attnres,mhc_v4,laurel,mhc_lite,mudd
bench() { # bench LIMIT DEVICE PASS VARIANTS, the workload $WORKLOAD (default model)
    step "$1" "${RUN[@]}" $BIN/bench_connectivity --device "$2" --only "${WORKLOAD:-model}" \
        --runs 5 --warmup 2 --passes "$3" --variants "$4" >>"$OUT/bench.jsonl" 2>>"$OUT/bench.log"
    grep -a 'x residual' "$OUT/bench.log" | tail -12
}
lm_runs() {
    local pids=() which seed
    mkdir -p /tmp/lm
    for which in residual attnres mudd; do
        for seed in 1 2 3; do
            step "$(left)" "${RUN[@]}" $BIN/lm_wrap --device cuda --steps 2000 --layers 8 \
                --width 256 --heads 8 --context 128 --batch 32 --connectivity "$which" \
                --seed "$seed" >"/tmp/lm/lm_${which}_$seed.log" 2>&1 &
            pids+=($!)
        done
    done
    wait "${pids[@]}"
    for f in /tmp/lm/lm_*.log; do
        echo "## $(basename "$f" .log)"
        grep -aE 'valid loss|error|rc=|panicked|/2000' "$f" | tail -4
    done >>"$OUT/lm.log"
}

golden() { # golden LIMIT LOG [FLAG ...]: the conformance runner on CUDA, appended to $OUT/LOG
    local limit=$1 log=$2
    shift 2
    step "$limit" "${RUN[@]}" $BIN/conformance --dir tests/golden --device cuda "$@" \
        >>"$OUT/$log" 2>&1
}

# cubecl_toml DIR SECTIONS: DIR/cubecl.toml holding SECTIONS (printf escapes) and the repo's
# CubeCL environment, which a run outside the repo would otherwise not find (see the header).
cubecl_toml() {
    mkdir -p "$1"
    printf "$2"'[environment]\npath = { directory = "%s" }\n' "$ENVIRONMENT" >"$1/cubecl.toml"
}

# profile VARIANTS: CubeCL logs each kernel's time ("| 1.2ms | name") and a summary per sync,
# but only to a sink a cubecl.toml in the working directory names (CUBECL_DEBUG_OPTION alone
# sets the level and no sink).
profile() {
    cubecl_toml /tmp/profile '[profiling.logger]\nlevel = "basic"\nstdout = true\n'
    (cd /tmp/profile && step 120 "${RUN[@]}" "$OLDPWD/$BIN/bench_connectivity" \
        --device cuda --only model --runs 1 --warmup 2 --passes train-step \
        --variants "$1") >>"$OUT/profile.log" 2>&1
}

run_stage() {
    case $1 in
    peer)
        step 40 python3 tools/peer/hyper_connections_peer.py --device cuda --workload model \
            --runs 7 --warmup 3 >>"$OUT/bench.jsonl" 2>>"$OUT/bench.log" ;;
    encoder-peer)
        step 60 python3 tools/peer/hyper_connections_peer.py --device cuda --workload encoder \
            --runs 7 --warmup 3 >>"$OUT/bench.jsonl" 2>>"$OUT/bench.log" ;;
    encoder-train) WORKLOAD=encoder bench 200 cuda train-step "$TARGETS" ;;
    floors)
        step 60 python3 tools/peer/kernel_floors.py --device cuda >>"$OUT/bench.jsonl" \
            2>>"$OUT/bench.log"
        grep -a 'GB/s' "$OUT/bench.log" | tail -14 ;;
    cuda-train) bench 150 cuda train-step "$TARGETS" ;;
    cuda-forward) bench 100 cuda forward "$TARGETS" ;;
    cuda-profile) profile hc,mhc ;;
    profile-targets) profile hacn,ancre,dwa ;;
    profile-groups)
        for group in ${ROW_GROUPS:-4 2}; do
            echo "## row group $group" >>"$OUT/profile.log"
            with_env BURN_CONNECTIVITY_ROW_GROUP="$group" profile mhc
        done ;;
    profile-product)
        for product in ${PRODUCTS:-matmul 1}; do
            echo "## weights product $product" >>"$OUT/profile.log"
            with_env BURN_CONNECTIVITY_WEIGHTS_PRODUCT="$product" profile hc,mhc
        done ;;
    profile-tiles)
        echo "## tile units 128" >>"$OUT/profile.log"
        with_env BURN_CONNECTIVITY_TILE_UNITS=128 profile mhc
        echo "## tile units 128, row gradient batch 1" >>"$OUT/profile.log"
        with_env BURN_CONNECTIVITY_TILE_UNITS=128 \
            with_env BURN_CONNECTIVITY_ROW_GRADIENT_BATCH=1 profile mhc
        echo "## tile units 128, row gradient batch 1, tile padding odd" >>"$OUT/profile.log"
        with_env BURN_CONNECTIVITY_TILE_UNITS=128 with_env BURN_CONNECTIVITY_ROW_GRADIENT_BATCH=1 \
            with_env BURN_CONNECTIVITY_TILE_PADDING=odd profile mhc ;;
    profile-projection)
        echo "## table projection matmul" >>"$OUT/profile.log"
        with_env BURN_CONNECTIVITY_TABLE_PROJECTION=matmul profile mhc
        echo "## table projection matmul, weights product matmul" >>"$OUT/profile.log"
        with_env BURN_CONNECTIVITY_TABLE_PROJECTION=matmul \
            with_env BURN_CONNECTIVITY_WEIGHTS_PRODUCT=matmul profile mhc ;;
    tables-matmul)
        with_env BURN_CONNECTIVITY_TABLE_PROJECTION=matmul \
            with_env BURN_CONNECTIVITY_WEIGHTS_PRODUCT=matmul bench 150 cuda train-step mhc,mhc_v4 ;;
    profile-gated)
        for form in ${GATED_FORMS:-direct:4 staged:4 staged:1}; do
            echo "## gated table $form" >>"$OUT/profile.log"
            gated_form "$form" profile hc
        done ;;
    gated-train) gated_form "${GATED_FORM:-staged:4}" bench 150 cuda train-step hc ;;
    ncu-tables)
        # Why mHC's table kernels take 3-4x the estimate of BENCHMARKS.md: throughput of the SMs
        # and memory, occupancy and launch shape of the first forward, backward and weights'
        # product, from Nsight Compute where the image has it (into profile.log). At the clocks
        # and with the caches of a normal run (ncu's defaults: base clock, caches flushed), so
        # that its durations compare with the profile stages'.
        local ncu kernel
        if ! ncu=$(ncu_path); then
            echo "== ncu-tables: no ncu on this machine" | tee -a "$OUT/profile.log"
        else
            cubecl_toml /tmp/ncu ''
            # ncu follows its target through LD_PRELOAD: `env LD_PRELOAD=stub` (RUN) would drop
            # ncu's own library, so the stub is put in front of what ncu set, not in its place.
            local keep=(bash -c 'LD_PRELOAD="$0${LD_PRELOAD:+:$LD_PRELOAD}" exec "$@"' "$STUB")
            # Then HC's gated table: its W [w, 5] read at stride 5 by consecutive units would
            # cost about 25 L1 wavefronts a warp per step where a coalesced read costs 5
            # (BENCHMARKS.md, "HC's gated table"): the tables' sectors per request say.
            # `hc+` is HC with those weights staged in shared memory for 4 rows per cube.
            for case in mhc:'[Nn]ormalised_?[Ff]orward' mhc:'[Nn]ormalised_?[Bb]ackward' \
                mhc:'[Ww]eights_?[Pp]roduct' hc:'[Gg]ated_?[Ff]orward' hc:'[Gg]ated_?[Bb]ackward' \
                hc+:'[Gg]ated_?[Ff]orward' hc+:'[Gg]ated_?[Bb]ackward'; do
                kernel=${case#*:}
                local variant=${case%%:*} weights=direct rows=1
                [[ $variant == hc+ ]] && variant=hc weights=staged rows=4
                echo "## ncu $variant $kernel, gated table $weights:$rows" >>"$OUT/profile.log"
                (cd /tmp/ncu && step 60 env BURN_CONNECTIVITY_GATED_WEIGHTS=$weights \
                    BURN_CONNECTIVITY_GATED_ROWS=$rows \
                    "$ncu" --target-processes all --kernel-name "regex:$kernel" \
                    --launch-count 1 --clock-control none --cache-control none \
                    --section SpeedOfLight --section Occupancy \
                    --section LaunchStats --section MemoryWorkloadAnalysis \
                    --section MemoryWorkloadAnalysis_Tables \
                    "${keep[@]}" "$OLDPWD/$BIN/bench_connectivity" --device cuda --only model \
                    --runs 1 --warmup 0 --passes train-step --variants "$variant") \
                    >>"$OUT/profile.log" 2>&1
            done
            grep -aE 'Duration|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|==ERROR==' \
                "$OUT/profile.log" | tail -20
        fi ;;
    conformance)
        golden 240 conformance.log --float f64
        grep -aE 'passed|FAIL' "$OUT/conformance.log" | tail -5 ;;
    conformance-half)
        golden 150 conformance-half.log --float bf16
        golden 150 conformance-half.log --float f16
        grep -aE 'passed|FAIL|error' "$OUT/conformance-half.log" | tail -20 ;;
    conformance-f32)
        golden 240 conformance-f32.log
        grep -aE 'passed' "$OUT/conformance-f32.log" | tail -2 ;;
    conformance-tables)
        # The connection-table families alone (HC, mHC, V4, mHC-lite): a short lease's check.
        golden 150 conformance.log --float f64 --only hc,mhc,mhc_v4,mhc_lite
        grep -aE 'passed|FAIL' "$OUT/conformance.log" | tail -20 ;;
    tables-train) bench 150 cuda train-step hc,mhc ;;
    tables-train-group)
        with_env BURN_CONNECTIVITY_ROW_GROUP="${ROW_GROUP:-32}" bench 150 cuda train-step hc,mhc ;;
    new-tables) bench 150 cuda train-step mhc_v4,mhc_lite ;;
    vulkan-train) bench 240 vulkan train-step "$TARGETS" ;;
    counts)
        step 240 "${RUN[@]}" $BIN/kernel_counts --device vulkan --depth 12 --variants "$TARGETS" \
            >>"$OUT/counts.log" 2>&1
        grep -a '"pass": "train_step"' "$OUT/counts.log" | tail -6 ;;
    new-variants) bench 200 cuda train-step "$NEW" ;;
    cuda-variants) bench 200 cuda train-step "${VARIANTS:?cuda-variants needs VARIANTS}" ;;
    lm)
        lm_runs
        cat "$OUT/lm.log" ;;
    mudd-probe)
        cubecl_toml /tmp/mudd '[compilation.logger]\nlevel = "basic"\nstdout = true\n[autotune.logger]\nlevel = "minimal"\nstdout = true\n'
        (cd /tmp/mudd && step 90 "${RUN[@]}" "$OLDPWD/$BIN/lm_wrap" --device cuda --steps 20 \
            --layers 8 --width 256 --heads 8 --context 128 --batch 32 --connectivity mudd \
            --seed 1) 2>&1 | while IFS= read -r line; do printf '%4d %s\n' "$SECONDS" "$line"; done \
            >>"$OUT/mudd.log"
        grep -ac . "$OUT/mudd.log"
        tail -4 "$OUT/mudd.log" ;;
    *) echo "unknown stage $1" ;;
    esac
}

# A stage named with a trailing & runs beside the ones after it (for the stages that time
# nothing: conformance, counts, lm, and only before stages that time nothing either); the
# script waits for all of them at the end.
background=()
for stage in "${STAGES[@]}"; do
    if [[ $stage == *'&' ]]; then
        run_stage "${stage%&}" &
        background+=($!)
    else
        run_stage "$stage"
    fi
done
((${#background[@]})) && wait "${background[@]}"
echo "== done after $SECONDS s"
