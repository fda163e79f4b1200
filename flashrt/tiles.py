"""The one place that chooses tile sizes and warps for a kernel variant.

`pick_nw` walks a preference list for (family, head_dim) and returns the first
tiling whose dynamic shared memory fits the device's opt-in limit. The lists
come from the register/shared-memory budget of each kernel (no register spills
with NVRTC 12.9 and 13.0, checked by tests) and from `scripts/tune.py` on an H100:
for each bucket the first entry is the fastest spill-free tiling measured there
(docs/perf-notes.md has the numbers); later entries are for smaller shared memory.
"""
from __future__ import annotations

import functools

from . import _env
from .spec import ELEMENTWISE, FWD_WS_NO_MASKS, MASK_BITS, SM90_HEAD_DIMS, KernelSpec

# family -> [(max head_dim, [(block_m, block_n, warps[, min_blocks]), ...] in order of preference)];
# min_blocks (default 1): blocks per SM the kernel's registers must allow (spec.KernelSpec.min_blocks)
_PREFERENCES = {
    "fwd": [
        (64, [(128, 64, 4), (128, 64, 8)]),
        # 4 warps x 32 rows read each K/V fragment twice as often as 8 x 16 rows (H100 sweep: +10% / +5%
        # over 128x128 w8 at head_dim 128, non-causal / causal).
        (112, [(128, 32, 4), (128, 128, 8), (64, 64, 4)]),
        (120, [(128, 128, 8), (64, 64, 4)]),  # 128x32 w4 spills at head_dim 120 (NVRTC 12.9)
        (128, [(128, 32, 4), (128, 128, 8), (64, 64, 4)]),
        (224, [(128, 64, 8), (64, 32, 4)]),
        (240, [(128, 32, 8), (64, 32, 4)]),  # 128x64 spills 32 bytes at head_dim 232 causal (NVRTC 13.0)
        (248, [(128, 32, 8), (64, 32, 4)]),  # 128x64 spills 4 bytes at head_dim 248 (NVRTC 12.9)
        (256, [(128, 64, 8), (64, 32, 4)]),
    ],
    # wgmma (sm_90a): two warpgroups of 64 query rows; head_dim 64, 128, 192, 256 (forward_family);
    # 128-key tiles do not fit in shared memory above 128. At head_dim 64, 64-key tiles at two blocks
    # per SM (one block's softmax runs under the other's wgmmas; capped at 128 registers, 118-122 used)
    # beat 128-key tiles (193 registers, one block): H200, 1.13-1.36x at S 512-8k (docs/perf-notes.md,
    # session 6).
    "fwd_sm90": [(64, [(128, 64, 8, 2), (128, 128, 8)]), (128, [(128, 128, 8), (128, 64, 8)]), (256, [(128, 64, 8)])],
    # warp-specialised (two consumer warpgroups + a producer warpgroup), persistent (its masks: _SM90_MASK_LIMITS);
    # head_dim 192 spills at every register split between them, 256 does not fit two Q slots (perf-notes s10)
    "fwd_sm90_ws": [(128, [(128, 128, 12)])],
    # wgmma split backward (sm_90a, head_dim 64, 128, 192, 256): dQ with two warpgroups of 64 query rows,
    # dK/dV with two warpgroups of 64 keys (one warpgroup per gradient above 128) and 64-row query tiles
    # (head_dim 64: two blocks per SM, capped at 128 registers, 1-9% faster than 128-key tiles at one
    # block, H200 S 512-8k; causal and lengths variants spill: SPILL_ALLOWANCE)
    "bwd_dq_sm90": [(64, [(128, 64, 8, 2), (128, 128, 8)]), (256, [(128, 64, 8)])],
    "bwd_dkdv_sm90": [(128, [(64, 128, 8)]), (256, [(64, 64, 8)])],
    "bwd_dq": [
        (128, [(64, 64, 4)]),
        (224, [(128, 32, 8), (64, 32, 4)]),
        (248, [(128, 32, 8), (64, 16, 4)]),  # 64x32 spills at head_dim 232 (NVRTC 12.9)
        (256, [(128, 32, 8), (64, 32, 4)]),
    ],
    "bwd_dkdv": [
        (64, [(64, 64, 4), (64, 64, 8)]),
        (96, [(64, 128, 8), (64, 64, 8)]),
        (128, [(128, 64, 8), (64, 64, 8)]),  # 64x128 spills at head_dim 128 (NVRTC 12.9 and 13.0)
        (256, [(64, 64, 8), (64, 32, 8), (32, 64, 8)]),
    ],
    "bwd_fused": [
        (96, [(64, 128, 8), (64, 64, 8)]),
        # 64x128 spills 8-16 bytes at head_dim 104 and 112 (NVRTC 13.0) since the mask rework.
        (112, [(64, 64, 8)]),
        (128, [(64, 128, 8), (64, 64, 8)]),
        (256, [(64, 64, 8), (64, 32, 8), (32, 64, 8)]),
    ],
    "bwd_preprocess": [(256, [(0, 0, 8)])],
    "bwd_dkdv_reduce": [(256, [(0, 0, 8)])],
    "bwd_dq_convert": [(256, [(0, 0, 8)])],
}
# With element masks beyond lengths (window, block / segment ids), the mask predicate's
# registers make some preferred tilings spill (NVRTC 12.9, tests/test_compile.py); these
# replace them for masked variants.
_MASKED_PREFERENCES = {
    "fwd": [(192, [(128, 64, 8), (64, 64, 4)]), (256, [(64, 32, 4)])],
    # (the head_dim 64 dQ at two blocks per SM spills 8-156 bytes with window, block or segment ids)
    "bwd_dq_sm90": [(64, [(128, 128, 8)]), (256, [(128, 64, 8)])],
    "bwd_fused": [(256, [(64, 64, 8), (64, 32, 8)])],
}
# With a mask_mod expression as well, the fused backward at head_dim > 128 spills at 64x64 (12 bytes with
# every built-in mask and a tensor-reading expression, NVRTC 12.9).
_MOD_PREFERENCES = {
    "bwd_fused": [(128, [(64, 64, 8), (64, 32, 8)]), (256, [(64, 32, 8)])],
    # (the wgmma forward at head_dim 128 with 128-key tiles sits at 255 registers with an expression, no
    # spills; against 64-key tiles it is 1.12x faster on documents-mod at 8k, H200, docs/perf-notes.md s9)
    "fwd_sm90": [(64, [(128, 64, 8)]), (128, [(128, 128, 8), (128, 64, 8)]), (256, [(128, 64, 8)])],
    # (the wgmma dQ at head_dim 64 with 128-key tiles spills 32 bytes with an expression alone, NVRTC 12.9)
    "bwd_dq_sm90": [(256, [(128, 64, 8)])],
}
# Measured exceptions to "no register spills": (family, head_dim, min_blocks) -> bytes of local memory a
# variant may use. The head_dim 64 dQ at two blocks per SM (128 registers) spills 20-24 bytes in its causal
# and lengths variants and still runs 1-9% faster than at one block (H200, docs/perf-notes.md, session 6).
SPILL_ALLOWANCE = {("bwd_dq_sm90", 64, 2): 32}


def spill_allowance(spec: KernelSpec) -> int:
    """Bytes of local memory (register spills) `spec` may use: 0 unless SPILL_ALLOWANCE says otherwise."""
    return SPILL_ALLOWANCE.get((spec.family, spec.head_dim, spec.min_blocks), 0)


# Smaller tilings, tried in order when none of the preferred ones fits.
_FALLBACKS = {
    "fwd": [(64, 32, 4), (32, 32, 2), (16, 16, 1)],
    "fwd_sm90": [],
    "fwd_sm90_ws": [],
    "bwd_dq_sm90": [],
    "bwd_dkdv_sm90": [],
    "bwd_dq": [(64, 32, 4), (32, 32, 2), (16, 16, 1)],
    "bwd_dkdv": [(32, 32, 4), (16, 32, 2), (16, 16, 1)],
    "bwd_fused": [(32, 32, 4), (16, 32, 2), (16, 16, 1)],
    "bwd_preprocess": [],
    "bwd_dkdv_reduce": [],
    "bwd_dq_convert": [],
}


# wgmma kernels without a variant for some mask features: family -> rules (lo, hi, MASK_BITS): no kernel for a
# mask that holds all of those bits at lo < head_dim <= hi. The warp-specialised forward takes every mask but ids
# with mask_mod (spec.FWD_WS_NO_MASKS: 4-8 bytes of spills in its producer or consumers, whatever the register
# split, NVRTC 12.9), which take fwd_sm90. (The wgmma dQ has every mask at every head_dim since its ids became a
# key interval per row: 225-253 registers at head_dim 192 / 256, no spills; docs/perf-notes.md, "Masks at the
# seed shape".)
_SM90_MASK_LIMITS = {
    "fwd_sm90_ws": tuple((0, 256, c) for c in FWD_WS_NO_MASKS),
}


def applies(family: str, head_dim: int, arch: str, mask: int = 0) -> bool:
    """Whether `family` has a kernel for this head_dim, arch and mask (MASK_BITS); wgmma families: sm_90a,
    spec.SM90_HEAD_DIMS, _SM90_MASK_LIMITS."""
    if family not in SM90_HEAD_DIMS:
        return True
    rules = _SM90_MASK_LIMITS.get(family, ())
    return (arch == "sm_90a" and head_dim in SM90_HEAD_DIMS[family]
            and not any(lo < head_dim <= hi and mask & bits == bits for lo, hi, bits in rules))


def forward_family(head_dim: int, arch: str, smem_limit: int, mask: int = 0) -> str:
    """The forward's kernel family: the wgmma one on Hopper where it exists and fits (FLASHRT_NO_SM90=1: never);
    its warp-specialised form where that has a variant for `mask` (MASK_BITS; _SM90_MASK_LIMITS) and fits.

    H200, B=2 S=8192 H=16 bf16 (scripts/probe_sm90.py, docs/perf-notes.md): head_dim 128 422 TFLOP/s
    against 279 for fwd.cu, head_dim 64 333 against ~300; warp-specialised (session 10) 564 at head_dim 128.
    """
    no_sm90 = _env.no_sm90()
    if _sm90_fits("fwd_sm90_ws", head_dim, arch, smem_limit, no_sm90, mask):
        return "fwd_sm90_ws"
    return "fwd_sm90" if _sm90_fits("fwd_sm90", head_dim, arch, smem_limit, no_sm90) else "fwd"


def split_families(head_dim: int, arch: str, smem_limit: int, mask: int = 0) -> tuple[str, str]:
    """The split backward's (dQ, dK/dV) kernel families: each the wgmma one on Hopper where it exists (for
    this `mask`, MASK_BITS) and fits, else the mma.sync one.

    FLASHRT_NO_SM90=1: the mma.sync pair everywhere. Measurements: docs/perf-notes.md.
    """
    no_sm90 = _env.no_sm90()
    return tuple(sm90 if _sm90_fits(sm90, head_dim, arch, smem_limit, no_sm90, mask) else mma
                 for sm90, mma in (("bwd_dq_sm90", "bwd_dq"), ("bwd_dkdv_sm90", "bwd_dkdv")))


@functools.lru_cache(maxsize=None)
def _sm90_fits(family: str, head_dim: int, arch: str, smem_limit: int, no_sm90: bool, mask: int = 0) -> bool:
    """The wgmma `family` has a kernel here (applies) whose smallest tiling fits `smem_limit`."""
    if no_sm90 or not applies(family, head_dim, arch, mask):
        return False
    return min(KernelSpec(family, head_dim, "bf16", bm, bn, nw, False, arch, min_blocks=mb).smem_bytes
               for bm, bn, nw, mb in candidates(family, head_dim)) <= smem_limit


class TilingError(RuntimeError):
    """No tiling of a kernel fits the device."""


def candidates(family: str, head_dim: int, mask: int = 0) -> list[tuple[int, int, int, int]]:
    """(block_m, block_n, warps, min_blocks) of `family` at `head_dim` in order of preference."""
    table = _PREFERENCES[family]
    if mask & ~MASK_BITS["lengths"]:
        table = _MASKED_PREFERENCES.get(family, table)
    if mask & MASK_BITS["mod"]:
        table = _MOD_PREFERENCES.get(family, table)
    for max_d, prefs in table:
        if head_dim <= max_d:
            return [(*t, 1) if len(t) == 3 else t for t in prefs + [f for f in _FALLBACKS[family] if f not in prefs]]
    raise ValueError(f"head_dim must be at most 256, got {head_dim}")


def pick_nw(family: str, head_dim: int, dtype: str, causal: bool, arch: str, smem_limit: int,
            mask: int = 0, mask_mod: str = "", mod_tensors: tuple = ()) -> KernelSpec:
    """Tiles and warps for one kernel: the first preferred tiling that fits `smem_limit` bytes.

    `mask` (spec.MASK_BITS): element masks beyond lengths take _MASKED_PREFERENCES where a family has them;
    `mask_mod`, `mod_tensors`: a user's expression (spec.KernelSpec).
    """
    elementwise = family in ELEMENTWISE
    tried = []
    for bm, bn, nw, mb in candidates(family, head_dim, mask):
        try:
            spec = KernelSpec(family, head_dim, dtype, bm, bn, nw, causal and not elementwise, arch,
                              0 if elementwise else mask, "" if elementwise else mask_mod,
                              () if elementwise else tuple(mod_tensors), mb)
        except ValueError as exc:  # this tiling does not divide this head_dim; try the next
            tried.append(str(exc))
            continue
        if spec.smem_bytes <= smem_limit:
            return spec
        tried.append(f"{spec.name}: {spec.smem_bytes} B")
    raise TilingError(f"no tiling of {family} for head_dim={head_dim} fits the device's shared memory limit of "
                      f"{smem_limit} bytes per block; required: " + ", ".join(tried))


CHECK_WARPS = 16  # mask_check.cu: one block; its arrays are a few ints per token


def check_spec(arch: str) -> KernelSpec:
    """The kernel that checks a call's mask arrays on the device (kernels_cu/mask_check.cu)."""
    return KernelSpec("mask_check", 64, "bf16", 0, 0, CHECK_WARPS, False, arch)


def backward_impl(head_dim: int, deterministic: bool, ordered_ok: bool = True, wgmma_split: bool = False) -> str:
    """The faster backward for a head_dim: "fused" or "split" (flashrt.backward's impl="auto").

    `wgmma_split`: the split pair is the wgmma one (split_families): split, whose two kernels
    outrun the mma.sync fused kernel (H200 measurements in docs/perf-notes.md).
    Else, measured on the H100 (docs/perf-notes.md: scripts/tune.py and scripts/kernel_times.py):
    unordered, the fused kernel's five matmuls beat the split pair's seven up to head_dim
    128; at 256 its dQ atomics (64-key tiles, the most the dK/dV registers allow) cost what
    the recomputation saves. Ordered (deterministic), the key tiles' wait for each other
    costs 15-22%, which leaves fused ahead only where its lead was largest, head_dim 65-128.
    `ordered_ok`: whether the mask lets the fused kernel order its dQ additions (masks.Masking).
    """
    if wgmma_split:
        return "split"
    if deterministic:
        if not ordered_ok:
            return "split"
        return "fused" if 64 < head_dim <= 128 else "split"
    return "fused" if head_dim <= 128 else "split"
