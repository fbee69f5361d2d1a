"""The peer measurement for `bench_connectivity`'s `gconv{T}` workload: the global HyperZZW
convolution `conv(Z, Z ⊙ K)`, causal, cropped to T, on PyTorch eager through `torch.fft`.

    pip install torch==2.9.0
    python3 tools/peer/gconv_peer.py [--threads 2] [--runs 9] [--warmup 2]

Same shapes as the Rust workload: Z `[8, 64, T]`, K `[1, 64, T]`, forward only (no autograd),
FFT length the next power of two of 2T − 1. Each number is the median of `--runs` runs.
"""

import argparse
import json
import statistics
import time

import torch

BATCH, CHANNELS, LENGTHS = 8, 64, (64, 128, 256, 1024, 4096)


def gconv(z, kernel):
    length = z.shape[-1]
    n = 1 << (2 * length - 2).bit_length()
    spectrum = torch.fft.rfft(z, n=n) * torch.fft.rfft(z * kernel, n=n)
    return torch.fft.irfft(spectrum, n=n)[..., :length]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for length in LENGTHS:
        z = torch.randn(BATCH, CHANNELS, length)
        kernel = torch.randn(1, CHANNELS, length) / length
        times = []
        with torch.no_grad():
            for run in range(args.warmup + args.runs):
                start = time.perf_counter()
                gconv(z, kernel)
                if run >= args.warmup:
                    times.append(1e3 * (time.perf_counter() - start))
        print(json.dumps({
            "workload": f"gconv{length}",
            "variant": "torch.fft",
            "ms": round(statistics.median(times), 3),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
