#!/usr/bin/env bash
# Builds what tools/gpu/measure.sh runs on a GPU machine that has no Rust toolchain and no
# network, into .gpu/ for the device tool to carry (64 MiB in all):
#   gpu_suite.xz     bench_connectivity, kernel_counts, lm_wrap and the conformance runner as one
#                    binary (tools/src/bin/gpu_suite.rs), with wgpu (Vulkan: SPIR-V shaders, the
#                    `vulkan` feature) and CUDA; stripped and compressed (about 22 MB)
#   libllvmstub.so   definitions of the LLVM symbols the binary leaves unresolved (below)
#   COMMIT           the commit it was built from
#
#   bash tools/gpu/build.sh        # about 35 min cold on 2 cores
#
# CUDA offline: cubecl-cuda 0.11.3 compiles kernels through LLVM unless its `cpp` feature asks
# for NVRTC (CUDA's run-time compiler), and tracel-llvm-bundler downloads LLVM 23 from GitHub
# at build time. Where GitHub is out of reach (this project's build machine), the script
# - sets `DOCS_RS=1`, which makes the bundler and cubecl-llvm's build script skip LLVM;
# - turns on cubecl-cuda's `cpp` feature through a temporary edit of Cargo.toml (reverted on
#   exit), so that the LLVM path is never taken;
# - links with LLVM's symbols unresolved, and builds a stub library that defines each of them
#   as an abort; measure.sh preloads it (never on a machine whose Vulkan driver is Mesa's,
#   which links the real LLVM).
# With network access none of this is needed: `cargo build --release --features cuda` works.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu
export CARGO_TARGET_DIR="${GPU_TARGET_DIR:-target-gpu}"

cp Cargo.toml "$CARGO_TARGET_DIR.Cargo.toml.keep" 2>/dev/null || {
    mkdir -p "$(dirname "$CARGO_TARGET_DIR")"
    cp Cargo.toml "$CARGO_TARGET_DIR.Cargo.toml.keep"
}
cp Cargo.lock "$CARGO_TARGET_DIR.Cargo.lock.keep"
trap 'mv "$CARGO_TARGET_DIR.Cargo.toml.keep" Cargo.toml; mv "$CARGO_TARGET_DIR.Cargo.lock.keep" Cargo.lock' EXIT
python3 - <<'PY'
s = open("Cargo.toml").read()
s = s.replace(
    "[dev-dependencies]\n",
    'cubecl-cuda = { version = "0.11.3", default-features = false, features = ["cpp"], optional = true }\n\n[dev-dependencies]\n',
    1,
)
s = s.replace('cuda = ["burn/cuda", "cube-kernels"]', 'cuda = ["burn/cuda", "cube-kernels", "dep:cubecl-cuda"]')
open("Cargo.toml", "w").write(s)
PY
export DOCS_RS=1 RUSTFLAGS="-C link-arg=-Wl,--unresolved-symbols=ignore-all"
cargo build --release -p burn-connectivity-tools --features wgpu,vulkan,cuda,gpu-suite --bin gpu_suite
suite="$CARGO_TARGET_DIR/release/gpu_suite"

# The stub library: every LLVM (and cubecl-llvm shim) symbol the binary needs, each an abort.
nm -D --undefined-only "$suite" | awk '$2 !~ /@/ {print $2}' | grep -E '^(LLVM|cubecl_)' |
    awk 'BEGIN {
            print "#include <stdio.h>"
            print "#include <stdlib.h>"
            print "static void unlinked(const char *name) {"
            print "    fprintf(stderr, \"%s: LLVM is not linked into this build (NVRTC only)\\n\", name);"
            print "    abort();"
            print "}"
        }
        { printf "void %s(void) { unlinked(\"%s\"); }\n", $1, $1 }' >"$CARGO_TARGET_DIR/llvmstub.c"
cc -shared -fPIC -O1 -o .gpu/libllvmstub.so "$CARGO_TARGET_DIR/llvmstub.c"

strip -o .gpu/gpu_suite "$suite"
xz -f -T0 -6 .gpu/gpu_suite
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src tools tests examples || echo ' (with uncommitted changes)')" >.gpu/COMMIT
ls -la .gpu
