"""Benchmark flashrt against torch's SDPA backends and FlexAttention in one run (needs a GPU and torch).

    python scripts/bench.py --set all --impls all --out benchmarks/results

Implementations (--impls, comma-separated, or `all`):
  flashrt        flashrt.attention(impl="split"): the deterministic backward
  flashrt-fused  flashrt.attention(impl="fused", deterministic=False): dQ added up with atomics
  flash, cudnn, efficient, math   torch SDPA, one backend forced (sdpa_kernel)
  flex           FlexAttention: flex_attention under torch.compile (dynamic shapes), causal through a
                 block mask from create_block_mask; GQA through enable_gqa
Every implementation reads the same (B, S, H, D) tensors; torch's (B, H, S, D) APIs get transposed
views, never copies.

Shape sets (--set): grid (head_dim 64/128/256, S = 512..16k at 16k tokens and hidden 2048, causal
and not), seed (B=2 S=1024 H=8 Hkv=1 D=256), quick (grid at S = 1k and 8k, plus seed), long (B=1
H=16 D=128, S = 32k and 64k), stack (seed shape in an 18-layer model, below), all = grid + seed +
long + stack.

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

Stack: 18 layers of [q/k/v projections from a hidden state of width H*D, attention, output
projection, residual], each under torch.utils.checkpoint (non-reentrant); forward+backward time of
the whole stack and its peak memory, gated by the attention check at the same shape.

Writes bench.json (every row and the environment), bench.md (tables: all rows; flash time /
flashrt time per case; the stack) and bench.png (TFLOP/s against sequence length, needs
matplotlib) to --out.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import flashrt  # noqa: E402

# flashrt's backward variants (flashrt.backward's impl x deterministic); impl="auto" is one of them.
FLASHRT = {"flashrt": dict(impl="split", deterministic=True),
           "flashrt-fused-det": dict(impl="fused", deterministic=True),
           "flashrt-fused": dict(impl="fused", deterministic=False)}
SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
IMPLS = (*FLASHRT, "flash", "cudnn", "efficient", "math", "flex")
DEFAULT_IMPLS = "flashrt,flashrt-fused-det,flashrt-fused,flash,cudnn"
SETS = ("grid", "seed", "quick", "long", "stack", "all")

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
    return {"grid": grid, "seed": seed, "quick": quick, "long": long, "stack": [],
            "all": grid + seed + long}[name]


def flops(c: dict, mode: str) -> float:
    f = 4 * c["B"] * c["H"] * c["S"] * c["S"] * c["D"] / (2 if c["causal"] else 1)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode]


def skip_reason(impl: str, c: dict) -> str | None:
    scores = c["B"] * c["H"] * c["S"] ** 2
    if impl == "math" and scores > MATH_MAX_SCORES:
        return (f"skipped: too large: math materialises B*H*S*S = {scores:.1e} fp32 scores per tensor "
                f"(limit {MATH_MAX_SCORES:.1e}), O(S^2) memory")
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
    flex, create_block_mask = _flex()
    mask = create_block_mask(_causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cuda") if causal else None

    def attn(q, k, v):
        o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
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


def make_attention(impl: str, causal: bool, S: int):
    """attn(q, k, v) -> out, all (B, S, heads, D), for one implementation (sequence length S)."""
    if impl in FLASHRT:
        options = FLASHRT[impl]
        return lambda q, k, v: flashrt.attention(q, k, v, causal=causal, **options)
    if impl == "flex":
        return flex_attn(causal, S)
    return sdpa_attention(SDPA[impl], causal)


# ---------------------------------------------------------------- correctness gate

def attention64(q, k, v, causal: bool, rows):
    """float64 attention; q holds query rows `rows` of the sequence, k/v all of it (Sq == Sk here,
    so bottom-right and top-left causal alignments agree)."""
    H, Hkv = q.shape[2], k.shape[2]
    k = k.double().repeat_interleave(H // Hkv, dim=2)
    v = v.double().repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.arange(k.shape[1], device=q.device)[None, :] > rows[:, None], -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def reference(q, k, v, do, causal: bool) -> dict:
    """The gate's float64 answers: output rows, and the gradients of batch 0 on as many heads as fit."""
    S, H, Hkv = q.shape[1], q.shape[2], k.shape[2]
    rows = torch.cat([torch.arange(0, 64), torch.arange(S - 64, S)]).to(q.device)
    with torch.no_grad():
        ref = {"rows": rows, "out": attention64(q[:, rows], k, v, causal, rows)}
    group = H // Hkv
    kv_heads = min(Hkv, REF_MAX_SCORES // (group * S * S))
    if kv_heads == 0:
        gib = group * S * S * 8 / 2**30
        ref["bwd_check"] = f"grads checked finite only: a float64 reference needs {gib:.0f} GiB per score tensor"
        return ref
    h = kv_heads * group
    q64, k64, v64 = (x[:1, :, :n].detach().double().requires_grad_() for x, n in ((q, h), (k, kv_heads), (v, kv_heads)))
    attention64(q64, k64, v64, causal, torch.arange(S, device=q.device)).backward(do[:1, :, :h].double())
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
    errs = {"out": rel_err(o.detach()[:, ref["rows"]], ref["out"])}
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
    q.grad = k.grad = v.grad = None
    return res


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


def bench_impl(impl: str, c: dict, inputs, ref: dict, measure) -> dict:
    """One row: skip check, correctness gate, then measure(attn); failures are recorded, never raised."""
    row = dict(c, impl=impl)
    reason = skip_reason(impl, c)
    if reason:
        row["error"] = reason
        return row
    try:
        attn = make_attention(impl, c["causal"], c["S"])
        row.update(gate(attn, *inputs, ref))
        if "error" not in row:
            row.update(measure(attn))
    except Exception as exc:  # an implementation that cannot run this case
        root = exc
        while root.__cause__ is not None:  # compile errors wrap the reason in several layers
            root = root.__cause__
        first_line = (str(root).strip().splitlines() or [""])[0]
        row["error"] = f"{type(root).__name__}: {first_line[:200]}"
        print(f"{impl} {c}:\n{traceback.format_exc(limit=-4)}", file=sys.stderr)
    for x in inputs[:3]:
        x.grad = None
    torch.cuda.empty_cache()
    return row


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


def bench_case(c: dict, impls: list[str]) -> list[dict]:
    q, k, v, do = make_inputs(c)
    ref = reference(q, k, v, do, c["causal"])
    return [bench_impl(impl, c, (q, k, v, do), ref, attention_measure(c, q, k, v, do)) for impl in impls]


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
    return [bench_impl(impl, c, (q, k, v, do), ref, stack_measure(blocks, x, dy)) for impl in impls]


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


def markdown(env: dict, rows: list[dict], summary: list[dict]) -> str:
    attention = [r for r in rows if r["set"] != "stack"]
    stack = [r for r in rows if r["set"] == "stack"]
    out = [f"{env['gpu']}, driver {env['driver']}, torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), "
           f"CuPy {env['cupy']}, NVRTC {env['nvrtc']}, flashrt {env['flashrt']}, {env['date']}", ""]
    if attention:
        out += ["## Attention (bf16; bwd = fwd+bwd - fwd)", ""] + attention_table(attention) + [""]
    if summary:
        out += ["## flash time / flashrt time (>1: flashrt faster)", ""] + ratio_table(summary) + [""]
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
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    impls = list(IMPLS) if args.impls == "all" else args.impls.split(",")
    unknown = [impl for impl in impls if impl not in IMPLS]
    if unknown:
        ap.error(f"unknown implementation(s) {unknown}; choose from {','.join(IMPLS)} or all")
    t0 = time.perf_counter()
    env = environment()
    print(json.dumps(env), flush=True)
    rows = []
    for c in attention_cases(args.set):
        for r in bench_case(c, impls):
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.set in ("stack", "all"):
        for causal in (False, True):
            for r in bench_stack(impls, causal):
                rows.append(r)
                print(json.dumps(r), flush=True)
    summary = ratios([r for r in rows if r["set"] != "stack"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"env": env, "rows": rows, "flash_over_flashrt": summary}, indent=1))
    text = markdown(env, rows, summary)
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
