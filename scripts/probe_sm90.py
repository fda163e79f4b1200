"""Hopper wgmma probes: compile and check kernels_cu/probe_sm90.cu (sm_90a only).

    PYTHONPATH=. python scripts/probe_sm90.py            # compile all; with an sm_90 GPU, test and time
    PYTHONPATH=. python scripts/probe_sm90.py --compile-only

1. Compiles every variant with flashrt.nvrtc.compile_cubin (sm_90a, -std=c++17, -Xptxas=-v) and
   prints registers / spills / stack / shared memory from ptxas's report.
2. With a compute-capability-9.0 GPU (CuPy + torch):
   - probe_gemm for N = 64/128, B K-major / MN-major, A from shared memory / registers, against
     float64 torch.matmul on random bf16 inputs (max |err| / max |ref|): the unit test of
     kernels_cu/wgmma.cuh's descriptors, swizzle and fragment layouts.
   - dkdv_sm90 (the wgmma dK/dV backward prototype, D = 128 and 64, BM = 64) with lse2 / delta
     from a float64 forward: small B=1 S=256 H=2 (q/k/v strided views of one packed tensor,
     plain and peaky softmax) against float64 dK/dV; large B=2 S=8192 H=16 (--large) against
     float64 on two heads and torch SDPA's backward dk/dv everywhere; outputs poisoned with NaN
     first; timed with CUDA events (median of 20 after warm-up) as TFLOP/s = 8 B H S^2 D / time
     (its four matmuls of 2 S^2 D each), next to the whole SDPA backward (10 B H S^2 D / time)
     and, optional (--no-flashrt skips it), flashrt's split-backward dK/dV kernel (profiler).
Without a GPU it stops after step 1 and exits 0. The attention forward built on them is
kernels_cu/fwd_sm90.cu (tests/test_gpu*.py, scripts/dense_ab.py, scripts/bench.py).
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
DKDV_VARIANTS = [(128, 64), (64, 64)]  # (D, BM)


def gemm_smem(n: int, k: int = GEMM_K) -> int:
    return 64 * k * 2 + n * k * 2 + ATOM


def dkdv_smem(d: int, bm: int) -> int:  # Sm90DkdvTraits::SMEM
    return 2 * (128 * d * 2) + 2 * (2 * bm * d * 2) + 2 * (2 * bm * 4) + ATOM


def dkdv_name(d, bm):
    return f"dkdv_sm90_d{d}_bm{bm}"


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
    for d, bm in DKDV_VARIANTS:
        name = dkdv_name(d, bm)
        cubin, usage = compile_variant(name, {"DKDV_D": d, "DKDV_BM": bm, "DKDV_SMEM_BYTES": dkdv_smem(d, bm)})
        out[name] = dict(kind="dkdv", cfg=(d, bm), cubin=cubin, usage=usage, entry="dkdv_sm90",
                         smem=dkdv_smem(d, bm), threads=256)
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


# ---------------------------------------------------------------------------------------------
# dkdv_sm90
# ---------------------------------------------------------------------------------------------
LOG2E = 1.4426950408889634
# The kernel's four matmuls (S^T, dP^T, dV, dK), 2 S^2 D flops each per (batch, head).
DKDV_FLOPS_PER_BHS2D = 8
# A whole attention backward, as FlashAttention counts it: 2.5 x the forward's 4 B H S^2 D
# (5 matmuls: S recomputed, dP, dV, dK, dQ).
BWD_FLOPS_PER_BHS2D = 10


def pack_dkdv(q, k, v, do, lse2, delta, dk, dv, scale) -> np.ndarray:
    """Sm90DkdvParams (kernels_cu/probe_sm90.cu), 248 bytes."""
    B, S, H, D = q.shape
    vals = [t.data_ptr() for t in (q, k, v, do, lse2, delta, dk, dv)]
    for t in (q, k, v, do, dk, dv):
        vals += [t.stride(0), t.stride(1), t.stride(2)]
    assert lse2.stride() == delta.stride() and lse2.stride(2) == 1
    vals += [lse2.stride(0), lse2.stride(1), B, H, S, scale, scale * LOG2E]
    data = struct.pack("<8Q20q3i2f4x", *vals)
    assert len(data) == 248
    return np.frombuffer(data, dtype=np.dtype((np.void, len(data))))


def check_dkdv_inputs(*ts):
    for t in ts:
        assert t.dtype.is_floating_point and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
        assert all(st % 8 == 0 for st in t.stride()[:-1]), "16-byte aligned rows (cp.async / uint4 stores)"


def run_dkdv(fn: Loaded, q, k, v, do, lse2, delta, scale):
    """dK, dV (bf16, (B, S, H, D), poisoned with NaN first) and the packed args (kept alive for timing)."""
    import torch
    B, S, H, D = q.shape
    assert S % 128 == 0 and k.shape == v.shape == do.shape == q.shape and D == fn.cfg[0]
    dk = torch.full((B, S, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    dv = torch.full_like(dk, float("nan"))
    check_dkdv_inputs(q, k, v, do, dk, dv)
    args = pack_dkdv(q, k, v, do, lse2, delta, dk, dv, scale)
    fn((S // 128, H, B), (args,))
    return dk, dv, args


def attn64(q, k, v, do, scale, grads: bool):
    """float64 attention of (B, S, H, D) tensors: lse (B, H, S, natural log), delta = rowsum(dO o O)
    (B, H, S) and, with grads, dK, dV (B, S, H, D)."""
    qd, kd, vd, dod = (x.double().transpose(1, 2) for x in (q, k, v, do))
    s = (qd @ kd.transpose(-1, -2)) * scale
    lse = s.logsumexp(-1)
    p = (s - lse[..., None]).exp_()
    del s
    delta = (dod * (p @ vd)).sum(-1)
    if not grads:
        return lse, delta, None, None
    dv = p.transpose(-1, -2) @ dod
    ds = p.mul_((dod @ vd.transpose(-1, -2)).sub_(delta[..., None]))  # dS = P o (dP - delta), in place
    dk = (ds.transpose(-1, -2) @ qd) * scale
    return lse, delta, dk.transpose(1, 2), dv.transpose(1, 2)


def stats32(lse, delta):
    """(lse2, delta) as the kernel reads them: fp32 (B, H, S) contiguous."""
    import torch
    return (lse * LOG2E).to(torch.float32).contiguous(), delta.to(torch.float32).contiguous()


def nan_count(*ts) -> int:
    import torch
    return int(sum(torch.isnan(t).sum().item() for t in ts))


def check_dkdv(k: dict, fn: Loaded, large_shape=(2, 8192, 16), time_flashrt: bool = True) -> dict:
    import torch
    d, bm = k["cfg"]
    scale = d ** -0.5
    res = {}
    g = torch.Generator(device="cuda").manual_seed(2)

    # small: exact against float64. q, k, v are views of one packed (B, S, 3, H, D) tensor (row
    # stride 3 H D: exercises the element strides); q_scale 4 makes the softmax peaky.
    res["small_nan"], res["small_dk_err"], res["small_dv_err"] = 0, 0.0, 0.0
    for q_scale in (1.0, 4.0):
        qkv = torch.randn(1, 256, 3, 2, d, device="cuda", generator=g)
        qkv[:, :, 0] *= q_scale
        qkv = qkv.to(torch.bfloat16)
        q, kk, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        do = torch.randn(1, 256, 2, d, device="cuda", generator=g).to(torch.bfloat16)
        lse, delta, rdk, rdv = attn64(q, kk, v, do, scale, grads=True)
        lse2, delta32 = stats32(lse, delta)
        dk, dv, _ = run_dkdv(fn, q, kk, v, do, lse2, delta32, scale)
        torch.cuda.synchronize()
        res["small_nan"] += nan_count(dk, dv)
        res["small_dk_err"] = max(res["small_dk_err"], rel_err(dk, rdk))
        res["small_dv_err"] = max(res["small_dv_err"], rel_err(dv, rdv))

    # large: float64 statistics for every head (so the kernel's inputs are exact), dK / dV against
    # float64 on two heads and against torch's SDPA backward everywhere.
    B, S, H = large_shape
    q, kk, v, do = (torch.randn(B, S, H, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))
    lse = torch.empty(B, H, S, device="cuda", dtype=torch.float64)
    delta = torch.empty_like(lse)
    refs = {}
    for bb in range(B):
        for hh in range(H):
            sl = (slice(bb, bb + 1), slice(None), slice(hh, hh + 1))
            want = (bb, hh) in ((0, 0), (B - 1, H - 1))
            l1, d1, rdk, rdv = attn64(q[sl], kk[sl], v[sl], do[sl], scale, grads=want)
            lse[bb, hh], delta[bb, hh] = l1[0, 0], d1[0, 0]
            if want:
                refs[(bb, hh)] = (rdk, rdv)
    lse2, delta32 = stats32(lse, delta)
    dk, dv, args = run_dkdv(fn, q, kk, v, do, lse2, delta32, scale)
    torch.cuda.synchronize()
    res["large_nan"] = nan_count(dk, dv)
    err_k, err_v = 0.0, 0.0
    for (bb, hh), (rdk, rdv) in refs.items():
        sl = (slice(bb, bb + 1), slice(None), slice(hh, hh + 1))
        err_k, err_v = max(err_k, rel_err(dk[sl], rdk)), max(err_v, rel_err(dv[sl], rdv))
    res["large_dk_err"], res["large_dv_err"] = err_k, err_v
    del refs

    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, kk, v))
    dot = do.transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
    _, sdk, sdv = torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)
    res["large_sdpa_dk_diff"] = rel_err(dk, sdk.transpose(1, 2))
    res["large_sdpa_dv_diff"] = rel_err(dv, sdv.transpose(1, 2))
    del sdk, sdv

    # timing
    res["ms"] = time_it(lambda: fn((S // 128, H, B), (args,)))
    res["tflops"] = DKDV_FLOPS_PER_BHS2D * B * H * S * S * d / res["ms"] / 1e9
    res["sdpa_bwd_ms"] = time_it(lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True))
    res["sdpa_bwd_tflops"] = BWD_FLOPS_PER_BHS2D * B * H * S * S * d / res["sdpa_bwd_ms"] / 1e9
    res["flashrt_dkdv_ms"], res["flashrt_dkdv_note"] = None, ""
    if time_flashrt:
        try:
            res["flashrt_dkdv_ms"], res["flashrt_dkdv_note"] = flashrt_split_dkdv_ms(q, kk, v, do)
        except Exception as exc:  # optional context only
            res["flashrt_dkdv_note"] = f"flashrt split backward not timed: {type(exc).__name__}: {exc}"
    return res


def flashrt_split_dkdv_ms(q, k, v, do, reps: int = 10):
    """Mean GPU time of the dK/dV kernel of flashrt's split backward (torch profiler), and its name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import flashrt
    out, lse = flashrt.forward(q, k, v)
    for _ in range(3):
        flashrt.backward(do, q, k, v, out, lse, impl="split")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flashrt.backward(do, q, k, v, out, lse, impl="split")
        torch.cuda.synchronize()
    hits = [ev for ev in prof.key_averages() if "bwd_dkdv" in ev.key and "reduce" not in ev.key
            and ev.device_time_total]
    if not hits:
        return None, "no bwd_dkdv kernel in the profile"
    ev = max(hits, key=lambda e: e.device_time_total)
    return ev.device_time_total / reps / 1e3, ev.key


def rel_err(x, ref) -> float:
    """max |x - ref| / max |ref|."""
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def time_it(f) -> float:
    """Median CUDA-event milliseconds of 20 calls after 3 warm-up calls (scripts/mask_times.py's timer)."""
    from mask_times import time_ms  # scripts/ is sys.path[0] when run as a script; needs torch
    return time_ms(f, reps=20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--large", type=int, nargs=3, default=[2, 8192, 16], metavar=("B", "S", "H"),
                    help="dkdv_sm90's large check / timing shape (S a multiple of 128)")
    ap.add_argument("--no-flashrt", action="store_true", help="skip timing flashrt's split backward dK/dV kernel")
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

    B, S, H = args.large
    print(f"\ndkdv_sm90 (bf16, non-causal, MHA): small B1 S256 H2 vs float64 (q/k/v strided views); large B{B} "
          f"S{S} H{H} vs float64 (2 heads) and SDPA's dk/dv; dK/dV poisoned with NaN first")
    print(f"  TFLOP/s: dkdv_sm90 counts its 4 matmuls, {DKDV_FLOPS_PER_BHS2D} B H S^2 D; the whole SDPA backward "
          f"counts {BWD_FLOPS_PER_BHS2D} B H S^2 D (2.5 x forward)")
    for name, k in kernels.items():
        if k["kind"] != "dkdv":
            continue
        fn = Loaded(k)
        r = check_dkdv(k, fn, tuple(args.large), time_flashrt=not args.no_flashrt)
        # dK/dV are bf16 (rel. rounding 2^-9) and P^T, dS^T are rounded to bf16 before the second
        # GEMMs: a few 1e-3 expected; a layout or descriptor bug gives O(1).
        errs = (r["small_dk_err"], r["small_dv_err"], r["large_dk_err"], r["large_dv_err"])
        ok = (r["small_nan"] == 0 and r["large_nan"] == 0 and max(errs) < 2e-2
              and r["large_sdpa_dk_diff"] < 3e-2 and r["large_sdpa_dv_diff"] < 3e-2)
        all_ok &= ok
        fr = (f"; flashrt split dK/dV kernel {r['flashrt_dkdv_ms']:.3f} ms = "
              f"{DKDV_FLOPS_PER_BHS2D * B * H * S * S * k['cfg'][0] / r['flashrt_dkdv_ms'] / 1e9:.0f} TFLOP/s "
              f"({r['flashrt_dkdv_note']})" if r["flashrt_dkdv_ms"] else
              (f"; {r['flashrt_dkdv_note']}" if r["flashrt_dkdv_note"] else ""))
        print(f"  {name}: regs {fn.regs}, local {fn.local} B  {'OK' if ok else 'FAIL'}\n"
              f"    small: nan {r['small_nan']}, dK rel err {r['small_dk_err']:.2e}, dV rel err {r['small_dv_err']:.2e}\n"
              f"    large: nan {r['large_nan']}, dK rel err {r['large_dk_err']:.2e}, dV rel err {r['large_dv_err']:.2e}, "
              f"vs SDPA dK {r['large_sdpa_dk_diff']:.2e} dV {r['large_sdpa_dv_diff']:.2e}\n"
              f"    {r['ms']:.3f} ms = {r['tflops']:.0f} TFLOP/s (whole SDPA backward {r['sdpa_bwd_ms']:.3f} ms = "
              f"{r['sdpa_bwd_tflops']:.0f}){fr}")
        rows.append((name, f"dK/dV rel err {max(errs):.1e}", f"{r['tflops']:.0f} TFLOP/s", "OK" if ok else "FAIL"))
    if any(name.startswith("dkdv") and res == "FAIL" for name, *_, res in rows):
        print("  reading a failure: GEMM probes fine but dV wrong: the accumulator column = query mapping of\n"
              "    lse2 / delta, or desc_mn_major<BM> with K_ROWS = 64; dV right and dK wrong: dS^T, the scale, or\n"
              "    the dP^T GEMM (V / dO descriptors); NaN left: epilogue rows / the grid; both wrong by a factor:\n"
              "    the stats' layout (B, H, S) or lse2 = lse * log2(e)")

    print("\nsummary:")
    for name, acc, speed, res in rows:
        print(f"  {name:34s} {acc:24s} {speed:16s} {res}")
    print("ALL OK" if all_ok else "SOME CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
