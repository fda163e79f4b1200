"""GPU tests: correctness against float64, interop, strides, determinism, cache reuse, errors.

Run on a GPU machine with `pytest -m gpu`; they skip elsewhere.
"""
import itertools
import math
import os
import zlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import flashrt
from flashrt import api, launch, reference, tiles
from flashrt.spec import MASK_BITS

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def poison():
    """CuPy allocations are filled with 0xFF bytes (NaN in bf16/fp16/fp32), so an unwritten output shows. The fill is
    ordered on the current stream: on the legacy stream it could land after a kernel on a non-blocking stream wrote."""
    import cupy
    pool = cupy.cuda.MemoryPool()

    def malloc(size):
        mem = pool.malloc(size)
        cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(malloc)
    yield
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


def _tdtype(torch, dtype):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def make_inputs(torch, B, Sq, Sk, H, Hkv, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = _tdtype(torch, dtype)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dt, generator=g)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt, generator=g)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt, generator=g)
    do = torch.randn(B, Sq, H, D, device="cuda", dtype=dt, generator=g)
    return q, k, v, do


def f64(x):
    """float64 CuPy copy of a torch tensor or CuPy array (bf16 travels through torch, via DLPack)."""
    import cupy
    import torch
    if not type(x).__module__.startswith("torch"):
        x = torch.from_dlpack(x)
    return cupy.from_dlpack(x.detach().double().contiguous())


def sdpa_errors(torch, q, k, v, do, causal, refs):
    """Relative errors of torch SDPA (flash backend when it accepts the case) on the same inputs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    kwargs = {"is_causal": causal}
    if causal and Sq != Sk:
        from torch.nn.attention.bias import causal_lower_right
        kwargs = {"attn_mask": causal_lower_right(Sq, Sk)}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))
        try:
            with sdpa_kernel([backend]):
                ke = kl.repeat_interleave(H // Hkv, dim=2).transpose(1, 2)
                ve = vl.repeat_interleave(H // Hkv, dim=2).transpose(1, 2)
                o = F.scaled_dot_product_attention(ql.transpose(1, 2), ke, ve, **kwargs).transpose(1, 2)
                o.backward(do)
        except RuntimeError:
            continue
        got = [o, ql.grad, kl.grad, vl.grad]
        return [reference.rel_error(f64(x), r) for x, r in zip(got, refs)], backend.name
    raise AssertionError("no SDPA backend ran")


# (B, Sq, Sk, H, Hkv, D, causal, dtype)
CASES = (
    [(2, 77, 131, 4, 2, d, (d // 8) % 2 == 0, "bf16") for d in range(8, 257, 8)]
    + [(2, 131, 77, 4, 4, d, (d // 8) % 2 == 1, "fp16") for d in (8, 32, 64, 72, 128, 160, 200, 256)]
    + [(2, 1000, 1000, 8, 8, d, c, "bf16") for d in (64, 128, 192, 256) for c in (False, True)]
    + [(1, 300, 100, 8, 1, 128, True, "bf16"),   # Sq > Sk causal: the first 200 rows see no key
       (1, 100, 300, 8, 1, 256, True, "fp16"),
       (2, 1, 1, 2, 1, 64, False, "bf16"),
       (2, 1, 513, 8, 2, 128, True, "bf16"),      # decoding step
       (2, 1024, 1024, 8, 1, 256, False, "bf16"),  # the seed's MQA shape
       (2, 1024, 1024, 8, 1, 256, True, "bf16"),
       (3, 200, 200, 8, 2, 96, True, "fp16")]
    # more work items than SMs: the warp-specialised forward's blocks claim items from its counter
    + [(4, 1000, 1000, 8, 2, 128, c, "bf16") for c in (False, True)] + [(3, 700, 900, 16, 4, 64, True, "fp16")]
)


def _case_id(c):
    B, Sq, Sk, H, Hkv, D, causal, dtype = c
    return f"B{B}-Sq{Sq}-Sk{Sk}-H{H}-Hkv{Hkv}-D{D}-{'causal' if causal else 'full'}-{dtype}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(torch, poison, case):
    import cupy
    B, Sq, Sk, H, Hkv, D, causal, dtype = case
    q, k, v, do = make_inputs(torch, B, Sq, Sk, H, Hkv, D, dtype, seed=zlib.crc32(repr(case).encode()))
    # CuPy views of torch memory (DLPack, no copy); outputs come from the poisoned CuPy pool.
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
    out, lse = flashrt.forward(cq, ck, cv, causal=causal)
    dq, dk, dv = flashrt.backward(cdo, cq, ck, cv, out, lse, causal=causal)
    fused = flashrt.backward(cdo, cq, ck, cv, out, lse, causal=causal, impl="fused", deterministic=False)
    ordered = flashrt.backward(cdo, cq, ck, cv, out, lse, causal=causal, impl="fused", deterministic=True)
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(out, cupy.ndarray) and out.dtype == cq.dtype and lse.dtype == cupy.float32
    assert out.shape == q.shape and lse.shape == (B, H, Sq) and dk.shape == k.shape

    ro, rlse, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), causal=causal, dout=f64(do))
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv), ("fused dq", fused[0]),
                    ("fused dk", fused[1]), ("fused dv", fused[2]), ("ordered fused dq", ordered[0])):
        assert not bool(cupy.isnan(f64(x)).any()), f"{name} has NaN: unwritten (poisoned) elements"
    empty_rows = ~cupy.isfinite(rlse)
    assert bool((lse[empty_rows] == -cupy.inf).all()), "rows with no visible key must have lse = -inf"
    lse_err = float(cupy.abs(cupy.where(empty_rows, 0, f64(lse) - rlse)).max())
    assert lse_err < 1e-3

    theirs, backend = sdpa_errors(torch, q, k, v, do, causal, (ro, rdq, rdk, rdv))
    fallback = {"bf16": 2e-2, "fp16": 4e-3}[dtype]
    for impl, grads in (("split", (dq, dk, dv)), ("fused", fused), ("ordered fused", ordered)):
        ours = [reference.rel_error(f64(x), r) for x, r in zip((out, *grads), (ro, rdq, rdk, rdv))]
        for name, e, t in zip(("out", "dq", "dk", "dv"), ours, theirs):
            bound = 2 * t if math.isfinite(t) and t > 0 else fallback
            assert e <= bound, f"{impl} {name}: rel err {e:.2e} > 2x torch SDPA {backend} ({t:.2e})"


@pytest.mark.parametrize("D", [128, 256])  # fwd_sm90_ws and fwd_sm90 on an H100 / H200
@pytest.mark.parametrize("causal", [False, True])
def test_forward_over_several_l2_chunks(torch, poison, D, causal):
    """K and V too large for half the L2 in one chunk of work items: a causal launch takes the chunks
    before the last pair by pair (params.cuh: work_item), the last one query tile by query tile; every
    (query tile, head, batch entry) must be done once."""
    import cupy
    B, Sq, Sk, H, Hkv = 2, 300, 8192, 8, 4
    dev = launch.device(torch.cuda.current_device())
    assert tiles.item_chunk(dev, B, Sk, D, H, Hkv) < B * H, "the case must span more than one chunk"
    q, k, v, _ = make_inputs(torch, B, Sq, Sk, H, Hkv, D, "bf16", seed=D + causal)
    out, lse = flashrt.forward(*(cupy.from_dlpack(x) for x in (q, k, v)), causal=causal)
    ro, rlse = reference.attention(f64(q), f64(k), f64(v), causal=causal)
    assert not bool(cupy.isnan(f64(out)).any()), "unwritten (poisoned) elements"
    assert reference.rel_error(f64(out), ro) < 2e-2
    assert float(cupy.abs(f64(lse) - rlse).max()) < 1e-3


@pytest.mark.parametrize("D", [24, 40, 72, 96, 112, 160, 200, 248])
@pytest.mark.parametrize("loads", ["tma", "cp.async"])
def test_padded_head_dims_read_and_write_only_their_columns(torch, poison, monkeypatch, D, loads):
    """On Hopper a head_dim between the wgmma instances runs the next one up (tiles.sm90_head_dim), forward and
    backward: its tiles' columns past head_dim load as zeros (the TMA maps' bounds; cp.async with FLASHRT_NO_TMA=1) and
    are not stored. q, k, v, out and dout are views of wider NaN-filled tensors, so a column read past head_dim shows;
    the outputs come from the poisoned pool, so a column not written shows, and one written past head_dim lands in the
    next head's. Ragged, GQA, causal, padding lengths (split, fused, ordered fused backward), and a window over packed
    sequences; float64 reference."""
    import cupy
    dev = launch.device(torch.cuda.current_device())
    family = tiles.forward_family(D, dev.arch, dev.smem_optin)
    if tiles.sm90_head_dim(family, D) == D:
        pytest.skip(f"head_dim {D} runs a kernel of its own here ({family} on {dev.arch})")
    monkeypatch.setenv("FLASHRT_NO_TMA", "1" if loads == "cp.async" else "0")
    api._PLANS.clear()  # (the plans this test makes name the kernels it ran)

    def planned():
        return {spec.name for plan in api._PLANS.values() if plan.launches for spec, *_ in plan.launches.launches}

    def widened(x):
        x = x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
        wide = torch.full((*x.shape[:-1], D + 24), float("nan"), dtype=x.dtype, device="cuda")
        wide[..., :D] = x
        return cupy.from_dlpack(wide)[..., :D]

    B, Sq, Sk, H, Hkv = 2, 300, 517, 4, 2
    q, k, v, do = (widened(x) for x in make_inputs(torch, B, Sq, Sk, H, Hkv, D, "bf16", seed=D))
    lengths = cupy.asarray([Sk, 250], dtype=cupy.int32)
    out, lse = flashrt.forward(q, k, v, causal=True, seqlens_k=lengths)
    assert any(n.startswith(f"flashrt_{family}_hd{tiles.sm90_head_dim(family, D)}_") for n in planned())
    keep = reference.visible(B, Sq, Sk, causal=True, seqlens_k=lengths, xp=cupy)
    ro, rlse, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), mask=keep, dout=f64(do))
    assert not bool(cupy.isnan(f64(out)).any()), "out has NaN: a column read past head_dim, or one not written"
    assert reference.rel_error(f64(out), ro) < 2e-2
    seen = cupy.isfinite(rlse)  # (batch entry 1's first 50 rows see no key: lse -inf)
    assert bool((lse[~seen] == -cupy.inf).all())
    assert float(cupy.abs(cupy.where(seen, f64(lse) - rlse, 0)).max()) < 1e-3
    for impl, det in (("split", True), ("fused", False), ("fused", True)):
        grads = flashrt.backward(do, q, k, v, widened(out), lse, causal=True, seqlens_k=lengths, impl=impl,
                                 deterministic=det)
        for name, x, r in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
            assert not bool(cupy.isnan(f64(x)).any()), f"{impl} {name} has NaN: a column read past head_dim, or one " \
                                                       "not written"
            assert reference.rel_error(f64(x), r) < 2e-2, f"{impl} {name}"
    split = tiles.split_families(D, dev.arch, dev.smem_optin)
    fused = tiles.fused_family(D, dev.arch, dev.smem_optin)
    for fam in (split[1], fused):
        assert any(n.startswith(f"flashrt_{fam}_hd{tiles.sm90_head_dim(fam, D)}_") for n in planned()), fam

    lens = [200, 1, 384, 77]  # packed sequences, a window
    cu = cupy.asarray([0, *itertools.accumulate(lens)], dtype=cupy.int32)
    q, k, v = (widened(x[0]) for x in make_inputs(torch, 1, sum(lens), sum(lens), H, Hkv, D, "bf16", seed=D + 1)[:3])
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    out, _ = flashrt.forward(q, k, v, window=(64, 0), **packed)
    assert not bool(cupy.isnan(f64(out)).any()), "packed out has NaN"
    for b, (lo, hi) in enumerate(zip(cu.get()[:-1], cu.get()[1:])):
        n = int(hi - lo)
        keep = reference.visible(1, n, n, window=(64, 0), xp=cupy)
        ro = reference.attention(*(f64(x[lo:hi])[None] for x in (q, k, v)), mask=keep)[0]
        assert reference.rel_error(f64(out[lo:hi])[None], ro) < 2e-2, f"sequence {b}"


@pytest.mark.parametrize("D,Dv", [(192, 128), (128, 192), (96, 64), (64, 256), (72, 40), (256, 128), (32, 16)])
@pytest.mark.parametrize("kernels", ["default", "mma.sync"])
def test_v_head_dim_of_its_own_matches_float64(torch, poison, monkeypatch, D, Dv, kernels):
    """v's head_dim may differ from q's and k's (out, dout and dv take it; MLA's 192 / 128): the kernels run at the
    larger (or the wgmma instance above it) with each tensor's columns past its own head_dim zeros. q, k, v, dout and
    out are views of wider NaN-filled tensors, so a column read past a tensor's own head_dim shows; outputs from the
    poisoned pool. Ragged, GQA, causal, padding lengths; the forward and the split, fused and ordered fused backward;
    then packed sequences with a mask_mod (its classification kernels beside kernels compiled for both head_dims);
    against float64, on the default kernels and with FLASHRT_NO_SM90=1."""
    import cupy
    monkeypatch.setenv("FLASHRT_NO_SM90", "1" if kernels == "mma.sync" else "0")

    def widened(x):
        x = x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
        wide = torch.full((*x.shape[:-1], x.shape[-1] + 24), float("nan"), dtype=x.dtype, device="cuda")
        wide[..., :x.shape[-1]] = x
        return cupy.from_dlpack(wide)[..., :x.shape[-1]]

    B, Sq, Sk, H, Hkv = 2, 300, 517, 4, 2
    q, k, _, _ = make_inputs(torch, B, Sq, Sk, H, Hkv, D, "bf16", seed=D * 1000 + Dv)
    _, _, v, do = make_inputs(torch, B, Sq, Sk, H, Hkv, Dv, "bf16", seed=D * 1000 + Dv + 1)
    q, k, v, do = (widened(x) for x in (q, k, v, do))
    lengths = cupy.asarray([Sk, 250], dtype=cupy.int32)
    out, lse = flashrt.forward(q, k, v, causal=True, seqlens_k=lengths)
    assert out.shape == (B, Sq, H, Dv)
    keep = reference.visible(B, Sq, Sk, causal=True, seqlens_k=lengths, xp=cupy)
    ro, rlse, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), mask=keep, dout=f64(do))
    assert not bool(cupy.isnan(f64(out)).any()), "out has NaN: a column read past v's head_dim, or one not written"
    assert reference.rel_error(f64(out), ro) < 2e-2
    seen = cupy.isfinite(rlse)
    assert float(cupy.abs(cupy.where(seen, f64(lse) - rlse, 0)).max()) < 1e-3
    for impl, det in (("split", True), ("fused", False), ("fused", True)):
        grads = flashrt.backward(do, q, k, v, widened(out), lse, causal=True, seqlens_k=lengths, impl=impl,
                                 deterministic=det)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        for name, x, r in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
            assert not bool(cupy.isnan(f64(x)).any()), f"{impl} {name} has NaN"
            assert reference.rel_error(f64(x), r) < 2e-2, f"{impl} {name}"

    lens = [200, 7, 300]  # packed sequences with a mask_mod
    cu = cupy.asarray([0, *itertools.accumulate(lens)], dtype=cupy.int32)
    q, k = (widened(x[0]) for x in make_inputs(torch, 1, sum(lens), sum(lens), H, Hkv, D, "bf16", seed=D + Dv)[:2])
    v, do = (widened(x[0]) for x in make_inputs(torch, 1, sum(lens), sum(lens), H, Hkv, Dv, "bf16", seed=Dv)[2:])
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                  mask_mod="k <= q && q - k < 100")
    out, lse = flashrt.forward(q, k, v, **packed)
    grads = flashrt.backward(do, q, k, v, widened(out), lse, **packed)
    for b, (lo, hi) in enumerate(zip(cu.get()[:-1], cu.get()[1:])):
        n = int(hi - lo)
        keep = reference.visible(1, n, n, xp=cupy, mask_mod=lambda b, h, q, k, Lq, Lk: (k <= q) & (q - k < 100))
        ref = reference.attention(*(f64(x[lo:hi])[None] for x in (q, k, v)), mask=keep, dout=f64(do[lo:hi])[None])
        for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:])):
            assert not bool(cupy.isnan(f64(x[lo:hi])).any()), f"sequence {b} {name} has NaN"
            assert reference.rel_error(f64(x[lo:hi])[None], r) < 2e-2, f"sequence {b} {name}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["ragged", "padded", "varlen"])
def test_long_query_tiling_matches_float64(torch, poison, causal, case):
    """Query sequences of 4k rows and more (1.5k without a causal mask) take the long-sequence tiling where a family
    has one (tiles.long_rows: fwd_sm90_ws at head_dim 64, 192-row tiles with three consumer warpgroups on Hopper):
    ragged last tiles, GQA, padded lengths and packed varlen against float64, every element written."""
    import cupy
    B, S, H, Hkv, D = 2, 4200, 4, 2, 64
    q, k, v, _ = make_inputs(torch, B, S, S, H, Hkv, D, "bf16", seed=7 + causal)
    dev = launch.device(torch.cuda.current_device())
    if dev.arch == "sm_90a":
        spec = tiles.kernel_for("fwd_sm90_ws", D, "bf16", causal, dev, MASK_BITS["lengths"] * (case != "ragged"),
                                long=tiles.long_rows("fwd_sm90_ws", D, S, causal))
        assert spec.block_m == 192
    qc, kc, vc = (cupy.from_dlpack(x) for x in (q, k, v))
    lens = [S, 3100] if case == "varlen" else [S - 77, 1500]
    if case == "varlen":  # two sequences packed, the second of 3100 rows and keys
        cu = cupy.asarray([0, lens[0], sum(lens)], dtype=cupy.int32)
        packed = [cupy.concatenate([x[0], x[1, :lens[1]]]) for x in (qc, kc, vc)]
        out, lse = flashrt.forward(*packed, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        outs, lses = [out[:lens[0]], out[lens[0]:]], [lse[:, :lens[0]], lse[:, lens[0]:]]
        for i, n in enumerate(lens):
            ro, rlse = reference.attention(*(f64(x[i:i + 1, :n]) for x in (q, k, v)), causal=causal)
            assert not bool(cupy.isnan(f64(outs[i])).any()), "unwritten (poisoned) elements"
            assert reference.rel_error(f64(outs[i]), ro[0]) < 2e-2
            assert float(cupy.abs(f64(lses[i]) - rlse[0]).max()) < 1e-3
        return
    kw = {}
    if case == "padded":
        kw = dict(seqlens_q=cupy.asarray(lens, dtype=cupy.int32), seqlens_k=cupy.asarray(lens, dtype=cupy.int32))
    out, lse = flashrt.forward(qc, kc, vc, causal=causal, **kw)
    keep = reference.visible(B, S, S, causal=causal, xp=cupy, **kw)
    ro, rlse = reference.attention(f64(q), f64(k), f64(v), mask=keep)
    assert not bool(cupy.isnan(f64(out)).any()), "unwritten (poisoned) elements"
    assert reference.rel_error(f64(out), ro) < 2e-2
    seen = cupy.isfinite(rlse)
    assert bool((lse[~seen] == -cupy.inf).all()), "rows with no visible key must have lse = -inf"
    assert float(cupy.abs(cupy.where(seen, f64(lse) - rlse, 0)).max()) < 1e-3


def test_work_item_counter_is_ready_for_every_launch(torch, poison, monkeypatch):
    """fwd_sm90_ws claims work items from one counter per stream, which each launch's last claim sets back
    to zero (launch.sched_counter): launches back to back on one stream, with different item counts, and on
    two streams at once must each do every item once (the poisoned outputs show an item left out)."""
    monkeypatch.setenv("FLASHRT_NO_SM90", "0")  # (the Hopper kernels, whatever the suite runs under)
    import ctypes
    import cupy
    cases = [(4, 1000, 8, 2, 128, True), (1, 200, 4, 4, 64, False), (3, 700, 16, 4, 64, True),
             (2, 1024, 16, 16, 128, False)]  # (B, S, H, Hkv, D, causal)
    inputs = [make_inputs(torch, B, S, S, H, Hkv, D, "bf16", seed=40 + i)
              for i, (B, S, H, Hkv, D, _) in enumerate(cases)]
    torch.cuda.synchronize()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    results = []
    for _ in range(2):  # every case twice on each stream, without a sync in between
        for stream in streams:
            with stream:
                for (q, k, v, _), c in zip(inputs, cases):
                    out, lse = flashrt.forward(*(cupy.from_dlpack(x) for x in (q, k, v)), causal=c[-1])
                    results.append((q, k, v, c[-1], out, lse))
    cupy.cuda.Device().synchronize()
    for q, k, v, causal, out, lse in results:
        ro, rlse = reference.attention(f64(q), f64(k), f64(v), causal=causal)
        assert not bool(cupy.isnan(f64(out)).any()), "unwritten (poisoned) elements: a work item was left out"
        assert reference.rel_error(f64(out), ro) < 2e-2
        assert float(cupy.abs(f64(lse) - rlse).max()) < 1e-3
    for stream in streams:
        value = ctypes.c_int(-1)
        ptr = launch.sched_counter(launch.device(torch.cuda.current_device()), stream.ptr)
        cupy.cuda.runtime.memcpy(ctypes.addressof(value), ptr, 4, cupy.cuda.runtime.memcpyDeviceToHost)
        assert value.value == 0, f"the counter of stream {stream.ptr:#x} was left at {value.value}"


def test_torch_and_cupy_inputs_agree_bitwise(torch):
    import cupy
    q, k, v, do = make_inputs(torch, 2, 300, 257, 8, 2, 128, "bf16", seed=1)
    out_t, lse_t = flashrt.forward(q, k, v, causal=True)
    grads_t = flashrt.backward(do, q, k, v, out_t, lse_t, causal=True)
    assert isinstance(out_t, torch.Tensor) and out_t.device == q.device
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
    out_c, lse_c = flashrt.forward(cq, ck, cv, causal=True)
    grads_c = flashrt.backward(cdo, cq, ck, cv, out_c, lse_c, causal=True)
    for a, b in zip((out_t, lse_t, *grads_t), (out_c, lse_c, *grads_c)):
        assert torch.equal(a, torch.from_dlpack(b))


def test_strided_views_run_in_place(torch):
    B, S, H, D = 2, 1024, 16, 128
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)                      # slices of a packed tensor
    assert not q.is_contiguous()
    dense = [x.contiguous() for x in (q, k, v)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, lse = flashrt.forward(q, k, v, causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    outputs = out.numel() * out.element_size() + lse.numel() * 4
    assert extra < outputs + q.numel() * q.element_size() // 2, f"an input was copied: {extra} bytes allocated"
    ref_out, ref_lse = flashrt.forward(*dense, causal=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)

    bhsd = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)  # SDPA layout, transposed view
    t = bhsd.transpose(1, 2)
    o1, lse1 = flashrt.forward(t, t, t)
    o2, lse2 = flashrt.forward(t.contiguous(), t.contiguous(), t.contiguous())
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    do = torch.randn_like(o1)
    do_strided = do.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, H, S, D) memory order
    g1 = flashrt.backward(do_strided, t, t, t, o1, lse1)
    g2 = flashrt.backward(do, t.contiguous(), t.contiguous(), t.contiguous(), o2, lse2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["split", "fused", "auto"])
@pytest.mark.parametrize("H,Hkv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_deterministic(torch, impl, H, Hkv, causal):
    # Sq != Sk, both ragged; at B=2 the MQA case also takes the split dK/dV path with partials.
    q, k, v, do = make_inputs(torch, 2, 333, 401, H, Hkv, 64, "bf16", seed=7)
    first = None
    for _ in range(5):
        out, lse = flashrt.forward(q, k, v, causal=causal)
        res = (out, lse, *flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, deterministic=True))
        if first is None:
            first = res
        else:
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, res):
                assert torch.equal(a, b), f"{name} differs between identical calls"


_DIGEST_SCRIPT = textwrap.dedent("""
    import hashlib, sys, torch, flashrt
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(2, 517, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v, do = (torch.randn(2, n, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                for n, h in ((389, 1), (389, 1), (517, 8)))
    out, lse = flashrt.forward(q, k, v, causal=True)
    res = (q, k, v, do, out, lse, *flashrt.backward(do, q, k, v, out, lse, causal=True, impl="split"),
           *flashrt.backward(do, q, k, v, out, lse, causal=True, impl="fused"))
    names = ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv", "fused dq", "fused dk", "fused dv")
    print(" ".join(f"{n}:{hashlib.sha256(x.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]}"
                   for n, x in zip(names, res)))
""")


def test_bitwise_deterministic_across_processes():
    digests = set()
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                os.environ.get("PYTHONPATH")]))}, timeout=300)
        assert r.returncode == 0, r.stderr
        digests.add(r.stdout.strip())
    assert len(digests) == 1, f"two processes computed different bits: {digests}"


@pytest.mark.parametrize("D", [128, 256])  # (on Hopper: the wgmma fused kernel, the mma.sync one)
def test_nondeterministic_fused_is_close_to_split(torch, D):
    # MQA with a small grid: the fused dK/dV is split across blocks too (partials + atomics on dQ).
    q, k, v, do = make_inputs(torch, 2, 1024, 1024, 8, 1, D, "bf16", seed=5)
    out, lse = flashrt.forward(q, k, v, causal=True)
    split = flashrt.backward(do, q, k, v, out, lse, causal=True, impl="split")
    fused = flashrt.backward(do, q, k, v, out, lse, causal=True, impl="fused", deterministic=False)
    auto = flashrt.backward(do, q, k, v, out, lse, causal=True, impl="auto", deterministic=False)
    for name, a, b, c in zip(("dq", "dk", "dv"), split, fused, auto):
        for other in (b, c):
            err = ((a.float() - other.float()).norm() / a.float().norm()).item()
            assert err < 1e-2, f"{name}: split and fused differ by {err:.2e}"


@pytest.mark.parametrize("D", [64, 128, 192, 256])
@pytest.mark.parametrize("case", ["mqa-splits", "gqa-ragged-causal", "fp16-window-padding"])
def test_wgmma_split_backward_matches_mma_split(torch, poison, monkeypatch, D, case):
    """On Hopper the split backward runs bwd_dq_sm90 / bwd_dkdv_sm90; FLASHRT_NO_SM90=1 the mma.sync pair."""
    import cupy
    dev = launch.device(torch.cuda.current_device())
    if dev.arch != "sm_90a":
        pytest.skip(f"the wgmma backward is for sm_90a; this GPU is {dev.arch}")
    B, Sq, Sk, H, Hkv, causal, dtype, mask = {
        "mqa-splits": (1, 512, 512, 8, 1, False, "bf16", {}),  # 4 key tiles: dK/dV split across blocks
        "gqa-ragged-causal": (2, 333, 401, 8, 2, True, "bf16", {}),
        "fp16-window-padding": (2, 300, 300, 4, 4, True, "fp16",
                                {"window": (100, 0), "seqlens_k": cupy.array([300, 129], dtype=cupy.int32)}),
    }[case]
    q, k, v, do = (cupy.from_dlpack(x) for x in make_inputs(torch, B, Sq, Sk, H, Hkv, D, dtype, seed=D + len(case)))
    out, lse = flashrt.forward(q, k, v, causal=causal, **mask)
    monkeypatch.setenv("FLASHRT_NO_SM90", "0")
    families = tiles.split_families(D, dev.arch, dev.smem_optin, MASK_BITS["window"] | MASK_BITS["lengths"] if mask else 0)
    assert families == ("bwd_dq_sm90", "bwd_dkdv_sm90")  # (windows at head_dim 256 too: docs/perf-notes.md, The dQ kernel)
    grads = {}
    for name, flag in (("wgmma", "0"), ("mma", "1")):
        monkeypatch.setenv("FLASHRT_NO_SM90", flag)
        grads[name] = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="split", **mask)
        if name == "wgmma":
            loaded = {n for n, _ in launch._functions}
            for family in families:
                assert any(n.startswith(f"flashrt_{family}_hd{D}_{dtype}_") for n in loaded), (family, D)
    keep = reference.visible(B, Sq, Sk, causal=causal, xp=cupy, **mask)
    _, _, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
    for name, ref, a, b in zip(("dq", "dk", "dv"), (rdq, rdk, rdv), grads["wgmma"], grads["mma"]):
        assert not bool(cupy.isnan(f64(a)).any()), f"wgmma {name} has NaN: unwritten (poisoned) elements"
        ours, theirs = reference.rel_error(f64(a), ref), reference.rel_error(f64(b), ref)
        assert ours <= 1.5 * theirs + 1e-3, f"{name}: wgmma rel err {ours:.2e}, mma.sync {theirs:.2e}"


def _close_and_bitwise_the_same(grads: list, refs: tuple, between: str) -> None:
    """grads[0]'s (dq, dk, dv) written everywhere (no poisoned NaN) and close to the float64 refs; every later set
    bitwise the same."""
    import cupy
    for i, (name, ref) in enumerate(zip(("dq", "dk", "dv"), refs)):
        assert not bool(cupy.isnan(f64(grads[0][i])).any()), f"{name} has NaN: unwritten (poisoned) elements"
        assert reference.rel_error(f64(grads[0][i]), ref) < 2e-2, name
        assert all(bool((g[i] == grads[0][i]).all()) for g in grads[1:]), f"{name} differs between {between}"


@pytest.mark.parametrize("D", [64, 128])
def test_ordered_fused_backward_with_splits_and_a_window(torch, poison, monkeypatch, D):
    """The ordered (deterministic) wgmma fused backward when its key tiles are split across blocks (MQA, few key
    tiles) and a window gives the key tiles different query spans, so that their pairs fall into splits differently:
    it runs on the key-tile-major grid there (kernels_cu/sm90/bwd_fused_sm90_ws.cu; docs/perf-notes.md: Ordered grid),
    where no block waits for one that starts after it. Close to float64, and bitwise the same over repeats."""
    import cupy
    monkeypatch.setenv("FLASHRT_NO_SM90", "0")  # (the Hopper kernel, whatever the suite runs under)
    dev = launch.device(torch.cuda.current_device())
    if dev.arch != "sm_90a":
        pytest.skip(f"the wgmma fused backward is for sm_90a; this GPU is {dev.arch}")
    B, S, H, Hkv, window = 1, 1000, 8, 1, (100, 50)
    spec = tiles.kernel_for("bwd_fused_sm90", D, "bf16", False, dev, MASK_BITS["window"])
    assert tiles.dkdv_splits(spec, B, H, Hkv, S, S, dev.sm_count) > 1  # (the case this test is for)
    q, k, v, do = (cupy.from_dlpack(x) for x in make_inputs(torch, B, S, S, H, Hkv, D, "bf16", seed=D + 7))
    out, lse = flashrt.forward(q, k, v, window=window)
    grads = [flashrt.backward(do, q, k, v, out, lse, window=window, impl="fused", deterministic=True)
             for _ in range(3)]
    assert any(n.startswith(f"flashrt_bwd_fused_sm90_hd{D}_") for n, _ in launch._functions)
    keep = reference.visible(B, S, S, window=window, xp=cupy)
    _, _, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
    _close_and_bitwise_the_same(grads, (rdq, rdk, rdv), "repeats")


@pytest.mark.parametrize("D", [64, 128])
def test_ordered_causal_fused_backward_in_chunks_of_pairs(torch, poison, monkeypatch, D):
    """The ordered causal wgmma fused backward runs its key tiles key-tile-major within chunks of (batch entry, KV
    head) pairs (tiles.ordered_key_chunk; kernels_cu/attention/params.cuh: key_block_tile_major): whatever the chunk,
    one pair, an uneven last chunk or all pairs, each query tile takes its key tiles' dQ in the same order, so the
    gradients are bitwise the same, and close to float64."""
    import cupy
    dev = launch.device(torch.cuda.current_device())
    if dev.arch != "sm_90a":
        pytest.skip(f"the wgmma fused backward is for sm_90a; this GPU is {dev.arch}")
    monkeypatch.setenv("FLASHRT_NO_SM90", "0")  # (the Hopper kernel, whatever the suite runs under)
    B, Sq, Sk, H, Hkv = 3, 2000, 2048, 4, 2  # 6 pairs; enough key tiles for one split (no dK/dV partials)
    spec = tiles.kernel_for("bwd_fused_sm90", D, "bf16", True, dev, 0)
    assert tiles.dkdv_splits(spec, B, H, Hkv, Sq, Sk, dev.sm_count) == 1  # (the case this test is for)
    q, k, v, do = (cupy.from_dlpack(x) for x in make_inputs(torch, B, Sq, Sk, H, Hkv, D, "bf16", seed=D + 3))
    out, lse = flashrt.forward(q, k, v, causal=True)
    grads, asked = {}, []
    for chunk in (1, 4, 0):
        monkeypatch.setattr(tiles, "ordered_key_chunk", lambda dev, pairs, splits, c=chunk: asked.append(pairs) or c)
        api._PLANS.clear()
        grads[chunk] = flashrt.backward(do, q, k, v, out, lse, causal=True, impl="fused", deterministic=True)
    assert asked == [B * Hkv] * 3  # (the plans took these chunks)
    assert any(n.startswith(f"flashrt_bwd_fused_sm90_hd{D}_") for n, _ in launch._functions)
    keep = reference.visible(B, Sq, Sk, causal=True, xp=cupy)
    _, _, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
    _close_and_bitwise_the_same([grads[c] for c in (1, 4, 0)], (rdq, rdk, rdv), "chunks of 1, 4 and all pairs")


@pytest.mark.parametrize("D,B,Sq,Sk,H,Hkv,lengths", [(64, 2, 1000, 1500, 12, 3, False),
                                                     (128, 4, 1500, 520, 8, 4, False), (128, 3, 900, 1100, 6, 3, True)])
def test_ordered_fused_backward_rotated(torch, poison, monkeypatch, D, B, Sq, Sk, H, Hkv, lengths):
    """The ordered non-causal wgmma fused backward visits each key tile's query tiles rotated by the key tile, and
    adds each query tile's dQ in the order the key tiles reach it (tiles.rotate_ordered_dq;
    kernels_cu/attention/params.cuh: dq_turn): with more key tiles than query tiles (several key tiles at one step),
    fewer, and padding lengths. Close to float64 and bitwise the same over repeats; and in another order than without
    the rotation (the bits differ: at 4 or more key tiles fp32 sums in two orders do not agree everywhere), so the
    rotated order ran."""
    import cupy
    dev = launch.device(torch.cuda.current_device())
    if dev.arch != "sm_90a":
        pytest.skip(f"the wgmma fused backward is for sm_90a; this GPU is {dev.arch}")
    monkeypatch.setenv("FLASHRT_NO_SM90", "0")  # (the Hopper kernel, whatever the suite runs under)
    family = "bwd_fused_sm90"
    spec = tiles.kernel_for(family, D, "bf16", False, dev, MASK_BITS["lengths"] if lengths else 0)
    key_tiles = -(-Sk // spec.block_n)
    assert tiles.dkdv_splits(spec, B, H, Hkv, Sq, Sk, dev.sm_count) == 1  # (one split: the rotation's case)
    assert tiles.rotate_ordered_dq(dev, key_tiles, 1, False) and key_tiles >= 4
    q, k, v, do = (cupy.from_dlpack(x) for x in make_inputs(torch, B, Sq, Sk, H, Hkv, D, "bf16", seed=D + Sq))
    kw = {}
    if lengths:
        kw = dict(seqlens_q=cupy.asarray([Sq - 130, Sq, Sq - 64][:B], dtype=cupy.int32),
                  seqlens_k=cupy.asarray([Sk, Sk - 300, Sk - 1][:B], dtype=cupy.int32))
    out, lse = flashrt.forward(q, k, v, **kw)
    grads = [flashrt.backward(do, q, k, v, out, lse, impl="fused", deterministic=True, **kw) for _ in range(3)]
    assert any(n.startswith(f"flashrt_{family}_hd{D}_") for n, _ in launch._functions)
    keep = reference.visible(B, Sq, Sk, xp=cupy, **{n: cupy.asnumpy(a) for n, a in kw.items()})
    _, _, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
    _close_and_bitwise_the_same(grads, (rdq, rdk, rdv), "repeats")
    monkeypatch.setattr(tiles, "ORDERED_ROTATION_SM_SHARE", 0.0)
    api._PLANS.clear()
    in_order = flashrt.backward(do, q, k, v, out, lse, impl="fused", deterministic=True, **kw)
    assert reference.rel_error(f64(in_order[0]), rdq) < 2e-2
    assert not bool((in_order[0] == grads[0][0]).all()), "dq came out bitwise as without the rotation"


@pytest.mark.parametrize("D,Sq,Sk,causal", [(128, 700, 900, False), (64, 1000, 1500, False), (128, 520, 777, True),
                                          (64, 900, 600, "top_left")])
def test_ordered_first_turn_stores_match_zeroed_accumulator(torch, poison, monkeypatch, D, Sq, Sk, causal):
    """The ordered wgmma fused backward stores each query tile's first dQ turn where every query row sees a key
    (BwdParams::dq_first_store), over a NaN-poisoned dq_accum that bwd_preprocess leaves unzeroed; with
    FLASHRT_NO_DQ_FIRST_STORE=1 it zeroes and adds. The same adds in the same order: equal values (a store of -0 may
    keep its sign where 0 + -0 gives +0), no NaN, close to float64."""
    import cupy
    dev = launch.device(torch.cuda.current_device())
    if dev.arch != "sm_90a":
        pytest.skip(f"the wgmma fused backward is for sm_90a; this GPU is {dev.arch}")
    monkeypatch.setenv("FLASHRT_NO_SM90", "0")
    B, H, Hkv = 2, 6, 2
    q, k, v, do = (cupy.from_dlpack(x) for x in make_inputs(torch, B, Sq, Sk, H, Hkv, D, "bf16", seed=D + Sk))
    out, lse = flashrt.forward(q, k, v, causal=causal)
    grads, stores = {}, []
    api._PLANS.clear()
    first_turn_stores = api._first_turn_stores
    monkeypatch.setattr(api, "_first_turn_stores", lambda m: stores.append(first_turn_stores(m)) or stores[-1])
    for flag in ("0", "1"):
        monkeypatch.setenv("FLASHRT_NO_DQ_FIRST_STORE", flag)
        grads[flag] = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="fused", deterministic=True)
    assert stores == [True, False]  # (a plan each: the variable is in the plan key)
    assert any(n.startswith(f"flashrt_bwd_fused_sm90_hd{D}_") for n, _ in launch._functions)
    align = "top_left" if causal == "top_left" else "bottom_right"
    keep = reference.visible(B, Sq, Sk, causal=bool(causal), align=align, xp=cupy)
    _, _, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
    for name, ref, a, b in zip(("dq", "dk", "dv"), (rdq, rdk, rdv), grads["0"], grads["1"]):
        assert not bool(cupy.isnan(f64(a)).any()), f"{name} has NaN: an unwritten (poisoned) dq_accum row"
        assert bool((a == b).all()), f"{name}: the first-turn stores and the zeroed accumulator differ"
        assert reference.rel_error(f64(a), ref) < 2e-2, name


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", ["gqa-ragged-causal", "varlen"])
def test_fused_backward_without_tma_is_bitwise_the_same(torch, poison, monkeypatch, D, case):
    """On Hopper the fused backward's loader takes whole tiles by TMA and ragged ones (and everything with
    FLASHRT_NO_TMA=1) by loads and stores (kernels_cu/sm90/bwd_fused_sm90_ws.cu): the same inputs reach the same
    wgmmas, so the ordered result is bitwise the same, and close to float64."""
    import cupy
    dev = launch.device(torch.cuda.current_device())
    if dev.arch != "sm_90a":
        pytest.skip(f"the wgmma fused backward is for sm_90a; this GPU is {dev.arch}")
    if case == "varlen":  # packed sequences: the maps' one batch entry, tiles cut at every sequence's end
        lens = [200, 1, 384, 77]
        cu = cupy.asarray([0, *itertools.accumulate(lens)], dtype=cupy.int32)
        q, k, v, do = (cupy.from_dlpack(x[0]) for x in make_inputs(torch, 1, sum(lens), sum(lens), 8, 2, D, "bf16",
                                                                     seed=D))
        mask, causal = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens)), True
    else:
        q, k, v, do = (cupy.from_dlpack(x) for x in make_inputs(torch, 2, 333, 401, 8, 2, D, "bf16", seed=D + 1))
        mask, causal = {}, True
    out, lse = flashrt.forward(q, k, v, causal=causal, **mask)
    grads = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FLASHRT_NO_TMA", flag)
        grads[flag] = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="fused", **mask)
    assert any(n.startswith(f"flashrt_bwd_fused_sm90_hd{D}_") for n, _ in launch._functions)
    for name, a, b in zip(("dq", "dk", "dv"), grads["0"], grads["1"]):
        assert not bool(cupy.isnan(f64(a)).any()), f"{name} has NaN: unwritten (poisoned) elements"
        assert bool((a == b).all()), f"{name}: the TMA loads and the plain loads differ"
    if not mask:
        keep = reference.visible(2, 333, 401, causal=True, xp=cupy)
        _, _, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
        for name, ref, a in zip(("dq", "dk", "dv"), (rdq, rdk, rdv), grads["0"]):
            assert reference.rel_error(f64(a), ref) < 2e-2, name


def test_autograd_function(torch):
    q, k, v, do = make_inputs(torch, 2, 200, 180, 8, 4, 128, "fp16", seed=3)
    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    out = flashrt.attention(ql, kl, vl, causal=True)
    out.backward(do)
    ref_out, lse = flashrt.forward(q, k, v, causal=True)
    dq, dk, dv = flashrt.backward(do, q, k, v, ref_out, lse, causal=True)
    assert torch.equal(out.detach(), ref_out)
    assert torch.equal(ql.grad, dq) and torch.equal(kl.grad, dk) and torch.equal(vl.grad, dv)
    # out.sum() sends an expanded (stride 0) gradient; the autograd layer must cope.
    ql.grad = None
    flashrt.attention(ql, kl, vl).float().sum().backward()
    assert ql.grad is not None and torch.isfinite(ql.grad).all()


def test_empty_inputs(torch):
    q, k, v, do = make_inputs(torch, 2, 5, 0, 4, 2, 64, "bf16", seed=0)
    out, lse = flashrt.forward(q, k, v)
    assert out.shape == q.shape and bool((out == 0).all()) and bool((lse == -math.inf).all())
    dq, dk, dv = flashrt.backward(do, q, k, v, out, lse)
    assert bool((dq == 0).all()) and dk.shape == k.shape
    q, k, v, do = make_inputs(torch, 0, 5, 7, 4, 2, 64, "bf16", seed=0)
    out, lse = flashrt.forward(q, k, v)
    assert out.shape == (0, 5, 4, 64) and lse.shape == (0, 4, 5)


def test_launches_on_the_current_torch_stream(torch):
    q, k, v, _ = make_inputs(torch, 2, 512, 512, 8, 8, 64, "bf16", seed=5)
    expected, _ = flashrt.forward(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q2 = q * 1  # produced on the side stream
        out, _ = flashrt.forward(q2, k, v)
    side.synchronize()
    assert torch.equal(out, expected)


def test_input_errors_are_clear(torch):
    q, k, v, _ = make_inputs(torch, 1, 64, 64, 2, 2, 64, "bf16", seed=0)
    with pytest.raises(TypeError, match="float32.*bfloat16 and float16"):
        flashrt.forward(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="host memory"):
        flashrt.forward(q.cpu(), k.cpu(), v.cpu())
    flat = torch.randn(64 * 2 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    shifted = flat[1:].view(1, 64, 2, 64)  # storage offset of one element: base not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte aligned"):
        flashrt.forward(shifted, k, v)
    with pytest.raises(ValueError, match="last .head_dim. axis"):
        flashrt.forward(q.transpose(1, 3), k, v)
    with pytest.raises(ValueError, match="multiple of"):
        flashrt.forward(q, k[:, :, :1].expand(1, 64, 3, 64), v[:, :, :1].expand(1, 64, 3, 64))
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        x = torch.randn(1, 8, 2, 12, device="cuda", dtype=torch.bfloat16)
        flashrt.forward(x, x, x)


def test_dynamic_smem_attribute_matches_spec(torch):
    dev = launch.device(torch.cuda.current_device())
    sm90 = ("fwd_sm90", "fwd_sm90_ws", "bwd_dq_sm90", "bwd_dkdv_sm90") if dev.arch == "sm_90a" else ()
    for family in ("fwd", "bwd_dq", "bwd_dkdv", *sm90):
        spec = tiles.kernel_for(family, 128, "bf16", False, dev)
        attrs = launch.function_attributes(spec, dev)
        if spec.smem_bytes > 48 * 1024:
            assert attrs["max_dynamic_shared_size_bytes"] == spec.smem_bytes
        assert attrs["local_size_bytes"] == 0


def test_prewarmed_matrix_has_no_spills(torch):
    """Compile the full matrix for this GPU (in parallel), softcapped, ALiBi and dropout variants included, then check
    every kernel's local memory."""
    from flashrt import cli
    dev = launch.device(torch.cuda.current_device())
    cli.prewarm(None, list(range(8, 257, 8)), ["bf16", "fp16"], jobs=os.cpu_count() or 1, quiet=True, softcap=True,
                alibi=True, dropout=True)
    spilled = []
    for spec in cli.matrix(dev.arch, dev.smem_optin, range(8, 257, 8), ["bf16", "fp16"], softcap=True, alibi=True,
                           dropout=True):
        attrs = launch.function_attributes(spec, dev)
        if attrs["local_size_bytes"] > tiles.spill_allowance(spec):
            spilled.append(f"{spec.name}: {attrs}")
    assert not spilled, "\n".join(spilled)


def test_second_process_hits_the_cache():
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        import torch, flashrt
        from flashrt import cache
        q = torch.randn(1, 100, 4, 72, device="cuda", dtype=torch.float16)
        out, lse = flashrt.forward(q, q, q, causal=True)
        flashrt.backward(out, q, q, q, out, lse, causal=True)
        torch.cuda.synchronize()
        print("ok")
    """)
    env = dict(os.environ)
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    env["FLASHRT_NO_COMPILE"] = "1"  # any compile would now raise CacheMiss
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "ok" in second.stdout, second.stderr
