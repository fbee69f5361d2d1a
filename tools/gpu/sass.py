#!/usr/bin/env python3
"""Reads the machine code of the crate's heaviest CubeCL kernels, without a GPU.

For each kernel that `kernel_sources` wrote (`kernels.json` and one `.cu` file each): compiles
the CUDA C++ with NVRTC to PTX (`--gpu-architecture=compute_90a`, as CubeCL's CUDA runtime asks
for `sm_90a`), the PTX with `ptxas -arch=sm_90a -v` (registers, spills, stack) and disassembles
the cubin (`cuobjdump -sass`). Then per kernel: the registers, spills, the cubes an SM holds
(H100: 64 K registers, 2048 units, 32 cubes, 227 KiB of shared memory an SM) and the waves at
the workload's cube count, and for each innermost loop (a backward branch with no other inside
it) how many instructions it issues and of which kind, per multiply-add.

A static reading: how many instructions a loop issues and which stall on memory, never how
long they take.

    python3 tools/gpu/sass.py --kit DIR --sources target/sass [--keep]

`--kit` is a folder with NVIDIA's pip wheels unpacked (tools/gpu/sass.sh makes it).
"""

import argparse
import collections
import ctypes
import glob
import json
import os
import re
import subprocess
import sys

SM_REGISTERS = 65536
SM_UNITS = 2048
SM_CUBES = 32
SM_SHARED = 227 * 1024
SMS = 132

# Instruction classes, by opcode (the part before the first dot).
CLASSES = {
    "FFMA": "fma",
    "FMUL": "fp",
    "FADD": "fp",
    "FMNMX": "fp",
    "MUFU": "sfu",
    "LDS": "shared load",
    "STS": "shared store",
    "LDG": "global load",
    "STG": "global store",
    "LDL": "local load",
    "STL": "local store",
    "LDC": "constant load",
    "ULDC": "constant load",
    "BAR": "barrier",
    "BRA": "branch",
    # Each IEEE f32 division: a reciprocal, its refinement, then this check for the slow path.
    "FCHK": "division",
}


def instruction_class(opcode):
    base = opcode.split(".")[0]
    if base in CLASSES:
        return CLASSES[base]
    if base.startswith("U"):
        return "uniform"
    if base[0] in "IL" or base in ("SEL", "SHF", "LOP3", "LEA", "IADD3", "IMAD", "ISETP", "MOV", "PRMT", "SHL", "SHR"):
        return "integer"
    return "other"


def nvrtc_ptx(kit, source, arch):
    lib = ctypes.CDLL(glob.glob(os.path.join(kit, "nvidia/cuda_nvrtc/lib/libnvrtc.so*"))[0])
    program = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    include = os.path.join(kit, "nvidia/cuda_runtime/include")
    options = [f"--gpu-architecture=compute_{arch}".encode(), f"--include-path={include}".encode(), b"-lineinfo"]
    array = (ctypes.c_char_p * len(options))(*options)
    status = lib.nvrtcCompileProgram(program, len(options), array)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    if status:
        raise RuntimeError("NVRTC: " + log.value.decode())
    lib.nvrtcGetPTXSize(program, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(program, ptx)
    return ptx.value.decode()


def tool(kit, name):
    found = glob.glob(os.path.join(kit, "nvidia/*/bin", name))
    if not found:
        raise FileNotFoundError(f"{name} not in {kit}")
    return found[0]


def parse_ptxas(text):
    info = {}
    m = re.search(r"Used (\d+) registers", text)
    info["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        info["stack"], info["spill_stores"], info["spill_loads"] = map(int, m.groups())
    m = re.search(r"(\d+) bytes smem", text)
    info["static_shared"] = int(m.group(1)) if m else 0
    return info


def parse_sass(text):
    """[(address, predicate, opcode, operands)] of the first function in `cuobjdump -sass`."""
    code = []
    pattern = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
    for line in text.splitlines():
        m = pattern.search(line)
        if m:
            address = int(m.group(1), 16)
            code.append((address, (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return code


def loops(code):
    """Every loop, a backward branch `[target, branch]`, with what it issues itself: its range
    less the loops nested in it."""
    found = []
    for address, _, opcode, operands in code:
        if opcode.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", operands)
            if m:
                target = int(m.group(1), 16)
                if target < address:
                    found.append((target, address))
    result = []
    for lo, hi in found:
        nested = [(a, b) for a, b in found if (a, b) != (lo, hi) and lo <= a and b <= hi]
        own = [c for c in code if lo <= c[0] <= hi and not any(a <= c[0] <= b for a, b in nested)]
        result.append((lo, hi, own, len(nested)))
    return result


def occupancy(registers, threads, shared):
    warps = -(-threads // 32)
    per_warp = -(-(registers * 32) // 256) * 256
    by_registers = SM_REGISTERS // (per_warp * warps) if registers else SM_CUBES
    by_units = SM_UNITS // (warps * 32)
    by_shared = SM_SHARED // shared if shared else SM_CUBES
    return min(SM_CUBES, by_registers, by_units, by_shared), {
        "registers": by_registers, "units": by_units, "shared": by_shared}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", required=True)
    parser.add_argument("--sources", default="target/sass")
    parser.add_argument("--arch", default="90a")
    parser.add_argument("--keep", action="store_true", help="leave the PTX, cubin and SASS beside the sources")
    args = parser.parse_args()
    env = dict(os.environ, PATH=os.path.dirname(tool(args.kit, "nvdisasm")) + os.pathsep + os.environ.get("PATH", ""))
    listing = json.load(open(os.path.join(args.sources, "kernels.json")))
    report = []
    for kernel in listing:
        base = os.path.join(args.sources, kernel["entry"])
        source = open(base + ".cu").read()
        ptx = nvrtc_ptx(args.kit, source, args.arch)
        open(base + ".ptx", "w").write(ptx)
        ptxas = subprocess.run([tool(args.kit, "ptxas"), f"-arch=sm_{args.arch}", "-v", "-o", base + ".cubin", base + ".ptx"],
                               capture_output=True, text=True, check=True)
        info = parse_ptxas(ptxas.stdout + ptxas.stderr)
        sass = subprocess.run([tool(args.kit, "cuobjdump"), "-sass", base + ".cubin"],
                              capture_output=True, text=True, check=True, env=env).stdout
        open(base + ".sass", "w").write(sass)
        code = parse_sass(sass)
        shared = info["static_shared"] + kernel.get("shared_bytes", 0)
        cubes_per_sm, limits = occupancy(info["registers"], kernel["threads"], shared)
        waves = kernel["cubes"] / (cubes_per_sm * SMS)
        entry = dict(kernel, **info, shared=shared, instructions=len(code), cubes_per_sm=cubes_per_sm,
                     occupancy_limits=limits, waves=round(waves, 2), loops=[])
        for lo, hi, body, nested in loops(code):
            classes = collections.Counter(instruction_class(op) for _, _, op, _ in body)
            fma = classes.get("fma", 0)
            entry["loops"].append({
                "from": hex(lo), "to": hex(hi), "instructions": len(body), "nested": nested,
                "classes": dict(classes.most_common()),
                "per_fma": round(len(body) / fma, 2) if fma else None,
            })
        report.append(entry)
        if not args.keep:
            for ext in (".ptx", ".cubin"):
                os.remove(base + ext)
    for entry in report:
        print(f"## {entry['name']}: {entry['case']}")
        print(f"   {entry['threads']} units a cube, {entry['cubes']} cubes; {entry['registers']} registers, "
              f"spills {entry.get('spill_stores', '?')} B stored / {entry.get('spill_loads', '?')} B loaded, "
              f"stack {entry.get('stack', '?')} B, shared {entry['shared']} B; {entry['instructions']} instructions")
        limits = entry["occupancy_limits"]
        print(f"   cubes per SM {entry['cubes_per_sm']} (registers allow {limits['registers']}, units {limits['units']}, "
              f"shared {limits['shared']}): {entry['cubes_per_sm'] * entry['threads'] // 32} warps of 64, "
              f"{entry['waves']} waves on 132 SMs")
        for loop in sorted(entry["loops"], key=lambda l: -l["instructions"]):
            classes = ", ".join(f"{k} {v}" for k, v in loop["classes"].items())
            per = f"; {loop['per_fma']} instructions per FFMA" if loop["per_fma"] else ""
            inside = f", {loop['nested']} loops inside" if loop["nested"] else ""
            print(f"   loop {loop['from']}–{loop['to']}{inside}: {loop['instructions']} instructions of its own ({classes}){per}")
    json.dump(report, open(os.path.join(args.sources, "sass.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
