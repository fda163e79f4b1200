"""Hopper wgmma probes: compile and check scripts/probes/probe_sm90.cu (sm_90a only).

    PYTHONPATH=. python scripts/probes/probe_sm90.py            # compile all; with an sm_90 GPU, test
    PYTHONPATH=. python scripts/probes/probe_sm90.py --compile-only

1. Compiles every variant with flashrt.nvrtc.compile_cubin (sm_90a, -std=c++17, -Xptxas=-v) and
   prints registers / spills / stack / shared memory from ptxas's report.
2. With a compute-capability-9.0 GPU (CuPy + torch):
   - probe_gemm for N = 64/128, B K-major / MN-major, A from shared memory / registers, against
     float64 torch.matmul on random bf16 inputs (max |err| / max |ref|): the unit test of
     kernels_cu/common/wgmma.cuh's descriptors, swizzle and fragment layouts.
Without a GPU it stops after step 1 and exits 0. The kernels built on them are kernels_cu/sm90/fwd_sm90.cu,
bwd_dq_sm90.cu and bwd_dkdv_sm90.cu (tests/test_gpu*.py, scripts/dense_ab.py, scripts/bench.py); the
dK/dV prototype that was checked and timed here until bwd_dkdv_sm90.cu replaced it is in git history.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from flashrt import cache, nvrtc  # noqa: E402

ARCH = "sm_90a"
SOURCE = (Path(__file__).resolve().parent / "probe_sm90.cu").read_text()  # its includes: kernels_cu/ paths
ATOM = 1024

GEMM_K = 128  # two 64-column blocks: exercises the column-block step of the K-major descriptor
GEMM_VARIANTS = [(n, tb, ar) for n in (64, 128) for tb in (0, 1) for ar in (0, 1)]  # (N, TRANS_B, A_REGS)


def gemm_smem(n: int, k: int = GEMM_K) -> int:
    return 64 * k * 2 + n * k * 2 + ATOM


def gemm_name(n, tb, ar):
    return f"probe_gemm_n{n}_k{GEMM_K}_{'mn' if tb else 'k'}B_{'rs' if ar else 'ss'}"


def compile_variant(name: str, defines: dict) -> tuple[bytes, dict]:
    options = ["-std=c++17", f"--gpu-architecture={ARCH}", "-Xptxas=-v", *(f"-D{k}={v}" for k, v in defines.items())]
    cubin, log = nvrtc.compile_cubin(SOURCE, name, options, cache.kernel_sources())

    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else None

    usage = {"regs": grab(r"Used (\d+) registers"), "spill_st": grab(r"(\d+) bytes spill stores"),
             "spill_ld": grab(r"(\d+) bytes spill loads"), "stack": grab(r"(\d+) bytes stack frame"),
             "smem_static": grab(r"(\d+) bytes smem") or 0, "log": log}
    return cubin, usage


def compile_all() -> dict:
    out = {}
    for n, tb, ar in GEMM_VARIANTS:
        name = gemm_name(n, tb, ar)
        cubin, usage = compile_variant(name, {"PROBE_N": n, "PROBE_K": GEMM_K, "PROBE_TRANS_B": tb, "PROBE_A_REGS": ar})
        out[name] = dict(kind="gemm", cfg=(n, tb, ar), cubin=cubin, usage=usage, entry="probe_gemm",
                         smem=gemm_smem(n), threads=128)
    return out


def print_usage(kernels: dict) -> bool:
    print(f"NVRTC {'.'.join(map(str, nvrtc.version()))}, {ARCH}; ptxas resource usage:")
    print(f"  {'variant':34s} {'regs':>5s} {'spill st/ld':>12s} {'stack':>6s} {'dyn smem':>9s}")
    ok = True
    for name, k in kernels.items():
        u = k["usage"]
        bad = u["regs"] is None or u["regs"] > 255 or any(u[key] or 0 for key in ("spill_st", "spill_ld", "stack"))
        ok &= not bad
        print(f"  {name:34s} {u['regs']!s:>5s} {u['spill_st']!s:>5s}/{u['spill_ld']!s:<6s} {u['stack']!s:>6s} "
              f"{k['smem']:>9d}{'   <-- SPILLS / TOO MANY REGISTERS' if bad else ''}")
        # e.g. "Potential Performance Loss: wgmma.mma_async instructions are serialized due to ..."
        for line in u["log"].splitlines():
            if "warning" in line.lower() or "performance" in line.lower():
                print(f"    ptxas: {line.strip()}")
    return ok


# ---------------------------------------------------------------------------------------------
# GPU part
# ---------------------------------------------------------------------------------------------
def gpu_available() -> str | None:
    """None when the GPU checks can run, else why not."""
    try:
        import cupy
        import torch
    except ImportError as exc:
        return f"no CuPy/torch ({exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0 or not torch.cuda.is_available():
            return "no CUDA device"
    except Exception as exc:  # no driver
        return f"no CUDA device ({exc})"
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        return f"device is sm_{cc[0]}{cc[1]}; the sm_90a cubins run only on compute capability 9.0"
    return None


class Loaded:
    def __init__(self, k: dict):
        import cupy
        from cupy_backends.cuda.api import driver
        self.module = cupy.cuda.function.Module()
        self.module.load(k["cubin"])
        self.fn = self.module.get_function(k["entry"])
        self.smem, self.threads, self.cfg = k["smem"], k["threads"], k["cfg"]
        if self.smem > 48 * 1024:
            driver.funcSetAttribute(self.fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem)
        self.regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, self.fn.ptr)
        self.local = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, self.fn.ptr)

    def __call__(self, grid, args):
        import cupy
        import torch
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        self.fn(grid, (self.threads, 1, 1), args, shared_mem=self.smem, stream=stream)


def ptr(t) -> np.uint64:
    return np.uint64(t.data_ptr())


def gemm_once(fn: Loaded, a, b, tb: bool):
    """(C, float64 reference, max |C - ref| / max |ref|) of one probe_gemm launch."""
    import torch
    c = torch.full((64, b.shape[1] if tb else b.shape[0]), float("nan"), device="cuda", dtype=torch.float32)
    fn((1, 1, 1), (ptr(a), ptr(b), ptr(c)))
    torch.cuda.synchronize()
    ref = a.double() @ (b.double() if tb else b.double().T)
    rel = ((c.double() - ref).abs().max() / ref.abs().max()).item() if not torch.isnan(c).any() else float("nan")
    return c, ref, rel


def run_gemm(k: dict, seed: int = 0) -> dict:
    import torch
    n, tb, ar = k["cfg"]
    fn = Loaded(k)
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(64, GEMM_K, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(GEMM_K, n, device="cuda", generator=g).to(torch.bfloat16) if tb else \
        torch.randn(n, GEMM_K, device="cuda", generator=g).to(torch.bfloat16)
    c, ref, rel = gemm_once(fn, a, b, tb)
    res = {"rel": rel, "nan": int(torch.isnan(c).sum().item())}
    if not rel < 1e-3:
        # Where it goes wrong: output rows / 8-column groups, and which k-steps (16 columns of A,
        # one wgmma each) are read correctly when A is zero outside them.
        bad = ((c.double() - ref).abs() > 1e-2 * ref.abs().max()) | torch.isnan(c)
        idx = torch.nonzero(bad)
        res["bad_rows"] = sorted(set(idx[:, 0].tolist()))[:64]
        res["bad_col8"] = sorted(set((idx[:, 1] // 8).tolist()))
        good_k = []
        for kk in range(GEMM_K // 16):
            a1 = torch.zeros_like(a)
            a1[:, 16 * kk:16 * kk + 16] = a[:, 16 * kk:16 * kk + 16]
            good_k.append(gemm_once(fn, a1, b, tb)[2] < 1e-3)
        res["kstep_ok"] = good_k
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()

    t0 = time.perf_counter()
    kernels = compile_all()
    print(f"compiled {len(kernels)} variants in {time.perf_counter() - t0:.1f} s")
    regs_ok = print_usage(kernels)
    if args.compile_only:
        return 0
    why = gpu_available()
    if why:
        print(f"GPU checks skipped: {why}")
        return 0

    import torch
    print(f"\nGPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows, all_ok = [], regs_ok
    print("\nprobe_gemm (C = A B^T with B K-major [N][K], or C = A B2 with B2 MN-major [K][N]; K = %d):" % GEMM_K)
    for name, k in kernels.items():
        if k["kind"] != "gemm":
            continue
        r = run_gemm(k)
        ok = r["rel"] < 1e-3
        all_ok &= ok
        extra = "" if ok else (f"\n    bad rows {r['bad_rows']}\n    bad 8-column groups {r['bad_col8']}, "
                               f"nan {r['nan']}, k-steps correct alone: {r['kstep_ok']}")
        print(f"  {name:34s} max rel err {r['rel']:.2e}  {'OK' if ok else 'FAIL'}{extra}")
        rows.append((name, f"rel err {r['rel']:.1e}", "", "OK" if ok else "FAIL"))
    if not all(res == "OK" for *_, res in rows):
        print("  reading a failure (layouts: kernels_cu/common/wgmma.cuh):\n"
              "    kB_* fail, only k-steps 4.. wrong: column-block step of desc_k_major (ROWS*128 bytes)\n"
              "    kB_* fail, k-steps 1-3 / 5-7 wrong: the 32-byte start-address step inside a swizzle row\n"
              "    every k-step wrong alone, *_ss and *_rs alike: the swizzle (sw128_offset) or the 1024-byte\n"
              "      alignment / base-offset assumption, or the accumulator layout (rows 16w+g+8h, cols 8j+2t+e)\n"
              "    mnB_* fail only at N=128, 8-column groups >= 8 wrong: LBO/SBO of desc_mn_major swapped\n"
              "    *_rs fail while *_ss pass: the A register-fragment order (a0..a3) of wgmma_rs")

    print("\nsummary:")
    for name, acc, speed, res in rows:
        print(f"  {name:34s} {acc:24s} {speed:16s} {res}")
    print("ALL OK" if all_ok else "SOME CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
