"""Every kernel family compiles with NVRTC for real archs, with no GPU, and without register spills.

CI compiles a representative subset of head dims here; the GPU run prewarms the
full matrix (every multiple of 8 up to 256) through `flashrt prewarm`.

The variants compile in worker processes that start as soon as the session is collected (conftest.py moves the tests
that read them to the session's end): the other tests run meanwhile, sharing the cores. In processes, not threads:
other tests monkeypatch flashrt.nvrtc meanwhile.
"""
import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import os
import re
import time

import pytest

from flashrt import cache, nvrtc, tiles
from flashrt.cli import SMEM_OPTIN
from flashrt.spec import (DROPOUT_FAMILIES, ELEMENTWISE, FAMILIES, MASK_BITS, NO_INPUTS, PACKED_ROWS, QUERY_PARALLEL,
                          SCORE_MOD_FAMILIES, SOFTCAP_FAMILIES, V_DIM_FAMILIES, KernelSpec)

HEAD_DIMS = (8, 40, 64, 72, 128, 160, 192, 256)
ARCHS = ("sm_80", "sm_90a")


def _variants():
    out = set()
    for arch in ARCHS:
        limit = SMEM_OPTIN[int(arch[3:5])]
        for family in set(FAMILIES) - set(NO_INPUTS) - set(PACKED_ROWS):
            for d in (d for d in HEAD_DIMS if tiles.applies(family, d, arch)):
                for dtype in ("bf16", "fp16"):
                    for causal in (False, True):
                        out.add(tiles.tiling(family, d, dtype, causal, arch, limit))
        # kernels_cu/sm80/decode.cu, one per block_m: off the 16-byte grid, 128, 256, and rows whose 16-byte chunks do not
        # divide the threads (its loader's second form; at 240 a last partial round at 32 and 16-key tiles)
        for d in (8, 72, 128, 192, 240, 256):
            out.update(tiles.decode_variants(d, "bf16" if d % 16 else "fp16", arch, limit))  # (all: the GPU run)
    out.update(tiles.decode_variants(128, "bf16", "sm_86", SMEM_OPTIN[86]))  # (smaller tiles, fewer warps: 99 KB)
    # the backward with 99 KB (sm_86, sm_89) where its fallback tiles take over (2 warps spilled 16-540 bytes there)
    # and where masks' static shared memory left no room beside the preferred tiles (sm_80 ids at 208; sm_86 248)
    for family in ("bwd_dq", "bwd_dkdv", "bwd_fused"):
        for mod in ({}, {"dropout": 8}):
            out.add(tiles.tiling(family, 256, "bf16", True, "sm_86", SMEM_OPTIN[86], **mod))
    ids = MASK_BITS["lengths"] | MASK_BITS["segments"]
    out.update(tiles.tiling(family, 208, "bf16", True, "sm_80", SMEM_OPTIN[80], ids) for family in ("fwd", "bwd_dq"))
    out.update(tiles.tiling(family, 248, "bf16", True, "sm_86", SMEM_OPTIN[86], ids) for family in ("fwd", "bwd_dq"))
    out.add(tiles.tiling("bwd_fused", 240, "bf16", True, "sm_86", SMEM_OPTIN[86], ids, alibi=True))
    out.update(tiles.decode_variants(248, "bf16", "sm_90a", SMEM_OPTIN[90]))  # (16-key tiles at 64 rows: spills)
    # Masked variants (kernels_cu/attention/mask.cuh): every feature at once, lengths alone (padding / varlen),
    # lengths with a window (Visibility::visible's branch-free form, taken without id arrays), and
    # segment ids alone (documents: before TileIntervals, two of these spilled where every feature did not).
    for family in set(FAMILIES) - set(ELEMENTWISE) - set(NO_INPUTS) - set(PACKED_ROWS):
        for d in (64, 128, 160, 256):
            for causal in (False, True):
                for mask in (sum(MASK_BITS.values()) & ~MASK_BITS["mod"], MASK_BITS["lengths"],
                             MASK_BITS["lengths"] | MASK_BITS["window"], MASK_BITS["segments"]):
                    if tiles.applies(family, d, "sm_90a", mask):
                        out.add(tiles.tiling(family, d, "bf16", causal, "sm_90a", SMEM_OPTIN[90], mask))
    # mask_mod variants (an expression that reads a tensor and names every variable) with every
    # built-in feature and alone, and their classifiers (kernels_cu/helpers/mask_classify.cu).
    for family in set(FAMILIES) - set(ELEMENTWISE) - set(NO_INPUTS) - set(PACKED_ROWS):
        for d in (64, 128, 256):
            for mask in (m for m in (sum(MASK_BITS.values()), MASK_BITS["mod"])
                         if tiles.applies(family, d, "sm_90a", m)):
                spec = tiles.tiling(family, d, "bf16", True, "sm_90a", SMEM_OPTIN[90], mask, MOD_EXPR, ("doc",))
                out.update([spec, tiles.classifier_spec(spec, "mask_map"),
                            tiles.classifier_spec(spec, "mask_rows" if family in QUERY_PARALLEL else "mask_cols")])
    out.update(tiles.check_spec(arch) for arch in ARCHS)  # kernels_cu/helpers/mask_check.cu
    # The forward with mask_mod, lengths and a window, not causal: fwd_sm90_ws's fenced element mask beside
    # the length tests (it spilled 128 bytes at head_dim 128 before the sequence's ends took the rolled loop).
    mask = MASK_BITS["mod"] | MASK_BITS["lengths"] | MASK_BITS["window"]
    for d in (64, 128):
        out.add(tiles.tiling("fwd_sm90_ws", d, "bf16", False, "sm_90a", SMEM_OPTIN[90], mask, MOD_EXPR, ("doc",)))
    # softcap and ALiBi (kernels_cu/attention/score_mod.cuh) in every family that computes scores, alone and with
    # every built-in mask feature
    for mod in ({"softcap": True}, {"alibi": True}):
        for arch in ARCHS:
            for family in set(SOFTCAP_FAMILIES) - set(PACKED_ROWS):
                for d in (d for d in (64, 96, 128, 192, 256) if tiles.applies(family, d, arch, **mod)):
                    for causal in (False, True):
                        for mask in (0, sum(MASK_BITS.values()) & ~MASK_BITS["mod"]):
                            if tiles.applies(family, d, arch, mask, **mod):
                                out.add(tiles.tiling(family, d, "bf16", causal, arch, SMEM_OPTIN[int(arch[3:5])],
                                                     mask, **mod))
    # decode with a softcap or ALiBi (kernels_cu/sm80/decode.cu): every block_m, off the 16-byte grid, 128 and 256
    for mod in ({"softcap": True}, {"alibi": True}):
        for arch in ARCHS:
            for d in (72, 128, 256):
                out.update(tiles.decode_variants(d, "bf16", arch, SMEM_OPTIN[int(arch[3:5])], **mod))
    # a user's score_mod (score_mod.cuh: ScoreMod; in the backward's kernels its automatic derivative, dual.cuh) in
    # every family that takes one, at the tilings tiles.tiling picks for it: each of SCORE_MODS at head_dim 64 (every
    # family has a variant there), one at 128 and 256: the relative-bias table (a tensor read per element) at 128, the
    # capped score (tanhf and its derivative) at 256, where it takes the most registers of the three (NVRTC 12.9)
    for arch in ARCHS:
        for family in SCORE_MOD_FAMILIES:
            for d in (64, 128, 256):
                for score in SCORE_MODS.values() if d == 64 else (SCORE_MODS["rel" if d == 128 else "cap"],):
                    if tiles.applies(family, d, arch, score_mod=score):
                        for causal in (False, True):
                            out.add(tiles.tiling(family, d, "bf16", causal, arch, SMEM_OPTIN[int(arch[3:5])],
                                                 score_mod=score))
    # the dQ kernel's tensor-gradient pass (bwd_dq.cu: FRT_SCORE_TGRAD), two learned tensors and an int one, by fp32
    # atomics and into exact sums (deterministic: score_mod.cuh's tensor_grad_add)
    for arch in ARCHS:
        for d in (64, 128, 256):
            for kind in ("float_grad", "float_grad_exact"):
                learned = (LEARNED[0], "", tuple((n, kind if t == "float_grad" else t) for n, t in LEARNED[2]))
                out.add(tiles.tiling("bwd_dq", d, "bf16", True, arch, SMEM_OPTIN[int(arch[3:5])], score_mod=learned))
    # tilings for long query sequences (tiles.long_rows): plain, lengths, softcap, ALiBi
    for d in (64, 128, 256):
        for causal in (False, True):
            for mask, mod in ((0, {}), (MASK_BITS["lengths"], {}), (0, {"softcap": True}), (0, {"alibi": True})):
                if tiles.long_rows("fwd_sm90_ws", d, 1 << 30):
                    out.add(tiles.tiling("fwd_sm90_ws", d, "bf16", causal, "sm_90a", SMEM_OPTIN[90], mask, long=True,
                                         **mod))
    # Dropout (kernels_cu/attention/dropout.cuh) at both resolutions in every family that has it, both archs, dense
    # and with every built-in mask feature, at the head dims of each tiling bucket that _DROPOUT_PREFERENCES changes.
    for arch in ARCHS:
        for family in DROPOUT_FAMILIES:
            for d in (40, 64, 128, 192, 256):
                for causal, mask in ((False, 0), (True, sum(MASK_BITS.values()) & ~MASK_BITS["mod"])):
                    for bits in (8, 16):
                        if tiles.applies(family, d, arch, mask, dropout=bits):
                            out.add(tiles.tiling(family, d, "bf16", causal, arch, SMEM_OPTIN[int(arch[3:5])], mask,
                                                 dropout=bits))
                            if family == "fwd_sm90_ws" and tiles.long_rows(family, d, 1 << 30):  # (192-row tiles)
                                for m in {mask, 0}:  # (causal without masks too: the unmasked loops spilled there)
                                    out.add(tiles.tiling(family, d, "bf16", causal, arch, SMEM_OPTIN[90], m, long=True,
                                                         dropout=bits))
    # v with a head_dim of its own (spec.KernelSpec.head_dims: the mma.sync kernels' columns at compile time), both
    # archs, MLA's 192 / 128 and the reverse order at 64 / 96, dense and with every built-in mask feature
    for arch in ARCHS:
        for family in V_DIM_FAMILIES:
            for dims in ((192, 128), (64, 96)):
                for causal, mask in ((False, 0), (True, sum(MASK_BITS.values()) & ~MASK_BITS["mod"])):
                    spec = tiles.tiling(family, max(dims), "bf16", causal, arch, SMEM_OPTIN[int(arch[3:5])], mask)
                    out.add(dataclasses.replace(spec, head_dims=dims))
    # fwd_sm90_ws at head_dims it pads (spec.KernelSpec.qk_width, v_width: S and O over their own columns): 48 at 64
    # (O at 64: all of it), 80 and 96 at 128, 160 at 192, 224 at 256; dense, causal with every built-in mask feature,
    # the long-row tiling, dropout, softcap
    for d, width in ((64, 48), (128, 80), (128, 96), (192, 160), (256, 224)):
        for causal, mask, mod in ((False, 0, {}), (True, sum(MASK_BITS.values()) & ~MASK_BITS["mod"], {}),
                                  (True, 0, {"dropout": 8}), (False, 0, {"softcap": True})):
            if tiles.applies("fwd_sm90_ws", d, "sm_90a", mask, **mod):
                for long in (False, True)[:1 + tiles.long_rows("fwd_sm90_ws", d, 1 << 30)]:
                    spec = tiles.tiling("fwd_sm90_ws", d, "bf16", causal, "sm_90a", SMEM_OPTIN[90], mask, long=long,
                                        **mod)
                    out.add(dataclasses.replace(spec, qk_width=width, v_width=tiles.v_width(spec.family, d, width)))
    # the mma.sync backward with swizzled tiles (_Swizzled), both archs, dense and with every built-in mask feature
    for arch in ARCHS:
        for family in ("bwd_dq", "bwd_dkdv", "bwd_fused"):
            for d, causal, mask in ((64, True, 0), (128, True, 0), (256, False, 0),
                                    (128, True, sum(MASK_BITS.values()) & ~MASK_BITS["mod"])):
                spec = tiles.tiling(family, d, "bf16", causal, arch, SMEM_OPTIN[int(arch[3:5])], mask)
                if spec.swizzle_fits:
                    out.add(_Swizzled(**_fields(spec)))
    return sorted(out, key=lambda s: s.name)


@dataclasses.dataclass(frozen=True)
class _Swizzled(KernelSpec):
    """A mma.sync variant with swizzled tiles whether or not its layout fits (the kernel's static_assert decides): the
    backward's, which spec.SWIZZLED_BWD_HEAD_DIMS turns on only where measured faster (scripts/probes/bwd_swizzle.py),
    are compiled here (where they fit) so that what the probe measures is proven first."""

    @property
    def swizzled(self) -> bool:
        return True


# Spills of _Swizzled variants that SWIZZLED_BWD_HEAD_DIMS does not ship (NVRTC 12.9): before it takes one, its spills
# need a measured exception in tiles.SPILL_ALLOWANCE or other tiles.
UNSHIPPED_SPILLS = {("bwd_fused", 128, "sm_90a"): 8}  # (4 bytes of spill stores, an 8-byte stack)


MOD_EXPR = "doc[b * Lq + q] == doc[b * Lk + k] || (h & 1) == 0 || k < 8"
# score_mod expressions (spec.KernelSpec.score_mod): a capped score, an ALiBi-like bias over a slopes tensor, and a
# relative-position bias table (H, 8191) read per element
SCORE_MODS = {
    "cap": ("30.f * tanhf(s / 30.f)", "", ()),
    "alibi": ("s - slopes[h] * fabsf((float)(k - q))", "", (("slopes", "float"),)),
    "rel": ("s + bias[h * 8191 + k - q + 4095]", "", (("bias", "float"),)),
}


# a score_mod whose float tensors take a gradient (spec.SCORE_TENSOR_TYPES' "float_grad")
LEARNED = ("s * w[h] + bias[h * 8191 + k - q + 4095] + 0.1f * (float)ids[k]", "",
           (("w", "float_grad"), ("bias", "float_grad"), ("ids", "int")))


def _compile_verbose(spec: KernelSpec, fresh: bool = False) -> tuple[bytes, str]:
    # fresh: an unused define makes the program new to NVRTC, whose CUDA 13 release returns a program it
    # compiled before, in this process or an earlier one, with an empty log (no ptxas report): a value of its own.
    extra = [f"-DFRT_FRESH_COMPILE={os.getpid()}_{time.monotonic_ns()}"] if fresh else []
    return nvrtc.compile_cubin(spec.translation_unit(), spec.name, spec.options() + ["-Xptxas=-v"] + extra,
                               cache.kernel_sources())


def _proof(spec: KernelSpec) -> tuple[bool, bool, str]:
    """One variant's compile: (the cubin is an ELF, its entry symbol is in it, NVRTC's log)."""
    cubin, log = _compile_verbose(spec)
    # NVRTC 13.0 gives an empty log for a program this process compiled before, and once gave one under 16
    # parallel compiles: compile those again as new programs.
    if "bytes spill stores" not in log:
        cubin, log = _compile_verbose(spec, fresh=True)
    return cubin[:4] == b"\x7fELF", spec.name.encode() in cubin, log


_started: tuple | None = None  # (variants, their futures, the pool): start_compiling


def start_compiling() -> None:
    """Start compiling every variant in the background, once (conftest.py: at the end of collection)."""
    global _started
    if _started is None:
        variants = _variants()
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
        pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers,
                                                      mp_context=multiprocessing.get_context("spawn"))
        _started = variants, [pool.submit(_proof, spec) for spec in variants], pool


def stop_compiling() -> None:
    """Cancel the compiles not yet started and stop the workers (conftest.py: at the session's end)."""
    if _started is not None:
        _started[2].shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def compiled():
    start_compiling()
    variants, futures, pool = _started
    results = {spec: f.result() for spec, f in zip(variants, futures)}
    pool.shutdown()
    return results


def test_nvrtc_version_supported():
    assert nvrtc.version()[0] in (12, 13)
    assert 80 in nvrtc.supported_archs() and 90 in nvrtc.supported_archs()


def test_every_family_compiles_for_each_arch(compiled):
    assert {s.family for s in compiled} == set(FAMILIES)
    assert {s.arch for s in compiled} == set(ARCHS) | {"sm_86"}
    for spec, (elf, named, _) in compiled.items():
        assert elf, spec.name
        assert named, f"{spec.name}: entry symbol missing from the cubin"


def test_no_register_spills(compiled):
    spilled = []
    for spec, (_, _, log) in compiled.items():
        stores = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
        stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
        assert stores, f"{spec.name}: no resource usage in NVRTC's log"
        unshipped = UNSHIPPED_SPILLS.get((spec.family, spec.head_dim, spec.arch), 0) if type(spec) is _Swizzled else 0
        if max(stores + stack) > tiles.spill_allowance(spec) + unshipped:
            spilled.append(f"{spec.name}: spill stores {stores}, stack {stack}")
    assert not spilled, "\n".join(spilled)


def test_static_shared_memory_is_within_its_bound(compiled):
    # The tiling leaves KernelSpec.static_smem_bound beside the dynamic block (tiles._first_fit); a kernel whose static
    # plus dynamic shared memory passes the arch's limit does not launch.
    over = []
    for spec, (_, _, log) in compiled.items():
        static = max([int(x) for x in re.findall(r"(\d+) bytes smem", log)] or [0])
        if spec.smem_bytes and static > spec.static_smem_bound:  # (kernels with a dynamic block: the tiled ones)
            over.append(f"{spec.name}: {static} bytes of static shared memory, bound {spec.static_smem_bound}")
        if static + spec.smem_bytes > SMEM_OPTIN[int(spec.arch[3:5])]:
            over.append(f"{spec.name}: {static} + {spec.smem_bytes} bytes, limit {SMEM_OPTIN[int(spec.arch[3:5])]}")
    assert not over, "\n".join(over)


def test_no_serialised_wgmma(compiled):
    # ptxas falls back to waiting for every wgmma where it cannot prove the asynchronous ones safe (an
    # accumulator read before its wait, a loop it takes to be divergent): the kernels still run, slower.
    serial = [f"{spec.name}: {line.strip()}" for spec, (_, _, log) in compiled.items()
              for line in log.splitlines() if "wgmma.mma_async instructions are serialized" in line]
    assert not serial, "\n".join(serial)


def test_smem_mismatch_is_a_compile_error():
    spec = tiles.tiling("fwd", 64, "bf16", False, "sm_80", SMEM_OPTIN[80])
    options = [o if not o.startswith("-DFRT_SMEM_BYTES=") else "-DFRT_SMEM_BYTES=1234" for o in spec.options()]
    with pytest.raises(nvrtc.CompileError) as info:
        nvrtc.compile_cubin(spec.translation_unit(), spec.name, options, cache.kernel_sources())
    err = info.value
    assert err.name == spec.name and "-DFRT_SMEM_BYTES=1234" in err.options
    assert "launcher and kernel disagree on dynamic shared memory" in err.log
    assert spec.name in str(err)


def test_unsupported_arch_is_rejected():
    with pytest.raises(ValueError, match="sm_80 or sm_90a"):
        nvrtc.check_arch("ampere")
    with pytest.raises(ValueError, match="cannot compile for sm_10"):
        nvrtc.check_arch("sm_10")


def _unchecked(**fields) -> KernelSpec:
    """A KernelSpec with these fields and no __post_init__ (so, no layout_problem): the tiling as the kernel sees it."""
    values = {f.name: f.default for f in dataclasses.fields(KernelSpec) if f.default is not dataclasses.MISSING}
    values.update(fields)
    spec = object.__new__(KernelSpec)
    for name, value in values.items():
        object.__setattr__(spec, name, value)
    return spec


def _fields(spec: KernelSpec) -> dict:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(KernelSpec)}


def _host_refusal(spec: KernelSpec) -> str | None:
    try:
        KernelSpec(**_fields(spec))
    except ValueError as exc:
        return str(exc)
    return None


def _kernel_refusal(spec: KernelSpec) -> str | None:
    """The compile errors of the variant's front end (NVRTC -fdevice-syntax-only: templates instantiated and
    static_asserts evaluated, no code made), or None."""
    try:
        nvrtc.compile_cubin(spec.translation_unit(), spec.name, spec.options() + ["-fdevice-syntax-only"],
                            cache.kernel_sources())
    except nvrtc.CompileError as exc:
        return " | ".join(line.strip() for line in exc.log.splitlines() if "error" in line) or exc.log
    return None


def test_host_layout_rules_are_the_kernels_static_asserts():
    """KernelSpec.layout_problem (and __post_init__'s per-family refusals) and the kernels' static_asserts agree: over
    a grid of tilings around the accepted ones, for every tiled family, the host refuses exactly the tilings whose
    kernel does not compile. (Some refusals show as a division by zero: bwd_dkdv's GEMMs with no warp layout,
    decode with fewer warps than 16-row slices.)"""
    cases = []
    for family, dims in (("fwd", (64,)), ("bwd_dq", (64,)), ("bwd_dkdv", (64, 128)), ("bwd_fused", (64, 128))):
        for D, bm, bn, nw in itertools.product(dims, (32, 40, 64, 128), (32, 64, 128), (2, 4, 8)):
            cases.append(_unchecked(family=family, head_dim=D, dtype="bf16", block_m=bm, block_n=bn, warps=nw,
                                    causal=True, arch="sm_80"))
    for family in ("fwd_sm90", "fwd_sm90_ws", "bwd_dq_sm90", "bwd_dkdv_sm90", "bwd_fused_sm90"):
        for D, bm, bn, nw in itertools.product((64, 128, 256), (64, 128, 192), (64, 80, 128), (8, 12, 16)):
            cases.append(_unchecked(family=family, head_dim=D, dtype="bf16", block_m=bm, block_n=bn, warps=nw,
                                    causal=True, arch="sm_90a"))
    # the warp-specialised forward's wider key tiles: 96 / 112 at head_dim 192, 176 at 128 not causal (one Q slot), and
    # none of them with a mask_mod (FwdRows::mod_mask)
    for D, bn, causal, mask in itertools.product((128, 192, 256), (96, 112, 176), (False, True), (0, MASK_BITS["mod"])):
        cases.append(_unchecked(family="fwd_sm90_ws", head_dim=D, dtype="bf16", block_m=128, block_n=bn, warps=12,
                                causal=causal, arch="sm_90a", mask=mask, mask_mod="k <= q" if mask else ""))
    for D, bm, bn, nw in itertools.product((64, 128, 256), (16, 32, 64), (16, 32, 64), (2, 4, 8)):
        cases.append(_unchecked(family="decode", head_dim=D, dtype="bf16", block_m=bm, block_n=bn, warps=nw,
                                causal=False, arch="sm_80"))
    # dropout's draws of 16 query columns in the mma.sync dK/dV kernels' S^T (spec: layout_problem)
    for family, bm, bn, nw in itertools.product(("bwd_dkdv", "bwd_fused"), (16, 32, 64), (32, 64), (2, 4, 8)):
        cases.append(_unchecked(family=family, head_dim=64, dtype="bf16", block_m=bm, block_n=bn, warps=nw,
                                causal=True, arch="sm_80", dropout=8))
    # the per-family refusals of __post_init__ that a static_assert makes too
    for family, D in (("bwd_dkdv_sm90", 64), ("bwd_dkdv_sm90", 128), ("bwd_fused_sm90", 64)):
        spec = tiles.tiling(family, D, "bf16", True, "sm_90a", SMEM_OPTIN[90])
        cases.append(_unchecked(**dict(_fields(spec), dropout=8)))
    cases.append(_unchecked(**dict(_fields(cases[-1]), score_mod=("s * 0.5f", "", ()))))

    def verdicts(spec):
        return spec, _host_refusal(spec), _kernel_refusal(spec)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # (NVRTC releases the GIL)
        results = list(pool.map(verdicts, cases))
    differ = [f"{s.name}: host {h or 'accepts'}; kernel {k or 'compiles'}"
              for s, h, k in results if (h is None) != (k is None)]
    assert not differ, "\n".join(differ)
    accepted = sum(h is None for _, h, _ in results)
    assert 50 < accepted < len(results) - 100, "the grid must hold both kinds"


def test_swizzle_rule_is_the_kernels_static_assert():
    """KernelSpec.swizzle_fits and the mma.sync kernels' static_asserts on swizzled tiles agree over the valid
    tilings of a grid around the shipped ones (bwd_dkdv / bwd_fused: the column groups of their dK/dV and dQ GEMMs)."""
    cases = []
    for family in ("fwd", "bwd_dq", "bwd_dkdv", "bwd_fused"):
        for D, bm, bn, nw in itertools.product((64, 96, 128, 192, 256), (32, 64), (32, 64, 128), (4, 8)):
            spec = _unchecked(family=family, head_dim=D, dtype="bf16", block_m=bm, block_n=bn, warps=nw, causal=True,
                              arch="sm_80")
            if _host_refusal(spec) is None:
                cases.append(_Swizzled(**_fields(spec)))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda spec: (spec, _kernel_refusal(spec)), cases))
    differ = [f"{s.name} {s.block_m}x{s.block_n}w{s.warps}: host {'fits' if s.swizzle_fits else 'refuses'}; "
              f"kernel {k or 'compiles'}" for s, k in results if s.swizzle_fits != (k is None)]
    assert not differ, "\n".join(differ)
    fits = sum(s.swizzle_fits for s in cases)
    assert 20 < fits < len(cases) - 20, "the grid must hold both kinds"
