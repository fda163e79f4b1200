"""`flashrt check` on a GPU: run forward and backward at a few shapes, compare with
the float64 reference, and time against torch SDPA when torch is installed."""
from __future__ import annotations

import time

from . import api, launch, reference

# (B, Sq, Sk, H, Hkv, D, causal)
SHAPES = [
    (2, 128, 128, 4, 4, 64, False),
    (2, 257, 193, 8, 2, 128, True),
    (1, 100, 300, 8, 1, 256, True),
    (2, 384, 384, 6, 3, 96, False),
    (3, 4, 1500, 16, 4, 128, True),  # a few queries per KV head: decode's split-KV kernels (decoding.forward_applies)
]
# Relative-error bounds against float64 (bf16/fp16 inputs, fp32 accumulation).
TOLERANCE = {"bf16": 2e-2, "fp16": 4e-3}


def _inputs(shape, dtype):
    """Random normal q, k, v, dout in torch when available, else CuPy; plus float64 CuPy copies."""
    import cupy
    B, Sq, Sk, H, Hkv, D, _ = shape
    dims = [(B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, H, D)]
    try:
        import torch
        tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        xs = [torch.randn(d, device="cuda", dtype=tdt) for d in dims]
        return xs, [cupy.from_dlpack(x.float()).astype(cupy.float64) for x in xs]
    except ImportError:
        if dtype == "bf16":
            import ml_dtypes
            cdt = ml_dtypes.bfloat16
        else:
            cdt = cupy.float16
        xs = [cupy.random.standard_normal(d, dtype=cupy.float32).astype(cdt) for d in dims]
        return xs, [x.astype(cupy.float32).astype(cupy.float64) for x in xs]


def _f64(x):
    import cupy
    if type(x).__module__.startswith("torch"):
        return cupy.from_dlpack(x.detach().float()).astype(cupy.float64)
    return x.astype(cupy.float32).astype(cupy.float64)


def verify(shape, dtype) -> dict:
    B, Sq, Sk, H, Hkv, D, causal = shape
    (q, k, v, do), (q64, k64, v64, do64) = _inputs(shape, dtype)
    out, lse = api.forward(q, k, v, causal=causal)
    dq, dk, dv = api.backward(do, q, k, v, out, lse, causal=causal)
    ro, rlse, rdq, rdk, rdv = reference.attention(q64, k64, v64, causal=causal, dout=do64)
    import cupy
    lse64 = _f64(lse)
    finite = cupy.isfinite(rlse)
    errors = {
        "out": reference.rel_error(_f64(out), ro),
        "lse": float(cupy.abs(cupy.where(finite, lse64 - rlse, 0)).max()),
        "dq": reference.rel_error(_f64(dq), rdq),
        "dk": reference.rel_error(_f64(dk), rdk),
        "dv": reference.rel_error(_f64(dv), rdv),
    }
    tol = TOLERANCE[dtype]
    ok = all(errors[n] <= tol for n in ("out", "dq", "dk", "dv")) and errors["lse"] <= 1e-3
    return dict(errors, ok=ok)


def _time_ms(fn, iters=20) -> float:
    import torch
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def compare_sdpa(B=4, S=2048, H=16, D=128, causal=True) -> list[str]:
    import torch
    import torch.nn.functional as F
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    rows = [("flashrt", lambda: api.forward(q, k, v, causal=causal))]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    rows.append(("torch sdpa", lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)))
    lines = []
    for name, fn in rows:
        ms = _time_ms(fn)
        lines.append(f"  {name:12s} forward {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")
    return lines


def run(quick: bool = False) -> int:
    dev = launch.device(0)
    print(f"flashrt check on {dev.name} ({dev.arch}, {dev.sm_count} SMs)")
    failures = 0
    t0 = time.time()
    for dtype in ("bf16", "fp16"):
        for shape in SHAPES[:2] if quick else SHAPES:
            r = verify(shape, dtype)
            failures += not r["ok"]
            B, Sq, Sk, H, Hkv, D, causal = shape
            print(f"  {dtype} B={B} Sq={Sq} Sk={Sk} H={H} Hkv={Hkv} D={D} causal={causal!s:5}: "
                  f"rel err out {r['out']:.1e} dq {r['dq']:.1e} dk {r['dk']:.1e} dv {r['dv']:.1e}, "
                  f"lse max abs {r['lse']:.1e}  {'ok' if r['ok'] else 'FAIL'}")
    print(f"verified in {time.time() - t0:.1f}s (includes compiling kernels missing from the cache)")
    try:
        for line in compare_sdpa():
            print(line)
    except ImportError:
        print("  (install torch to time against torch SDPA)")
    print("all checks passed" if not failures else f"{failures} checks FAILED")
    return 1 if failures else 0
