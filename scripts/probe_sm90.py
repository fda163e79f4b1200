"""Hopper wgmma prototype: compile, check and time kernels_cu/probe_sm90.cu (sm_90a only).

    PYTHONPATH=. python scripts/probe_sm90.py            # compile all; with an sm_90 GPU, test and time
    PYTHONPATH=. python scripts/probe_sm90.py --compile-only

1. Compiles every variant with flashrt.nvrtc.compile_cubin (sm_90a, -std=c++17, -Xptxas=-v) and
   prints registers / spills / stack / shared memory from ptxas's report.
2. With a compute-capability-9.0 GPU (CuPy + torch):
   - probe_gemm for N = 64/128, B K-major / MN-major, A from shared memory / registers, against
     float64 torch.matmul on random bf16 inputs (max |err| / max |ref|);
   - fwd_sm90 against a float64 reference (B=1, S=256, H=2) and torch SDPA (B=2, S=8192, H=16;
     plus float64 on two heads, with LSE), output poisoned with NaN first; timed with CUDA events
     (median of 20 after warm-up), TFLOP/s = 4 B H S^2 D / time.
Without a GPU it stops after step 1 and exits 0.
"""
from __future__ import annotations

import argparse
import re
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from flashrt import cache, nvrtc  # noqa: E402

ARCH = "sm_90a"
SOURCE = '#include "probe_sm90.cu"\n'
ATOM = 1024

GEMM_K = 128  # two 64-column blocks: exercises the column-block step of the K-major descriptor
GEMM_VARIANTS = [(n, tb, ar) for n in (64, 128) for tb in (0, 1) for ar in (0, 1)]  # (N, TRANS_B, A_REGS)
FWD_VARIANTS = [(128, 128), (128, 64), (64, 128)]  # (D, BN)


def gemm_smem(n: int, k: int = GEMM_K) -> int:
    return 64 * k * 2 + n * k * 2 + ATOM


def fwd_smem(d: int, bn: int) -> int:  # Sm90FwdTraits::SMEM
    return 128 * d * 2 + 2 * (2 * bn * d * 2) + ATOM


def gemm_name(n, tb, ar):
    return f"probe_gemm_n{n}_k{GEMM_K}_{'mn' if tb else 'k'}B_{'rs' if ar else 'ss'}"


def fwd_name(d, bn):
    return f"fwd_sm90_d{d}_bn{bn}"


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
    for d, bn in FWD_VARIANTS:
        name = fwd_name(d, bn)
        cubin, usage = compile_variant(name, {"FWD_D": d, "FWD_BN": bn, "FWD_SMEM_BYTES": fwd_smem(d, bn)})
        out[name] = dict(kind="fwd", cfg=(d, bn), cubin=cubin, usage=usage, entry="fwd_sm90", smem=fwd_smem(d, bn),
                         threads=256)
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
        self.smem, self.threads = k["smem"], k["threads"]
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


def pack_fwd(q, k, v, o, lse, scale) -> np.ndarray:
    B, S, H, D = q.shape
    vals = [q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr()]
    for t in (q, k, v, o):
        vals += [t.stride(0), t.stride(1), t.stride(2)]
    vals += [lse.stride(0), lse.stride(1), B, H, S, scale * 1.4426950408889634]
    data = struct.pack("<5Q14q3if", *vals)
    assert len(data) == 168
    return np.frombuffer(data, dtype=np.dtype((np.void, len(data))))


def run_fwd(fn: Loaded, q, k, v):
    import torch
    B, S, H, D = q.shape
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, S), float("nan"), device="cuda", dtype=torch.float32)
    args = pack_fwd(q, k, v, o, lse, D ** -0.5)
    fn((S // 128, H, B), (args,))
    return o, lse, args


def ref_fwd64(q, k, v):
    """float64 reference: (B, S, H, D) -> O (B, S, H, D), lse (B, H, S) (natural log)."""
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    s = (qd @ kd.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return (s.softmax(-1) @ vd).transpose(1, 2), s.logsumexp(-1)


def rel_err(x, ref) -> float:
    """max |x - ref| / max |ref| (O of random inputs is small at long S: absolute errors would hide bugs)."""
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def check_fwd(k: dict, fn: Loaded) -> dict:
    import torch
    d, bn = k["cfg"]
    res = {}
    g = torch.Generator(device="cuda").manual_seed(1)
    # small: float64 reference everywhere; q_scale 4 makes the softmax peaky (exercises the running max)
    res["small_nan"], res["small_o_err"], res["small_lse_err"] = 0, 0.0, 0.0
    for q_scale in (1.0, 4.0):
        q, kk, v = (torch.randn(1, 256, 2, d, device="cuda", generator=g) for _ in range(3))
        q, kk, v = (q * q_scale).to(torch.bfloat16), kk.to(torch.bfloat16), v.to(torch.bfloat16)
        o, lse, _ = run_fwd(fn, q, kk, v)
        torch.cuda.synchronize()
        ro, rl = ref_fwd64(q, kk, v)
        res["small_nan"] += int(torch.isnan(o).sum().item() + torch.isnan(lse).sum().item())
        res["small_o_err"] = max(res["small_o_err"], rel_err(o, ro))
        res["small_lse_err"] = max(res["small_lse_err"], (lse.double() - rl).abs().max().item())
    # large: SDPA everywhere, float64 on two heads
    B, S, H = 2, 8192, 16
    q, kk, v = (torch.randn(B, S, H, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    o, lse, args = run_fwd(fn, q, kk, v)
    torch.cuda.synchronize()
    res["large_nan"] = int(torch.isnan(o).sum().item() + torch.isnan(lse).sum().item())
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2),
                                                            v.transpose(1, 2)).transpose(1, 2)
    res["large_sdpa_diff"] = rel_err(o, sdpa)
    err_o, err_l = 0.0, 0.0
    for bb, hh in ((0, 0), (B - 1, H - 1)):
        sl = (slice(bb, bb + 1), slice(None), slice(hh, hh + 1))
        ro, rl = ref_fwd64(q[sl], kk[sl], v[sl])
        err_o = max(err_o, rel_err(o[sl], ro))
        err_l = max(err_l, (lse[bb, hh].double() - rl[0, 0]).abs().max().item())
        del ro, rl
    res["large_o_err"], res["large_lse_err"] = err_o, err_l
    # timing
    flops = 4 * B * H * S * S * d
    res["ms"] = time_it(lambda: fn((S // 128, H, B), (args,)))
    res["tflops"] = flops / res["ms"] / 1e9
    qt, kt, vt = (x.transpose(1, 2) for x in (q, kk, v))
    res["sdpa_ms"] = time_it(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt))
    res["sdpa_tflops"] = flops / res["sdpa_ms"] / 1e9
    return res


def time_it(f, warmup: int = 3, reps: int = 20) -> float:
    import torch
    for _ in range(warmup):
        f()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


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
        print("  reading a failure (layouts: kernels_cu/wgmma.cuh):\n"
              "    kB_* fail, only k-steps 4.. wrong: column-block step of desc_k_major (ROWS*128 bytes)\n"
              "    kB_* fail, k-steps 1-3 / 5-7 wrong: the 32-byte start-address step inside a swizzle row\n"
              "    every k-step wrong alone, *_ss and *_rs alike: the swizzle (sw128_offset) or the 1024-byte\n"
              "      alignment / base-offset assumption, or the accumulator layout (rows 16w+g+8h, cols 8j+2t+e)\n"
              "    mnB_* fail only at N=128, 8-column groups >= 8 wrong: LBO/SBO of desc_mn_major swapped\n"
              "    *_rs fail while *_ss pass: the A register-fragment order (a0..a3) of wgmma_rs")

    print("\nfwd_sm90 (bf16, non-causal): small B1 S256 H2 vs float64; large B2 S8192 H16 vs SDPA / float64 (2 heads)")
    for name, k in kernels.items():
        if k["kind"] != "fwd":
            continue
        fn = Loaded(k)
        r = check_fwd(k, fn)
        # O is bf16 (rel. rounding 2^-9) and P is rounded to bf16 before P V: a few 1e-3 expected.
        ok = (r["small_nan"] == 0 and r["large_nan"] == 0 and r["small_o_err"] < 2e-2 and r["small_lse_err"] < 1e-3
              and r["large_o_err"] < 2e-2 and r["large_lse_err"] < 1e-3 and r["large_sdpa_diff"] < 2e-2)
        all_ok &= ok
        print(f"  {name}: regs {fn.regs}, local {fn.local} B  {'OK' if ok else 'FAIL'}\n"
              f"    small: nan {r['small_nan']}, O rel err {r['small_o_err']:.2e}, |lse err| {r['small_lse_err']:.2e}\n"
              f"    large: nan {r['large_nan']}, O vs SDPA rel {r['large_sdpa_diff']:.2e}, "
              f"O rel err {r['large_o_err']:.2e}, |lse err| {r['large_lse_err']:.2e}\n"
              f"    {r['ms']:.3f} ms = {r['tflops']:.0f} TFLOP/s (SDPA {r['sdpa_ms']:.3f} ms = {r['sdpa_tflops']:.0f})")
        rows.append((name, f"O rel err {max(r['small_o_err'], r['large_o_err']):.1e}",
                     f"{r['tflops']:.0f} TFLOP/s (SDPA {r['sdpa_tflops']:.0f})", "OK" if ok else "FAIL"))

    print("\nsummary:")
    print(f"  {'kernel':34s} {'accuracy':18s} {'speed (B2 S8k H16)':28s} result")
    for name, acc, speed, res in rows:
        print(f"  {name:34s} {acc:18s} {speed:28s} {res}")
    print("ALL OK" if all_ok else "SOME CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
