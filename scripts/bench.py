"""Benchmark flashrt against torch's SDPA backends and FlexAttention in one run (needs a GPU and torch).

    python scripts/bench.py --set all --impls all --out benchmarks/results

Implementations (--impls, comma-separated, or `all`):
  flashrt        flashrt.attention(impl="split"): the deterministic backward
  flashrt-fused  flashrt.attention(impl="fused", deterministic=False): dQ added up with atomics
  flash, cudnn, efficient, math   torch SDPA, one backend forced (sdpa_kernel)
  flex           FlexAttention: flex_attention under torch.compile (dynamic shapes), causal through a
                 block mask from create_block_mask; GQA through enable_gqa
  fa4, fa4-det   FlashAttention-4 (flash_attn.cute.flash_attn_func, the `flash-attn-4` package), its
                 backward unordered / deterministic=True; an error row where it is not installed (how to
                 carry it to the device machine: ../shared/baselines/README.md)
Every implementation reads the same (B, S, H, D) tensors; torch's (B, H, S, D) APIs get transposed
views, never copies.

Shape sets (--set): grid (head_dim 64/128/256, S = 512..16k at 16k tokens and hidden 2048, causal
and not), seed (B=2 S=1024 H=8 Hkv=1 D=256), quick (grid at S = 1k and 8k, plus seed), long (B=1
H=16 D=128, S = 32k and 64k), stack (seed shape in an 18-layer model, below), masks (every mask
kind, below), masks-quick (masks at S = 1k and 8k), all = grid + seed + long + masks + stack; decode
(KV-cache decoding against SDPA flash and cuDNN: scripts/bench_decode.py, which documents it).
--seqlens 1024,8192 keeps only those sequence lengths (every set but stack).

Correctness gate, before any timing: one forward+backward, compared with float64 attention: the
output on the first and last 64 query rows (every batch and head), and dq/dk/dv of batch 0 on as
many heads as a 2^28-element float64 score matrix holds (at S >= 32k not one: there the gradients
are only checked finite, and the row says so). An implementation off by more than 2e-2 (output)
or 5e-2 (gradients) relative L2 error gets an "error" and no timings: a fast wrong answer is not a
result. Cases where the math backend's S^2 score matrices would not fit are skipped, with the reason.

Timing: median of CUDA-event timings after warm-up (triton.testing.do_bench, 25 ms warm-up and
100 ms of repetitions; for calls over 100 ms, the median of 3 calls after one). The forward is timed
with autograd recording, as in training, so backward = (forward+backward) - forward for every
implementation alike. FLOPs: forward 4*B*H*Sq*Sk*D (halved when causal), backward 2.5x, forward+
backward 3.5x. Peak memory: max allocated during one forward+backward, above what was allocated
before it.
The seed and stack sets, bound by host time, are measured in 7 interleaved rounds (each
implementation in turn, round after round); each figure is the median of its rounds.

Stack: 18 layers of [q/k/v projections from a hidden state of width H*D, attention, output
projection, residual], each under torch.utils.checkpoint (non-reentrant); forward+backward time of
the whole stack and its peak memory, gated by the attention check at the same shape.

Masks: bf16, H = Hkv = 16, D = 128, B = 16384 // S, S = 1k, 4k, 8k; each mask kind through flashrt's
keyword arguments, the same predicate as a FlexAttention mask_mod, and its dense bool form
(flashrt.reference.visible, the specification) for SDPA and the float64 gate:
  dense          no mask: the baseline of the density ratio
  causal         causal=True
  window         causal=True, window=(S//8, 0)
  padding        seqlens_q = seqlens_k = a random length in [S/2, S] per batch entry
  vla            block_ids (block-causal, key j visible iff id_k[j] <= id_q[i]): 0 for a prefix of 3S/4,
                 1 for one state token, 2 for the action chunk after it
  prefix-lm      block_ids: 0 for a prefix of S/2, then one id per token
  documents      segment_ids: 4 documents of random lengths per batch entry, visible iff equal
  window-mod     mask_mod="k <= q && k >= q - W" (W = S//8): window's mask as a user expression
  documents-mod  mask_mod="doc[b * S + q] == doc[b * S + k]", mask_tensors={"doc": segment ids}
Implementations (--mask-impls): flashrt-auto (flashrt.attention, impl="auto", deterministic),
flashrt-fused (impl="fused", deterministic=False), flex (the mask_mod through create_block_mask,
built once outside the timed region; its build time is in the row), sdpa-mask (SDPA with the
(B, 1, S, S) bool attn_mask, torch's choice of backend, noted in the row; skipped above 2^31 mask
bytes; unmasked SDPA at these shapes is the grid set's D=128 rows). The -mod rows run flashrt only:
they are compared with their built-in twin (and with its flex and sdpa-mask rows, the same mask).
flashrt validates the mask arrays in the gate's call and takes validate=False when timed (the device
check, README, is left out of the kernel comparison; scripts/seed_targets.py times it). The gate checks 256 query rows (around 0, S/2, 3S/4 and S) of the output,
leaving out rows that see no key (flashrt and flex give 0 there, SDPA may give NaN: the row notes
what it gave), and the gradients as above. TFLOP/s count visible pairs only (forward 4*H*D*pairs,
backward 2.5x); bench.json also has the dense-equivalent rates. Ratios per (mask, S): flex time /
flashrt time (target >= 1), flashrt time / its dense time (target <= 0.6 at 50% density), mask_mod
time / built-in time (target <= 1.15); the table names the targets a row misses. For flashrt time /
dense time, flashrt-auto with the mask and without it are also timed side by side in 5 interleaved
rounds, and the ratio is the median of the rounds' ratios (each listed under the table): two timings
of one row each, minutes apart, drift with the card's clocks and power by more than the margin being
checked (the density target: density within 0.05 of 0.5, causal).

Writes bench.json (every row and the environment), bench.md (tables: all rows; flash time /
flashrt time per case; masks and their ratios; the stack) and bench.png (TFLOP/s against
sequence length, needs matplotlib) to --out.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import flashrt  # noqa: E402
from flashrt import reference as oracle  # noqa: E402  (`reference` here is the gate's float64 answers)

# flashrt's backward variants (flashrt.backward's impl x deterministic); impl="auto" is one of them.
FLASHRT = {"flashrt": dict(impl="split", deterministic=True),
           "flashrt-fused-det": dict(impl="fused", deterministic=True),
           "flashrt-fused": dict(impl="fused", deterministic=False)}
SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
FA4 = {"fa4": False, "fa4-det": True}  # FlashAttention-4, deterministic=
IMPLS = (*FLASHRT, "flash", "cudnn", "efficient", "math", "flex", *FA4)
DEFAULT_IMPLS = "flashrt,flashrt-fused-det,flashrt-fused,flash,cudnn"
SETS = ("grid", "seed", "quick", "long", "stack", "masks", "masks-quick", "all", "decode")
# The masks set: flashrt's variants there, the mask kinds, and the built-in twin of each mask_mod kind.
MASK_FLASHRT = {"flashrt-auto": dict(impl="auto"), "flashrt-fused": FLASHRT["flashrt-fused"]}
MASK_IMPLS = (*MASK_FLASHRT, "flex", "sdpa-mask")
MASK_KINDS = ("dense", "causal", "window", "padding", "vla", "prefix-lm", "documents", "window-mod", "documents-mod")
MASK_MOD_OF = {"window-mod": "window", "documents-mod": "documents"}
MASK_SHAPE = dict(set="masks", H=16, Hkv=16, D=128)
SDPA_MASK_MAX_BYTES = 2**31  # the dense bool mask SDPA reads, B*S*S bytes (its bias copy in bf16 is twice that)

FWD_TOL, BWD_TOL = 2e-2, 5e-2
# The math backend keeps several fp32 B*H*S*S tensors alive in its backward; above this many
# scores (1 GiB per fp32 copy) it is skipped rather than run out of memory.
MATH_MAX_SCORES = 2**28
# The float64 gradient reference keeps ~4 heads*S*S float64 tensors: at most this many scores.
REF_MAX_SCORES = 2**28
SLOW_MS = 100.0  # calls longer than this are timed 3 times: do_bench's 5-call estimate alone would take seconds
STACK = dict(set="stack", B=2, S=1024, H=8, Hkv=1, D=256, layers=18)


def attention_cases(name: str) -> list[dict]:
    grid = [dict(set="grid", B=16384 // S, H=2048 // D, Hkv=2048 // D, S=S, D=D, causal=causal)
            for D in (64, 128, 256) for S in (512, 1024, 2048, 4096, 8192, 16384) for causal in (False, True)]
    seed = [dict(set="seed", B=2, H=8, Hkv=1, S=1024, D=256, causal=c) for c in (False, True)]
    long = [dict(set="long", B=1, H=16, Hkv=16, S=S, D=128, causal=c) for S in (32768, 65536) for c in (False, True)]
    quick = [c for c in grid if c["S"] in (1024, 8192)] + seed
    return {"grid": grid, "seed": seed, "quick": quick, "long": long, "stack": [], "masks": [], "masks-quick": [],
            "all": grid + seed + long}[name]


def mask_cases(name: str) -> list[dict]:
    full = (1024, 4096, 8192)
    seqlens = {"masks": full, "all": full, "masks-quick": (1024, 8192)}.get(name, ())
    return [dict(MASK_SHAPE, B=16384 // S, S=S, mask=kind) for S in seqlens for kind in MASK_KINDS]


def flops(c: dict, mode: str) -> float:
    """Masked cases (c["pairs"]: visible (query, key) pairs over the batch) count the visible pairs only."""
    if "pairs" in c:
        f = 4 * c["H"] * c["D"] * c["pairs"]
    else:
        f = 4 * c["B"] * c["H"] * c["S"] * c["S"] * c["D"] / (2 if c["causal"] else 1)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode]


def skip_reason(impl: str, c: dict) -> str | None:
    scores = c["B"] * c["H"] * c["S"] ** 2
    if impl == "math" and scores > MATH_MAX_SCORES:
        return (f"skipped: too large: math materialises B*H*S*S = {scores:.1e} fp32 scores per tensor "
                f"(limit {MATH_MAX_SCORES:.1e}), O(S^2) memory")
    mask_bytes = c["B"] * c["S"] ** 2
    if impl == "sdpa-mask" and mask_bytes > SDPA_MASK_MAX_BYTES:
        return (f"skipped: too large: the dense bool mask is B*S*S = {mask_bytes:.1e} bytes "
                f"(limit {SDPA_MASK_MAX_BYTES:.1e})")
    return None


# ---------------------------------------------------------------- implementations

def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.cache
def _flex():
    """(compiled flex_attention, compiled create_block_mask), compiled once per process.

    dynamic=True: a compile per head_dim and mask (and size-1 batch or kv-head axis) serves every
    sequence length, where a static compile per shape would cost ~8 s, 40+ times; fullgraph=True:
    a graph break would silently run flex's eager path, which materialises the scores.
    """
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._dynamo.config.recompile_limit = 64  # past the limit dynamo would fall back to eager
    return torch.compile(flex_attention, dynamic=True, fullgraph=True), torch.compile(create_block_mask)


def flex_attn(causal: bool, S: int):
    _, create_block_mask = _flex()
    return flex_with(create_block_mask(_causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cuda") if causal else None)


def flex_with(block_mask):
    flex, _ = _flex()

    def attn(q, k, v):
        o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                 enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)
    return attn


def sdpa_attention(backend: SDPBackend, causal: bool):
    def attn(q, k, v):
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)
    return attn


def fa4_attention(causal: bool, deterministic: bool):
    from flash_attn.cute import flash_attn_func  # (B, S, H, D) like flashrt; returns (out, lse)

    def attn(q, k, v):
        out = flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        return out[0] if isinstance(out, tuple) else out
    return attn


def make_attention(impl: str, causal: bool, S: int):
    """attn(q, k, v) -> out, all (B, S, heads, D), for one implementation (sequence length S)."""
    if impl in FLASHRT:
        options = FLASHRT[impl]
        return lambda q, k, v: flashrt.attention(q, k, v, causal=causal, **options)
    if impl == "flex":
        return flex_attn(causal, S)
    if impl in FA4:
        return fa4_attention(causal, FA4[impl])
    return sdpa_attention(SDPA[impl], causal)


# ---------------------------------------------------------------- correctness gate

def attention64(q, k, v, keep=None):
    """float64 attention of q's rows against all of k/v; keep: bool, broadcastable to the
    (B, H, rows, Sk) scores (False hides a key), or None. A row that sees no key gives out 0 and
    zero gradients, as flashrt does."""
    H, Hkv = q.shape[2], k.shape[2]
    k = k.double().repeat_interleave(H // Hkv, dim=2)
    v = v.double().repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
        empty = ~keep.any(-1, keepdim=True)
        if empty.any():
            return torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(empty, 0.0).softmax(-1).masked_fill(empty, 0.0), v)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def gate_rows(S: int, masked: bool):
    """The query rows whose output the gate checks: the first and last 64, and for masks also 64
    around S/2 and 3S/4 (where the prefix, state and document boundaries of the mask kinds fall)."""
    starts = (0, S // 2 - 32, 3 * S // 4 - 32, S - 64) if masked else (0, S - 64)
    return torch.cat([torch.arange(max(a, 0), min(a + 64, S)) for a in starts]).unique()


def reference(q, k, v, do, causal: bool, dense=None) -> dict:
    """The gate's float64 answers: output rows, and the gradients of batch 0 on as many heads as fit.

    dense: a masked case's (B, 1, S, S) bool mask (causal is then ignored); ref["empty"] marks the
    checked rows (B, rows) that see no key, which the gate leaves out of the output's error.
    """
    S, H, Hkv = q.shape[1], q.shape[2], k.shape[2]
    rows = gate_rows(S, dense is not None).to(q.device)

    def causal_keep(rows):  # (Sq == Sk here: bottom-right and top-left alignments agree)
        return torch.arange(S, device=q.device)[None, :] <= rows[:, None] if causal else None
    keep = dense[:, :, rows] if dense is not None else causal_keep(rows)
    with torch.no_grad():
        ref = {"rows": rows, "out": attention64(q[:, rows], k, v, keep)}
    if dense is not None:
        ref["empty"] = ~keep[:, 0].any(-1)
    group = H // Hkv
    kv_heads = min(Hkv, REF_MAX_SCORES // (group * S * S))
    if kv_heads == 0:
        gib = group * S * S * 8 / 2**30
        ref["bwd_check"] = f"grads checked finite only: a float64 reference needs {gib:.0f} GiB per score tensor"
        return ref
    h = kv_heads * group
    q64, k64, v64 = (x[:1, :, :n].detach().double().requires_grad_() for x, n in ((q, h), (k, kv_heads), (v, kv_heads)))
    keep = dense[:1] if dense is not None else causal_keep(torch.arange(S, device=q.device))
    attention64(q64, k64, v64, keep).backward(do[:1, :, :h].double())
    ref.update(dq=q64.grad, dk=k64.grad, dv=v64.grad, heads=h, kv_heads=kv_heads,
               bwd_check=f"float64 grads of batch 0, q heads 0..{h - 1}")
    return ref


def rel_err(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def gate(attn, q, k, v, do, ref) -> dict:
    """One forward+backward of attn against the float64 reference; 'error' when it is off."""
    t0 = time.perf_counter()
    o = attn(q, k, v)
    o.backward(do)
    torch.cuda.synchronize()
    res = {"first_call_s": time.perf_counter() - t0, "bwd_check": ref["bwd_check"]}
    out, want = o.detach()[:, ref["rows"]], ref["out"]
    if "empty" in ref and ref["empty"].any():  # rows that see no key: not compared, their values noted
        res["empty_rows_out"] = empty_rows_note(out[ref["empty"]])
        out, want = out[~ref["empty"]], want[~ref["empty"]]
    errs = {"out": rel_err(out, want)}
    if "dq" in ref:
        h, hkv = ref["heads"], ref["kv_heads"]
        errs.update(dq=rel_err(q.grad[:1, :, :h], ref["dq"]), dk=rel_err(k.grad[:1, :, :hkv], ref["dk"]),
                    dv=rel_err(v.grad[:1, :, :hkv], ref["dv"]))
    res.update({f"rel_err_{name}": e for name, e in errs.items()})
    bad = [f"{name} {e:.2e}" for name, e in errs.items() if not e < (FWD_TOL if name == "out" else BWD_TOL)]
    if "dq" not in ref and not all(torch.isfinite(x.grad).all() for x in (q, k, v)):
        bad.append("non-finite grads")
    if bad:
        res["error"] = (f"wrong answer vs float64: {', '.join(bad)} (tolerance out {FWD_TOL:.0e}, "
                        f"grads {BWD_TOL:.0e})")
        if res.get("empty_rows_out") == "NaN":
            res["error"] += "; out is NaN on the query rows that see no key"
    q.grad = k.grad = v.grad = None
    return res


def empty_rows_note(x) -> str:
    """What an implementation wrote on query rows that see no key: '0', 'NaN' or 'nonzero'."""
    return "NaN" if x.isnan().any() else "0" if (x == 0).all() else "nonzero"


# ---------------------------------------------------------------- measurement

def time_ms(fn, grad_to_none=()) -> float:
    """Median CUDA-event time of fn() in ms, after warm-up."""
    from triton.testing import do_bench
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once():
        for x in grad_to_none:
            x.grad = None
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    if once() < SLOW_MS:
        return do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=list(grad_to_none) or None)
    return statistics.median(once() for _ in range(3))


def peak_mib(fn, grad_to_none=()) -> float:
    """Peak memory allocated by one call of fn, above what was allocated before it."""
    for x in grad_to_none:
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def make_inputs(c: dict):
    torch.manual_seed(0)
    q = torch.randn(c["B"], c["S"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(c["B"], c["S"], c["Hkv"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    return q, k, v, torch.randn_like(q)


def bench_impl(impl: str, c: dict, inputs, ref: dict, measure, make=None) -> dict:
    """One row: skip check, correctness gate, then measure(attn); failures are recorded, never raised.

    make(row) -> attn builds the implementation (and may note set-up facts in the row); by default
    make_attention for the case.
    """
    return bench_impls([impl], c, inputs, ref, measure, (lambda _: make) if make else None)[0]


def bench_impls(impls: list[str], c: dict, inputs, ref: dict, measure, make_of=None, rounds: int = 1) -> list[dict]:
    """bench_impl for each implementation: every one gated first, then measured `rounds` times in turn
    (impl 1, impl 2, ..., impl 1, ...), each figure the median of its rounds. The host-bound sets
    (seed, stack) take rounds > 1: the device machine's host drifts between fast and slow states over
    seconds, which one-after-the-other timing turns into a ratio between implementations.
    make_of(impl): the implementation's make (bench_impl), or None for make_attention.
    """
    rows, ready = [], []
    for impl in impls:
        row = dict(c, impl=impl)
        rows.append(row)
        reason = skip_reason(impl, c)
        if reason:
            row["error"] = reason
            continue
        try:
            make = make_of(impl) if make_of else None
            attn = make(row) if make else make_attention(impl, c["causal"], c["S"])
            row.update(gate(attn, *inputs, ref))
            if "error" not in row:
                ready.append((row, attn, []))
        except Exception as exc:  # an implementation that cannot run this case
            row["error"] = error_text(exc)
            print(f"{impl} {c}:\n{traceback.format_exc(limit=-4)}", file=sys.stderr)
        _release(inputs)
    for _ in range(rounds):
        for row, attn, samples in ready:
            if "error" in row:
                continue
            try:
                samples.append(measure(attn))
            except Exception as exc:
                row["error"] = error_text(exc)
                print(f"{row['impl']} {c}:\n{traceback.format_exc(limit=-4)}", file=sys.stderr)
            _release(inputs)
    for row, _, samples in ready:
        if "error" not in row:
            row.update({key: statistics.median(s[key] for s in samples) for key in samples[0]})
            if rounds > 1:
                row["rounds"] = rounds
    return rows


def _release(inputs) -> None:
    for x in inputs[:3]:
        x.grad = None
    torch.cuda.empty_cache()


def error_text(exc: Exception) -> str:
    root = exc
    while root.__cause__ is not None:  # compile errors wrap the reason in several layers
        root = root.__cause__
    first_line = (str(root).strip().splitlines() or [""])[0]
    return f"{type(root).__name__}: {first_line[:200]}"


def attention_measure(c: dict, q, k, v, do):
    def measure(attn) -> dict:
        def fwd_bwd():
            attn(q, k, v).backward(do)
        r = {"fwd_ms": time_ms(lambda: attn(q, k, v)), "peak_mib": peak_mib(fwd_bwd, (q, k, v)),
             "fwdbwd_ms": time_ms(fwd_bwd, (q, k, v))}
        r["bwd_ms"] = r["fwdbwd_ms"] - r["fwd_ms"]
        r.update({f"{mode}_tflops": flops(c, mode) / r[f"{mode}_ms"] / 1e9 for mode in ("fwd", "bwd", "fwdbwd")})
        return r
    return measure


HOST_BOUND_ROUNDS = 7  # the seed and stack sets: measured in interleaved rounds (bench_impls)


def bench_case(c: dict, impls: list[str], rounds: int | None = None) -> list[dict]:
    q, k, v, do = make_inputs(c)
    ref = reference(q, k, v, do, c["causal"])
    rounds = rounds or (HOST_BOUND_ROUNDS if c["set"] == "seed" else 1)
    return bench_impls(impls, c, (q, k, v, do), ref, attention_measure(c, q, k, v, do), rounds=rounds)


# ---------------------------------------------------------------- the 18-layer stack

class Block(torch.nn.Module):
    """q/k/v projections from the hidden state, attention, output projection, residual."""

    def __init__(self, H: int, Hkv: int, D: int):
        super().__init__()
        self.H, self.Hkv, self.D = H, Hkv, D
        self.q = torch.nn.Linear(H * D, H * D, bias=False)
        self.k = torch.nn.Linear(H * D, Hkv * D, bias=False)
        self.v = torch.nn.Linear(H * D, Hkv * D, bias=False)
        self.o = torch.nn.Linear(H * D, H * D, bias=False)

    def forward(self, x, attn):
        B, S, _ = x.shape
        o = attn(self.q(x).view(B, S, self.H, self.D), self.k(x).view(B, S, self.Hkv, self.D),
                 self.v(x).view(B, S, self.Hkv, self.D))
        return x + self.o(o.reshape(B, S, self.H * self.D))


def run_stack(blocks, x, attn):
    for block in blocks:
        x = checkpoint(block, x, attn, use_reentrant=False)
    return x


def stack_measure(blocks, x, dy):
    params = list(blocks.parameters())

    def measure(attn) -> dict:
        def step():
            run_stack(blocks, x, attn).backward(dy)
        return {"peak_mib": peak_mib(step, params), "fwdbwd_ms": time_ms(step, params)}
    return measure


def bench_stack(impls: list[str], causal: bool) -> list[dict]:
    c = dict(STACK, causal=causal)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(c["H"], c["Hkv"], c["D"]) for _ in range(c["layers"]))
    blocks = blocks.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(c["B"], c["S"], c["H"] * c["D"], device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    q, k, v, do = make_inputs(c)
    ref = reference(q, k, v, do, causal)
    return bench_impls(impls, c, (q, k, v, do), ref, stack_measure(blocks, x, dy), rounds=HOST_BOUND_ROUNDS)


# ---------------------------------------------------------------- masks

def mask_spec(kind: str, B: int, S: int, device="cuda") -> tuple[dict, dict, object]:
    """One mask kind at batch B, length S: (flashrt's keyword arguments, the same mask as built-in
    keyword arguments for reference.visible, the same mask as a FlexAttention mask_mod or None for
    no mask). Random lengths and documents are seeded by S, so a -mod kind gets its twin's data."""
    W, g = S // 8, torch.Generator().manual_seed(S)
    if kind in MASK_MOD_OF:
        _, builtin, mod = mask_spec(MASK_MOD_OF[kind], B, S, device)
        if kind == "window-mod":
            return dict(mask_mod=f"k <= q && k >= q - {W}"), builtin, mod
        docs = builtin["segment_ids_q"]
        return dict(mask_mod=f"doc[b * {S} + q] == doc[b * {S} + k]", mask_tensors={"doc": docs}), builtin, mod
    if kind == "dense":
        kw, mod = {}, None
    elif kind == "causal":
        kw, mod = dict(causal=True), _causal
    elif kind == "window":
        kw = dict(causal=True, window=(W, 0))
        mod = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (kv_idx >= q_idx - W)  # noqa: E731
    elif kind == "padding":
        lens = torch.randint(S // 2, S + 1, (B,), generator=g).to(device=device, dtype=torch.int32)
        kw = dict(seqlens_q=lens, seqlens_k=lens)
        mod = lambda b, h, q_idx, kv_idx: (q_idx < lens[b]) & (kv_idx < lens[b])  # noqa: E731
    elif kind in ("vla", "prefix-lm"):
        ids = block_ids(kind, B, S).to(device)
        kw = dict(block_ids_q=ids, block_ids_k=ids)
        mod = lambda b, h, q_idx, kv_idx: ids[b, kv_idx] <= ids[b, q_idx]  # noqa: E731
    elif kind == "documents":
        docs = document_ids(B, S, 4, g).to(device)
        kw = dict(segment_ids_q=docs, segment_ids_k=docs)
        mod = lambda b, h, q_idx, kv_idx: docs[b, q_idx] == docs[b, kv_idx]  # noqa: E731
    else:
        raise ValueError(f"unknown mask kind {kind!r}; kinds: {', '.join(MASK_KINDS)}")
    return kw, kw, mod


def block_ids(kind: str, B: int, S: int):
    """(B, S) int32 block ids: vla = prefix 3S/4 (0), one state token (1), the action chunk (2);
    prefix-lm = prefix S/2 (0), then one id per token."""
    i = torch.arange(S)
    ids = (i >= 3 * S // 4).int() + (i > 3 * S // 4).int() if kind == "vla" else (i - S // 2 + 1).clamp(min=0)
    return ids.to(torch.int32).expand(B, S).contiguous()


def document_ids(B: int, S: int, n: int, g):
    """(B, S) int32: n documents per batch entry, cut at n-1 distinct random positions."""
    cuts = torch.stack([torch.randperm(S - 1, generator=g)[:n - 1] + 1 for _ in range(B)]).sort(-1).values
    return torch.searchsorted(cuts, torch.arange(S).expand(B, S).contiguous(), right=True).to(torch.int32)


def dense_mask(builtin: dict, B: int, S: int, device="cuda"):
    """(B, 1, S, S) bool: reference.visible of built-in mask arguments, one batch entry at a time
    (on the GPU through CuPy; NumPy for CPU tensors)."""
    xp = numpy if torch.device(device).type == "cpu" else importlib.import_module("cupy")
    out = torch.empty(B, 1, S, S, dtype=torch.bool, device=device)
    for b in range(B):
        one = {n: x if n in ("causal", "window") else xp.asarray(x[b:b + 1]) for n, x in builtin.items()}
        keep = oracle.visible(1, S, S, xp=xp, **one)
        out[b] = torch.as_tensor(keep.view(xp.uint8), device=device).view(torch.bool)[0]
    return out


def flashrt_masked(kw: dict, options: dict):
    """flashrt.attention with mask arguments kw: the first call (the gate's) validates the mask
    arrays, later ones pass validate=False (the kernels alone: the device check is timed by
    scripts/seed_targets.py)."""
    validate = True

    def attn(q, k, v):
        nonlocal validate
        o = flashrt.attention(q, k, v, validate=validate, **options, **kw)
        validate = False
        return o
    return attn


def flex_masked(mod, c: dict, per_batch: bool, row: dict):
    """flex with the block mask of mod, built once; its build time goes in the row (first call with
    the compile, then the median rebuild)."""
    if mod is None:
        return flex_with(None)
    _, create_block_mask = _flex()

    def build():
        return create_block_mask(mod, B=c["B"] if per_batch else None, H=None, Q_LEN=c["S"], KV_LEN=c["S"],
                                 device="cuda")
    t0 = time.perf_counter()
    block_mask = build()
    torch.cuda.synchronize()
    row["block_mask_first_s"] = time.perf_counter() - t0
    row["block_mask_ms"] = time_ms(build)
    return flex_with(block_mask)


def sdpa_masked(mask, inputs, row: dict):
    """SDPA with a dense bool attn_mask (B, 1, S, S), torch's choice of backend (noted in the row)."""
    def attn(q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)
    q, k, v = (x.transpose(1, 2) for x in inputs[:3])
    try:  # a private torch function: the backend SDPA would pick for these arguments
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=None, enable_gqa=q.shape[1] != k.shape[1])
        row["sdpa_backend"] = next(n for n, b in SDPBackend.__members__.items() if int(b) == choice)
    except Exception as exc:  # noqa: BLE001  (only a note)
        row["sdpa_backend"] = f"unknown ({type(exc).__name__})"
    return attn


def mask_measure(c: dict, q, k, v, do):
    """attention_measure (TFLOP/s on visible pairs), plus the dense-equivalent rates."""
    timed, dense = attention_measure(c, q, k, v, do), dict(c, pairs=c["B"] * c["S"] ** 2)

    def measure(attn) -> dict:
        r = timed(attn)
        r.update({f"{mode}_tflops_dense_equiv": flops(dense, mode) / r[f"{mode}_ms"] / 1e9
                  for mode in ("fwd", "bwd", "fwdbwd")})
        return r
    return measure


DENSITY_BAND = 0.05   # the "<= 0.6 of dense at 50% density" target is checked where |density - 0.5| <= this
DENSITY_ROUNDS = 5    # every flashrt / dense ratio is measured in this many interleaved rounds (density_rounds)


def density_rounds(kw: dict, q, k, v, do, rounds: int = DENSITY_ROUNDS) -> dict:
    """flashrt-auto with the mask arguments kw against flashrt-auto without a mask, on the same inputs, timed
    in turn (dense fwd, masked fwd, dense fwd+bwd, masked fwd+bwd) for `rounds` rounds: the per-round time
    ratios. The ratio table shows their median: two single timings minutes apart drift with the card's
    clocks and power (one kernel pair read 0.57-0.73 across rounds, docs/perf-notes.md: Devices, ceilings and noise), and
    timings side by side cancel most of that drift."""
    options = MASK_FLASHRT["flashrt-auto"]
    pair = {"dense": flashrt_masked({}, options), "masked": flashrt_masked(kw, options)}
    out = {"over_dense_fwd_rounds": [], "over_dense_bwd_rounds": []}
    for _ in range(rounds):
        t = {}
        for name, attn in pair.items():
            t[name, "fwd"] = time_ms(lambda: attn(q, k, v))
            t[name, "fwdbwd"] = time_ms(lambda: attn(q, k, v).backward(do), (q, k, v))
        out["over_dense_fwd_rounds"].append(t["masked", "fwd"] / t["dense", "fwd"])
        out["over_dense_bwd_rounds"].append((t["masked", "fwdbwd"] - t["masked", "fwd"]) /
                                            (t["dense", "fwdbwd"] - t["dense", "fwd"]))
    q.grad = k.grad = v.grad = None
    return out


def bench_mask_case(c: dict, impls: list[str]) -> list[dict]:
    """Every implementation on one (mask kind, S); a -mod kind runs flashrt's only."""
    impls = [impl for impl in impls if impl in MASK_FLASHRT or c["mask"] not in MASK_MOD_OF]
    try:
        kw, builtin, mod = mask_spec(c["mask"], c["B"], c["S"])
        dense = dense_mask(builtin, c["B"], c["S"])
        pairs = int(dense.sum())
        c = dict(c, density=pairs / dense.numel(), pairs=pairs)
        q, k, v, do = make_inputs(c)
        ref = reference(q, k, v, do, False, dense=dense)
    except Exception as exc:  # the case's set-up: every row gets the error
        print(f"masks {c}:\n{traceback.format_exc(limit=-4)}", file=sys.stderr)
        return [dict(c, impl=impl, error=f"set-up: {error_text(exc)}") for impl in impls]
    per_batch = any(isinstance(x, torch.Tensor) for x in builtin.values())

    def make(impl):
        if impl in MASK_FLASHRT:
            return lambda row: flashrt_masked(kw, MASK_FLASHRT[impl])
        if impl == "flex":
            return lambda row: flex_masked(mod, c, per_batch, row)
        return lambda row: sdpa_masked(dense, (q, k, v), row)
    measure = mask_measure(c, q, k, v, do)
    rows = [bench_impl(impl, c, (q, k, v, do), ref, measure, make(impl)) for impl in impls]
    for row in rows:  # every flashrt / dense ratio from rounds side by side (one dense timing can be off by 1.6x)
        if c["mask"] != "dense" and row["impl"] == "flashrt-auto" and "error" not in row:
            row.update(density_rounds(kw, q, k, v, do))
    return rows


# ---------------------------------------------------------------- output

def environment() -> dict:
    import cupy
    from flashrt import nvrtc
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "cupy": cupy.__version__,
            "nvrtc": list(nvrtc.version()), "driver": cupy.cuda.runtime.driverGetVersion(),
            "flashrt": flashrt.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}


def table(header: list[str], lines: list[list]) -> list[str]:
    """A markdown table; a line shorter than the header is padded with empty cells."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(map(str, line + [""] * (len(header) - len(line)))) + " |" for line in lines]
    return out


def max_err(r: dict) -> str:
    e = max(v for key, v in r.items() if key.startswith("rel_err_"))
    return f"{e:.1e}" if "rel_err_dq" in r else f"{e:.1e} (out only)"


def attention_table(rows: list[dict]) -> list[str]:
    header = ["set", "D", "S", "B", "H", "Hkv", "causal", "impl", "fwd ms", "fwd TFLOP/s", "bwd ms",
              "bwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s", "peak MiB", "max rel err"]
    lines = []
    for r in rows:
        line = [r["set"], r["D"], r["S"], r["B"], r["H"], r["Hkv"], r["causal"], r["impl"]]
        if "error" in r:
            lines.append(line + [r["error"]])
            continue
        for mode in ("fwd", "bwd", "fwdbwd"):
            line += [f"{r[f'{mode}_ms']:.3f}", f"{r[f'{mode}_tflops']:.0f}"]
        lines.append(line + [f"{r['peak_mib']:.0f}", max_err(r)])
    return table(header, lines)


def case_key(r: dict) -> tuple:
    return tuple(r[key] for key in ("set", "D", "S", "B", "H", "Hkv", "causal"))


def ratios(rows: list[dict]) -> list[dict]:
    """flash time / flashrt time (>1: flashrt faster) per case, for flashrt and flashrt-fused."""
    timed = {(case_key(r), r["impl"]): r for r in rows if "error" not in r}
    out = []
    for key in dict.fromkeys(case_key(r) for r in rows):
        flash = timed.get((key, "flash"))
        if flash is None:
            continue
        entry = dict(zip(("set", "D", "S", "B", "H", "Hkv", "causal"), key))
        for impl in FLASHRT:
            mine = timed.get((key, impl))
            for mode in ("fwd", "bwd"):
                entry[f"{impl}_{mode}"] = flash[f"{mode}_ms"] / mine[f"{mode}_ms"] if mine else None
        out.append(entry)
    return out


def ratio_table(summary: list[dict]) -> list[str]:
    header = ["set", "D", "S", "B", "H", "Hkv", "causal"] + [f"{impl} {mode}" for impl in FLASHRT for mode in ("fwd", "bwd")]
    lines = [[s[key] for key in header[:7]] +
             ["—" if s[f"{impl}_{mode}"] is None else f"{s[f'{impl}_{mode}']:.2f}" for impl in FLASHRT for mode in ("fwd", "bwd")]
             for s in summary]
    return table(header, lines)


def stack_table(rows: list[dict]) -> list[str]:
    base = {r["causal"]: r["fwdbwd_ms"] for r in rows if r["impl"] == "flashrt" and "error" not in r}
    lines = []
    for r in rows:
        line = [r["causal"], r["impl"]]
        if "error" in r:
            lines.append(line + [r["error"]])
            continue
        vs = f"{r['fwdbwd_ms'] / base[r['causal']]:.2f}" if r["causal"] in base else "—"
        lines.append(line + [f"{r['fwdbwd_ms']:.2f}", f"{r['peak_mib']:.0f}", vs, max_err(r)])
    return table(["causal", "impl", "fwd+bwd ms", "peak MiB", "time / flashrt time", "max rel err (attention gate)"],
                 lines)


def mask_table(rows: list[dict]) -> list[str]:
    header = ["mask", "S", "B", "density", "impl", "fwd ms", "fwd TFLOP/s", "bwd ms", "bwd TFLOP/s", "fwd+bwd ms",
              "peak MiB", "max rel err", "notes"]
    lines = []
    for r in rows:
        line = [r["mask"], r["S"], r["B"], f"{r['density']:.3f}" if "density" in r else "—", r["impl"]]
        if "error" in r:
            lines.append(line + [r["error"]])
            continue
        for mode in ("fwd", "bwd"):
            line += [f"{r[f'{mode}_ms']:.3f}", f"{r[f'{mode}_tflops']:.0f}"]
        lines.append(line + [f"{r['fwdbwd_ms']:.3f}", f"{r['peak_mib']:.0f}", max_err(r), mask_notes(r)])
    return table(header, lines)


def mask_notes(r: dict) -> str:
    notes = []
    if "block_mask_ms" in r:
        notes.append(f"block mask {r['block_mask_ms']:.2f} ms ({r['block_mask_first_s']:.1f} s first)")
    if "sdpa_backend" in r:
        notes.append(r["sdpa_backend"])
    if "empty_rows_out" in r:
        notes.append(f"rows with no key: {r['empty_rows_out']}")
    return "; ".join(notes)


def mask_ratios(rows: list[dict]) -> list[dict]:
    """Per (mask, S): flex (and sdpa-mask) time / flashrt time, flashrt time / its dense time, and
    mask_mod time / built-in time; a -mod kind is compared with its twin's flex and sdpa-mask rows."""
    timed = {(r["mask"], r["S"], r["impl"]): r for r in rows if "error" not in r}

    def ratio(a, b, mode):
        return a[f"{mode}_ms"] / b[f"{mode}_ms"] if a and b else None

    def over_dense(mine, dense, mode):  # the median of density_rounds' rounds where it ran
        rounds = (mine or {}).get(f"over_dense_{mode}_rounds")
        return statistics.median(rounds) if rounds else ratio(mine, dense, mode)
    out = []
    for kind, S in dict.fromkeys((r["mask"], r["S"]) for r in rows):
        twin = MASK_MOD_OF.get(kind, kind)
        mine, fused = timed.get((kind, S, "flashrt-auto")), timed.get((kind, S, "flashrt-fused"))
        flex, sdpa = timed.get((twin, S, "flex")), timed.get((twin, S, "sdpa-mask"))
        dense, builtin = timed.get(("dense", S, "flashrt-auto")), timed.get((twin, S, "flashrt-auto"))
        density = next((r["density"] for r in rows if r["mask"] == kind and r["S"] == S and "density" in r), None)
        entry = dict(mask=kind, S=S, density=density)
        for mode in ("fwd", "bwd"):
            entry.update({f"flex_over_flashrt_{mode}": ratio(flex, mine, mode),
                          f"flex_over_fused_{mode}": ratio(flex, fused, mode),
                          f"sdpa_over_flashrt_{mode}": ratio(sdpa, mine, mode),
                          f"over_dense_{mode}": over_dense(mine, dense, mode),
                          f"over_dense_{mode}_rounds": (mine or {}).get(f"over_dense_{mode}_rounds"),
                          f"mod_over_builtin_{mode}": ratio(mine, builtin, mode) if kind in MASK_MOD_OF else None})
        entry["misses"] = mask_misses(entry)
        out.append(entry)
    return out


def mask_misses(e: dict) -> list[str]:
    """The issue's targets that a ratio entry misses (a missing ratio misses nothing)."""
    def above(key, limit):
        return e[key] is not None and e[key] > limit

    def below(key, limit):
        return e[key] is not None and e[key] < limit
    misses = []
    for mode in ("fwd", "bwd"):
        if e["S"] >= 1024 and below(f"flex_over_flashrt_{mode}", 1.0):
            misses.append(f"flex {mode} >= 1")
        if e["density"] is not None and abs(e["density"] - 0.5) <= DENSITY_BAND and above(f"over_dense_{mode}", 0.6):
            misses.append(f"{mode} <= 0.6 dense")
        if above(f"mod_over_builtin_{mode}", 1.15):
            misses.append(f"mask_mod {mode} <= 1.15")
    return misses


MASK_RATIO_COLUMNS = {"flex / flashrt fwd": "flex_over_flashrt_fwd", "flex / flashrt bwd": "flex_over_flashrt_bwd",
                      "flex / fused bwd": "flex_over_fused_bwd", "sdpa-mask / flashrt fwd": "sdpa_over_flashrt_fwd",
                      "sdpa-mask / flashrt bwd": "sdpa_over_flashrt_bwd", "flashrt / dense fwd": "over_dense_fwd",
                      "flashrt / dense bwd": "over_dense_bwd", "mask_mod / built-in fwd": "mod_over_builtin_fwd",
                      "mask_mod / built-in bwd": "mod_over_builtin_bwd"}


def mask_ratio_table(summary: list[dict]) -> list[str]:
    lines = [[s["mask"], s["S"], "—" if s["density"] is None else f"{s['density']:.3f}"] +
             ["—" if s[key] is None else f"{s[key]:.2f}" for key in MASK_RATIO_COLUMNS.values()] +
             [", ".join(s["misses"]) or "none"] for s in summary]
    return table(["mask", "S", "density", *MASK_RATIO_COLUMNS, "targets missed"], lines)


def density_lines(summary: list[dict]) -> list[str]:
    """The per-round flashrt / dense ratios behind the table's (density_rounds)."""
    out = []
    for s in summary:
        for mode in ("fwd", "bwd"):
            rounds = s.get(f"over_dense_{mode}_rounds")
            if rounds:
                out.append(f"- {s['mask']} S={s['S']} flashrt / dense {mode}, {len(rounds)} interleaved rounds: "
                           f"{', '.join(f'{x:.3f}' for x in rounds)} (median {statistics.median(rounds):.3f})")
    return out + [""] if out else []


def markdown(env: dict, rows: list[dict], summary: list[dict], mask_summary: list[dict] = ()) -> str:
    attention = [r for r in rows if r["set"] not in ("stack", "masks")]
    stack = [r for r in rows if r["set"] == "stack"]
    masked = [r for r in rows if r["set"] == "masks"]
    out = [f"{env['gpu']}, driver {env['driver']}, torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), "
           f"CuPy {env['cupy']}, NVRTC {env['nvrtc']}, flashrt {env['flashrt']}, {env['date']}", ""]
    if attention:
        out += ["## Attention (bf16; bwd = fwd+bwd - fwd)", ""] + attention_table(attention) + [""]
    if summary:
        out += ["## flash time / flashrt time (>1: flashrt faster)", ""] + ratio_table(summary) + [""]
    if masked:
        s = MASK_SHAPE
        out += [f"## Masks (bf16, H={s['H']} Hkv={s['Hkv']} D={s['D']}, B=16384/S; TFLOP/s on visible pairs; "
                "bwd = fwd+bwd - fwd; flashrt-auto: impl auto, deterministic; flashrt-fused: deterministic=False)",
                ""] + mask_table(masked) + [""]
    if mask_summary:
        out += ["### Mask time ratios (targets: flex / flashrt >= 1 at S >= 1k; flashrt / dense <= 0.6 at 50% "
                "density, checked where density is 0.45-0.55; flashrt / dense is the median of interleaved rounds "
                "against dense (below); mask_mod / built-in <= 1.15; a -mod row's flex and sdpa-mask are its built-in "
                "twin's)",
                ""] + mask_ratio_table(mask_summary) + [""] + density_lines(mask_summary)
    if stack:
        s = STACK
        out += [f"## Stack: {s['layers']} checkpointed layers, B={s['B']} S={s['S']} H={s['H']} Hkv={s['Hkv']} "
                f"D={s['D']}, hidden {s['H'] * s['D']}, forward+backward", ""] + stack_table(stack) + [""]
    return "\n".join(out)


def plot(points: list[dict], path: Path) -> bool:
    """TFLOP/s against sequence length: a panel per head_dim x {forward, backward}; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    colour = {impl: f"C{i}" for i, impl in enumerate(IMPLS)}
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    for col, D in enumerate((64, 128, 256)):
        for row, (mode, name) in enumerate((("fwd", "forward"), ("bwd", "backward"))):
            ax = axes[row, col]
            for impl in IMPLS:
                for causal in (False, True):
                    line = sorted((r["S"], r[f"{mode}_tflops"]) for r in points
                                  if r["D"] == D and r["impl"] == impl and r["causal"] == causal)
                    if line:
                        ax.plot(*zip(*line), color=colour[impl], linestyle="--" if causal else "-", marker="o",
                                markersize=3)
            ax.set_xscale("log", base=2)
            ticks = sorted({r["S"] for r in points if r["D"] == D})
            ax.set_xticks(ticks, [f"{S // 1024}k" if S >= 1024 else str(S) for S in ticks])
            ax.minorticks_off()
            ax.set(title=f"head_dim {D}, {name}", xlabel="sequence length", ylabel="TFLOP/s")
            ax.grid(alpha=0.3)
    present = [impl for impl in IMPLS if any(r["impl"] == impl for r in points)]
    handles = [Line2D([], [], color=colour[impl], label=impl) for impl in present]
    handles += [Line2D([], [], color="black", label="non-causal"), Line2D([], [], color="black", linestyle="--", label="causal")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="all", choices=SETS)
    ap.add_argument("--impls", default=DEFAULT_IMPLS, help=f"comma-separated from {','.join(IMPLS)}, or all")
    ap.add_argument("--mask-impls", default="all",
                    help=f"the masks set's implementations: comma-separated from {','.join(MASK_IMPLS)}, or all")
    ap.add_argument("--seqlens", help="comma-separated sequence lengths to keep (every set but stack), e.g. 1024,8192")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of every attention case (default: 1; seed: "
                    f"{HOST_BOUND_ROUNDS}); each figure the median of its rounds")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    impls = list(IMPLS) if args.impls == "all" else args.impls.split(",")
    mask_impls = list(MASK_IMPLS) if args.mask_impls == "all" else args.mask_impls.split(",")
    unknown = [impl for impl in impls if impl not in IMPLS] + [impl for impl in mask_impls if impl not in MASK_IMPLS]
    if unknown:
        ap.error(f"unknown implementation(s) {unknown}; --impls: {','.join(IMPLS)} or all; "
                 f"--mask-impls: {','.join(MASK_IMPLS)} or all")
    if args.set == "decode":  # KV-cache decoding against SDPA (scripts/bench_decode.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_decode
        print(bench_decode.run(Path(args.out)))
        return
    seqlens = None if args.seqlens is None else {int(S) for S in args.seqlens.split(",")}
    t0 = time.perf_counter()
    env = environment()
    print(json.dumps(env), flush=True)
    rows = []
    for c in attention_cases(args.set):
        if seqlens is None or c["S"] in seqlens:
            for r in bench_case(c, impls, args.rounds):
                rows.append(r)
                print(json.dumps(r), flush=True)
    for c in mask_cases(args.set):
        if seqlens is None or c["S"] in seqlens:
            for r in bench_mask_case(c, mask_impls):
                rows.append(r)
                print(json.dumps(r), flush=True)
    if args.set in ("stack", "all"):
        for causal in (False, True):
            for r in bench_stack(impls, causal):
                rows.append(r)
                print(json.dumps(r), flush=True)
    summary = ratios([r for r in rows if r["set"] not in ("stack", "masks")])
    mask_summary = mask_ratios([r for r in rows if r["set"] == "masks"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"env": env, "rows": rows, "flash_over_flashrt": summary,
                                                "mask_ratios": mask_summary}, indent=1))
    text = markdown(env, rows, summary, mask_summary)
    (out / "bench.md").write_text(text + "\n")
    print(text)
    wrote = ["bench.json", "bench.md"]
    points = [r for r in rows if r["set"] in ("grid", "long") and "error" not in r]
    if points and plot(points, out / "bench.png"):
        wrote.append("bench.png")
    elif points:
        print("pip install matplotlib for bench.png")
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s; wrote {', '.join(wrote)} to {out}")


if __name__ == "__main__":
    main()
