"""The one place that chooses: which kernel family runs, its tiles and warps, and the launch shape.

spec.py says what a variant is (name, options, shared memory) and which tilings are valid; launch.py loads and
launches what this module chooses. Sections, in order:

  Families      applies, forward_family, split_families, fused_family, backward_impl: which kernels run a call.
  Tilings       kernel_for (a device's kernel; what api.py calls), tiling (the same for an arch and a
                shared-memory limit), candidates: the tiles and warps of one kernel. tiling walks a
                preference list for (family, head_dim, mask) and returns the first tiling whose dynamic
                shared memory fits the limit. The lists come from the register/shared-memory budget of each
                kernel (no register spills with NVRTC 12.9 and 13.0, checked by tests) and from
                `scripts/tune.py` on an H100: for each bucket the first entry is the fastest spill-free tiling
                measured there (docs/perf-notes.md has the numbers, a section per kernel family); later entries are
                for smaller shared memory.
  Helper kernels  classifier_spec (mask_mod's tile maps and lists), check_spec (the device check of mask arrays).
  Launch shapes   map_slots, item_chunk, key_item_chunk, ordered_key_chunk, dkdv_splits: how a launch's work is
                chunked and split.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import TYPE_CHECKING

from . import _env
from .spec import (ANY_HEAD_DIM, DROPOUT_FAMILIES, ELEMENTWISE, FWD_WS_NO_MASKS, MASK_BITS, SCORE_MOD_FAMILIES,
                   SM90_HEAD_DIMS, SOFTCAP_FAMILIES, V_WIDTHS, KernelSpec)

if TYPE_CHECKING:
    from .launch import Device


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------
# Families: which kernels run a call
# ---------------------------------------------------------------------------
# Masks the wgmma kernels are not chosen for: family -> rules (lo, hi, MASK_BITS): no kernel for a
# mask that holds all of those bits at lo < head_dim <= hi. The warp-specialised forward takes every mask but ids
# with mask_mod (spec.FWD_WS_NO_MASKS: 4-8 bytes of spills in its producer or consumers, whatever the register
# split, NVRTC 12.9), which take fwd_sm90. (The wgmma dQ has every mask at every head_dim since its ids became a
# key interval per row: 225-253 registers at head_dim 192 / 256, no spills; docs/perf-notes.md, "Masks at the
# seed shape".)
_SM90_MASK_LIMITS = {
    "fwd_sm90_ws": tuple((0, 256, c) for c in FWD_WS_NO_MASKS),
}


# Masks the wgmma kernels are not chosen for with a score modification (softcap, ALiBi, score_mod), as
# _SM90_MASK_LIMITS: the warp-specialised fused backward at head_dim 128 takes no id masks with one (ALiBi with segment
# ids and lengths spilled 76 bytes, over SPILL_ALLOWANCE; NVRTC 12.9), which backward_impl never sends to it anyway.
_SCORE_MOD_MASK_LIMITS = {
    "bwd_fused_sm90": ((64, 128, MASK_BITS["block_ids"]), (64, 128, MASK_BITS["segments"])),
}


# ... with dropout (the draws' registers; NVRTC 12.9): the warp-specialised forward above head_dim 192 (12-28 bytes of
# spills with 64-key tiles, 64 with 80-key ones), the wgmma dK/dV kernel at 128 (causal: 8-36 bytes wherever its bits
# are made; backward_impl takes the fused kernel there), the wgmma dQ at 256 with block or segment ids (4-8 bytes
# causal). A split pair with one of them limited runs both on mma.sync (split_families).
_DROPOUT_MASK_LIMITS = {
    "fwd_sm90_ws": ((192, 256, 0),),
    "bwd_dkdv_sm90": ((64, 128, 0),),
    "bwd_dq_sm90": ((192, 256, MASK_BITS["block_ids"]), (192, 256, MASK_BITS["segments"])),
}


# Padded head_dims: a head_dim between the wgmma instances (spec.SM90_HEAD_DIMS) runs the next instance up in these
# families, from PADDED_FROM on: the tiles' columns past it are loaded as zeros (the TMA maps' bounds, cp.async with
# source size 0) and not stored (kernels_cu/attention/params.cuh: head_dim), so that one cubin serves the instance and
# every head_dim padded to it. Measured against mma.sync's own variant at that head_dim: docs/perf-notes.md, "Padded
# head_dims".
PADDED_FAMILIES = ("fwd_sm90", "fwd_sm90_ws", "bwd_dq_sm90", "bwd_dkdv_sm90", "bwd_fused_sm90")
PADDED_FROM = 24


def sm90_head_dim(family: str, head_dim: int) -> int:
    """The head_dim of `family`'s kernel for the tensors' `head_dim`: the next wgmma instance up where the family pads
    (PADDED_FAMILIES, from PADDED_FROM), else head_dim itself."""
    if family not in PADDED_FAMILIES or head_dim < PADDED_FROM:
        return head_dim
    return next((d for d in SM90_HEAD_DIMS[family] if d >= head_dim), head_dim)


def qk_width(family: str, instance: int, qk_dim: int) -> int:
    """The columns fwd_sm90_ws's S = Q K^T covers for q's and k's head_dim `qk_dim` in its `instance` (sm90_head_dim):
    qk_dim rounded up to 16 where that is under the instance (its tiles, zero past qk_dim, skip the k-steps that would
    add only zeros: kernels_cu/sm90/fwd_sm90_ws.cu, FwdWsTraits::QK_STEPS), else 0 (all of them)."""
    width = -(-qk_dim // 16) * 16
    return width if family == "fwd_sm90_ws" and width < instance else 0


def v_width(family: str, instance: int, v_dim: int) -> int:
    """The columns fwd_sm90_ws's O = P V covers for v's head_dim `v_dim` in its `instance`: the narrowest of
    spec.V_WIDTHS that holds v_dim, where that is under the instance (FwdWsTraits::DV), else 0 (all of them)."""
    width = next((w for w in V_WIDTHS if w >= v_dim), instance)
    return width if family == "fwd_sm90_ws" and width < instance else 0


def applies(family: str, head_dim: int, arch: str, mask: int = 0, softcap: bool = False, alibi: bool = False,
            score_mod: tuple = (), dropout: bool = False) -> bool:
    """Whether `family` has a kernel for this head_dim, arch and mask (MASK_BITS) (and softcap, ALiBi or a score_mod;
    dropout); wgmma families: sm_90a, spec.SM90_HEAD_DIMS (the head_dims they have a variant at, which KernelSpec
    checks), _SM90_MASK_LIMITS, _SCORE_MOD_MASK_LIMITS, _DROPOUT_MASK_LIMITS."""
    if family not in SM90_HEAD_DIMS:
        return True
    rules = _SM90_MASK_LIMITS.get(family, ()) + (_SCORE_MOD_MASK_LIMITS.get(family, ())
                                                 if softcap or alibi or score_mod else ())
    if dropout:
        rules += _DROPOUT_MASK_LIMITS.get(family, ())
    return (arch == "sm_90a" and head_dim in SM90_HEAD_DIMS[family]
            and not any(lo < head_dim <= hi and mask & bits == bits for lo, hi, bits in rules))


def forward_family(head_dim: int, arch: str, smem_limit: int, mask: int = 0, dropout: bool = False) -> str:
    """The forward's kernel family: the wgmma one on Hopper where it exists and fits (FLASHRT_NO_SM90=1: never);
    its warp-specialised form where that has a variant for `mask` (MASK_BITS; _SM90_MASK_LIMITS) and `dropout`
    (_DROPOUT_MASK_LIMITS) and fits; at the tensors' `head_dim` padded as the family pads it (sm90_head_dim).

    H200, B=2 S=8192 H=16 bf16 (scripts/probes/probe_sm90.py, docs/perf-notes.md: Forward: wgmma (fwd_sm90)): head_dim
    128 422 TFLOP/s against 279 for fwd.cu, head_dim 64 333 against ~300; warp-specialised ("Forward:
    warp-specialised persistent (fwd_sm90_ws)") 564 at head_dim 128.
    """
    no_sm90, ws = _env.no_sm90(), sm90_head_dim("fwd_sm90_ws", head_dim)
    if (_sm90_fits("fwd_sm90_ws", ws, arch, smem_limit, no_sm90, mask)
            and applies("fwd_sm90_ws", ws, arch, mask, dropout=dropout)):
        return "fwd_sm90_ws"
    plain = _sm90_fits("fwd_sm90", sm90_head_dim("fwd_sm90", head_dim), arch, smem_limit, no_sm90)
    return "fwd_sm90" if plain else "fwd"


def split_families(head_dim: int, arch: str, smem_limit: int, mask: int = 0, dropout: bool = False) -> tuple[str, str]:
    """The split backward's (dQ, dK/dV) kernel families: each the wgmma one on Hopper where it exists (for
    this `mask`, MASK_BITS, and `dropout`) and fits, else the mma.sync one; at the tensors' `head_dim` padded as the
    families pad it (sm90_head_dim).

    FLASHRT_NO_SM90=1: the mma.sync pair everywhere. Measurements: docs/perf-notes.md, Backward: wgmma split
    (bwd_dq_sm90, bwd_dkdv_sm90).
    """
    no_sm90 = _env.no_sm90()
    pair = tuple(sm90 if _sm90_fits(sm90, sm90_head_dim(sm90, head_dim), arch, smem_limit, no_sm90, mask)
                 and applies(sm90, sm90_head_dim(sm90, head_dim), arch, mask, dropout=dropout) else mma
                 for sm90, mma in (("bwd_dq_sm90", "bwd_dq"), ("bwd_dkdv_sm90", "bwd_dkdv")))
    if dropout and pair[0].endswith("_sm90") != pair[1].endswith("_sm90"):  # (one of them limited: both mma.sync)
        return "bwd_dq", "bwd_dkdv"
    return pair


def fused_family(head_dim: int, arch: str, smem_limit: int, mask: int = 0, softcap: bool = False,
                 alibi: bool = False, score_mod: tuple = ()) -> str:
    """The fused backward's kernel family: the wgmma one (bwd_fused_sm90, head_dim 64 / 128) on Hopper where it fits
    (and has a variant for the mask with a softcap / ALiBi / score_mod: _SCORE_MOD_MASK_LIMITS), else the mma.sync one
    (FLASHRT_NO_SM90=1: always); at the tensors' `head_dim` padded as the family pads it (sm90_head_dim)."""
    padded = sm90_head_dim("bwd_fused_sm90", head_dim)
    sm90 = (applies("bwd_fused_sm90", padded, arch, mask, softcap, alibi, score_mod)
            and _sm90_fits("bwd_fused_sm90", padded, arch, smem_limit, _env.no_sm90(), mask))
    return "bwd_fused_sm90" if sm90 else "bwd_fused"


@functools.cache
def _sm90_fits(family: str, head_dim: int, arch: str, smem_limit: int, no_sm90: bool, mask: int = 0) -> bool:
    """The wgmma `family` has a kernel here (applies) whose smallest tiling fits `smem_limit`."""
    if no_sm90 or not applies(family, head_dim, arch, mask):
        return False
    return min(KernelSpec(family, head_dim, "bf16", bm, bn, nw, False, arch, min_blocks=mb).smem_bytes
               for bm, bn, nw, mb in candidates(family, head_dim)) <= smem_limit


# Where the warp-specialised wgmma fused backward (bwd_fused_sm90) beats the wgmma split pair: (head_dim, its query
# tile, deterministic, causal) -> the least query length it is chosen from (absent: never). H200, flashrt.backward
# alone at 16k tokens and hidden 2048, S = 1k / 4k / 16k (scripts/probes/bwd_fused_ws.py; docs/perf-notes.md:
# Backward: fused wgmma):
# unordered 1.13-1.48x the split pair at head_dim 128; at 64 with 128-query tiles 1.21-1.40x, causal at 1k 1.07x
# (64-query tiles, which masks beyond lengths and score mods take: 1.06-1.23x but causal at 1k, 0.96x); ordered at
# 128 1.08-1.33x non-causal; at 64 with 128-query tiles 0.91-0.97x at 1k and 1.04-1.41x from 4k (64-query: 0.83-0.93x
# up to 4k and 1.13x at 16k). Ordered causal, on its grid in chunks of pairs (ordered_key_chunk; docs/perf-notes.md:
# Ordered causal grid by pairs; scripts/probes/ordered_pairs.py, 16k tokens and more, H100 / H200): at 128 1.04x /
# 1.11x at 1k, 1.17x / 1.20x at 2k, 1.14-1.29x / 1.27-1.32x from 4k; at 64 0.90x / 0.96x at 1k, 1.08x / 1.13x at 2k,
# 1.32-1.42x / 1.26-1.42x from 4k. With fewer blocks (H100, fewer tokens) it fell behind where its key tiles made one
# or two blocks per SM: 0.68-0.76x at 128 / 132 SMs (head_dim 128 1k 1 x 8 and 1 x 16, 64 2k 1 x 8), 0.91-1.00x at
# 256 / 132 (128 1k 2 x 16, 2k 1 x 16), 0.99x at 128 1k 512 / 132, 1.19-1.37x at 64 2k-4k 512 / 132: hence 2k, and
# ORDERED_CAUSAL_MIN_WAVES.
FUSED_WGMMA_MIN_SQ = {(128, 64, False, False): 0, (128, 64, False, True): 0, (128, 64, True, False): 0,
                      (128, 64, True, True): 2048,
                      (64, 128, False, False): 0, (64, 128, False, True): 0, (64, 128, True, False): 4096,
                      (64, 128, True, True): 2048,
                      (64, 64, False, False): 0, (64, 64, False, True): 4096, (64, 64, True, False): 16384,
                      (64, 64, True, True): 16384}
# ... ordered, where its query tiles run rotated (rotate_ordered_dq: not causal, one split; docs/perf-notes.md:
# Ordered grid): at 64 with 128-query tiles 1.16x / 1.30x /
# 1.41x / 1.43x the split pair at 1k / 2k / 4k / 8k (H200), 1.13x / 1.28x / 1.35x at 1k / 2k / 4k (H100;
# scripts/probes/bwd_fused_ws.py, 16k tokens).
FUSED_WGMMA_MIN_SQ_ROTATED = {(64, 128, True, False): 0}
# ... with a score modification (softcap, ALiBi, score_mod), where the split pair computes it twice (P in both kernels)
# and the fused kernel once: entries that differ from FUSED_WGMMA_MIN_SQ's. flashrt.backward alone, the same shapes,
# softcap, ALiBi and the three score_mod expressions of scripts/probes/bwd_mods_impl.py (docs/perf-notes.md: Backward:
# impl choice and determinism), fused / split at head_dim 64 (64-query tiles), H200 and H100: unordered causal
# 0.81-0.99x / 0.86-1.02x at 1k; ordered 0.88-1.07x / 0.91-1.11x at 1k, 0.79-0.95x at 4k on both; ordered causal at
# 4k 0.79-1.00x / 0.92-1.23x (ALiBi 1.23x on the H100: left at 16k, 0.71-0.88x). At 128 as without one (ordered causal
# at 1k 0.95-1.15x / 1.22-1.50x, fused from 4k: 0.70-0.83x / 0.77-1.00x). Ordered causal on its grid in chunks of
# pairs (H100, benchmarks/results/h100-2026-11-27-bwd-mods-ordered-chunks.md, fused / split time): at 128 0.79-0.90x
# at 2k, 0.69-0.80x at 4k; at 64 (64-query tiles) 0.84-1.01x at 2k, 0.81-0.97x at 4k: from 2k, as without one.
# ALiBi's 128-query tiles at 64 (_ALIBI_PREFERENCES; H200, benchmarks/results/h200-2026-11-28-alibi.md), ordered
# non-causal: 1.15x / 1.40x / 1.42x the split pair at 1k / 4k / 16k (causal from 2k as without one: 0.95x at 1k).
FUSED_WGMMA_MIN_SQ_MODIFIED = {(64, 64, False, True): 0, (64, 64, True, False): 4096, (64, 64, True, True): 2048,
                               (64, 128, True, False): 0}
ORDERED_CAUSAL_MIN_WAVES = 2  # (backward_impl: key tiles of every pair, per SM)


def backward_impl(head_dim: int, deterministic: bool, ordered_ok: bool = True, wgmma_split: bool = False,
                  fused_wgmma: bool = False, causal: bool = False, seqlen_q: int = 0, mask: int = 0,
                  fused_block_m: int = 64, modified: bool = False, key_waves: float = float("inf"),
                  rotated: bool = False) -> str:
    """The faster backward for a call: "fused" or "split" (flashrt.backward's impl="auto").

    `wgmma_split`: the split pair is the wgmma one (split_families); `fused_wgmma`: so is the fused kernel
    (fused_family). Then split, but fused from the query length FUSED_WGMMA_MIN_SQ gives per (head_dim, the fused
    kernel's query tile `fused_block_m`, deterministic, causal) on (`seqlen_q`; GQA alike: 1.08-1.35x the split pair
    at 32/8 and 16/2, H200), or FUSED_WGMMA_MIN_SQ_MODIFIED with a score modification (`modified`), and with no id or
    mask_mod masks (`mask`, MASK_BITS: not measured); ordered and causal, only where its grid of key tiles fills the
    SMs ORDERED_CAUSAL_MIN_WAVES times (`key_waves`: its blocks per SM; it runs one block per SM); where its query tiles
    run rotated (`rotated`: rotate_ordered_dq), from FUSED_WGMMA_MIN_SQ_ROTATED's length.
    With the wgmma split pair and mma.sync fused kernel (head_dim 192 / 256): split, whose two kernels outrun it (H200
    measurements in docs/perf-notes.md: Backward: impl choice and determinism).
    Else, measured on the H100 (docs/perf-notes.md: Backward: impl choice and determinism; scripts/tune.py and
    scripts/kernel_times.py):
    unordered, the fused kernel's five matmuls beat the split pair's seven up to head_dim
    128; at 256 its dQ atomics (64-key tiles, the most the dK/dV registers allow) cost what
    the recomputation saves. Ordered (deterministic), the key tiles' wait for each other
    costs 15-22%, which leaves fused ahead only where its lead was largest, head_dim 65-128.
    `ordered_ok`: whether the mask lets the fused kernel order its dQ additions (masks.Masking).
    """
    if wgmma_split:
        plain = not mask & (MASK_BITS["block_ids"] | MASK_BITS["segments"] | MASK_BITS["mod"])
        key = (head_dim, fused_block_m, bool(deterministic), bool(causal))
        least = FUSED_WGMMA_MIN_SQ.get(key)
        if modified:
            least = FUSED_WGMMA_MIN_SQ_MODIFIED.get(key, least)
        elif rotated:
            least = FUSED_WGMMA_MIN_SQ_ROTATED.get(key, least)
        if (fused_wgmma and plain and least is not None and seqlen_q >= least
                and (ordered_ok or not deterministic)
                and (key_waves >= ORDERED_CAUSAL_MIN_WAVES or not (deterministic and causal))):
            return "fused"
        return "split"
    if deterministic:
        if not ordered_ok:
            return "split"
        return "fused" if 64 < head_dim <= 128 else "split"
    return "fused" if head_dim <= 128 else "split"


# ---------------------------------------------------------------------------
# Tilings: the tiles and warps of one kernel
# ---------------------------------------------------------------------------
# Tilings of every kernel: family -> [(max head_dim, [(block_m, block_n, warps[, min_blocks]), ...] in order of
# preference)], the first bucket whose max head_dim is at least the head_dim; min_blocks (default 1): blocks per SM
# the kernel's registers must allow (spec.KernelSpec.min_blocks). Chosen by scripts/tune.py (H100) and the wgmma
# sweeps (H200) cited per entry: the first entry of a bucket is the fastest spill-free tiling measured there, later
# ones fit smaller shared memory; spills: tests/test_compile.py.
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
    # beat 128-key tiles (193 registers, one block): H200, 1.13-1.36x at S 512-8k (docs/perf-notes.md:
    # Forward: wgmma (fwd_sm90)).
    "fwd_sm90": [(64, [(128, 64, 8, 2), (128, 128, 8)]), (128, [(128, 128, 8), (128, 64, 8)]), (256, [(128, 64, 8)])],
    # warp-specialised (two consumer warpgroups + a producer warpgroup), persistent (its masks: _SM90_MASK_LIMITS);
    # above head_dim 128 one Q slot (spec.KernelSpec.q_slots) and 112-key tiles at 192 (0.99x 80-key ones with two
    # slots at S=1k, 1.06-1.12x from 2k, H200), 80 at 256 (1.00-1.10x 64-key ones; docs/perf-notes.md: head_dim 192 and
    # 256); at head_dim 64 from 4k query rows (1.5k not causal) 192-row tiles (_LONG_PREFERENCES)
    "fwd_sm90_ws": [(128, [(128, 128, 12)]), (192, [(128, 112, 12)]), (256, [(128, 80, 12)])],
    # wgmma split backward (sm_90a, head_dim 64, 128, 192, 256): dQ with two warpgroups of 64 query rows,
    # dK/dV with two warpgroups of 64 keys (one warpgroup per gradient above 128) and 64-row query tiles
    # (head_dim 64: two blocks per SM, capped at 128 registers, 1-9% faster than 128-key tiles at one
    # block, H200 S 512-8k; causal and lengths variants spill: SPILL_ALLOWANCE)
    "bwd_dq_sm90": [(64, [(128, 64, 8, 2), (128, 128, 8)]), (256, [(128, 64, 8)])],
    "bwd_dkdv_sm90": [(128, [(64, 128, 8)]), (256, [(64, 64, 8)])],
    # fused wgmma backward (dK/dV + dQ by bulk reduce-add; head_dim 64, 128): the dK/dV kernel's tiles, warp-specialised
    # (two consumer warpgroups + a producer warpgroup, kernels_cu/sm90/bwd_fused_sm90_ws.cu)
    "bwd_fused_sm90": [(64, [(128, 128, 12)]), (128, [(64, 128, 12)])],
    "bwd_dq": [
        (128, [(64, 64, 4)]),
        (224, [(128, 32, 8), (64, 32, 4)]),
        (248, [(128, 32, 8), (64, 16, 4)]),  # 64x32 spills at head_dim 232 (NVRTC 12.9)
        # (64x16 where 64x32 does not fit: the fallback 32x32 w2 spilled 16-36 bytes with 99 KB, sm_86 / sm_89)
        (256, [(128, 32, 8), (64, 32, 4), (64, 16, 4)]),
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
    "decode_combine": [(256, [(0, 0, 8)])],
    "combine": [(256, [(0, 0, 8)])],
    "combine_f32": [(256, [(0, 0, 8)])],
    "combine_rows": [(256, [(0, 0, 8, 4)])],
    "combine_rows_f32": [(256, [(0, 0, 8, 4)])],
}
# Tilings of softcap and ALiBi variants (spec.KernelSpec.softcap, alibi), family -> buckets as in _PREFERENCES,
# replacing the family's: the modification's registers make these preferred tilings spill (NVRTC 12.9,
# tests/test_compile.py): bwd_dq 64x32 at head_dim 256 causal (softcap and ALiBi 24 bytes, sm_80), bwd_fused 64x128
# at 96 (softcap 4 bytes) and at 128 with masks (8 bytes), and 64x64 / 32x64 with 8 warps at head_dim 248 causal
# (ALiBi 4-8 bytes on sm_90a; 64x32 with 8 warps: none, with or without masks).
_SCORE_MOD_PREFERENCES = {
    "bwd_dq": [(128, [(64, 64, 4)]), (224, [(128, 32, 8), (64, 32, 4)]), (256, [(128, 32, 8), (64, 16, 4)])],
    "bwd_fused": [(128, [(64, 64, 8)]), (240, [(64, 64, 8), (64, 32, 8), (32, 64, 8)]), (248, [(64, 32, 8)]),
                  (256, [(64, 64, 8), (64, 32, 8), (32, 64, 8)])],
    # (128-query tiles at head_dim 64 spill 212-220 bytes with softcap; ALiBi: _ALIBI_PREFERENCES)
    "bwd_fused_sm90": [(128, [(64, 128, 12)])],
}
# ... with ALiBi and no masks beyond lengths, replacing those: the fused wgmma backward's 128-query tiles at head_dim
# 64 spill 20-32 bytes (NVRTC 12.9; SPILL_ALLOWANCE) and run 1.00-1.20x as fast as its 64-query ones (H200,
# docs/perf-notes.md: ALiBi; with windows or ids, as the plain kernel, 64-query tiles).
_ALIBI_PREFERENCES = {
    "bwd_fused_sm90": [(64, [(128, 128, 12)]), (128, [(64, 128, 12)])],
}
# Tilings of dropout variants (spec.KernelSpec.dropout), family -> (lo, hi, tilings) for lo < head_dim <= hi, ahead of
# the tables above, where the draws' registers (kernels_cu/attention/dropout.cuh) made the preferred tilings spill
# (NVRTC 12.9): the mma.sync forward at head_dim 56 (128x64 with 4 warps: 24 bytes), 104 and 128 (128x32 with 4
# warps: 4-12) and 216 (128x64: 40), fwd_sm90 at two blocks per SM at 64 (12 with masks), the mma.sync dQ above 192
# (128x32: 24 bytes causal with masks), the mma.sync fused backward at 96-128 (64x128: 4-12), the fused wgmma backward's
# 128-query tiles at 64 (20). Not timed against other tilings. (The warp-specialised forward's 192-row tiles are not
# taken with dropout and masks beyond lengths: 8 bytes; candidates.)
_DROPOUT_PREFERENCES = {
    "fwd": [(48, 64, [(128, 64, 8)]), (96, 128, [(128, 64, 8)]), (208, 224, [(128, 32, 8)])],
    "fwd_sm90": [(0, 64, [(128, 64, 8)])],
    "bwd_dq": [(192, 256, [(64, 16, 4)])],
    "bwd_fused": [(88, 128, [(64, 64, 8)])],
    "bwd_fused_sm90": [(0, 64, [(64, 128, 12)])],
}
# Tilings of a user's score_mod that reads tensors (spec.KernelSpec.score_mod), family -> (lo, hi, tilings) for
# lo < head_dim <= hi, ahead of every table above (the long-rows one aside: not taken with a score_mod). Chosen by
# spills of the compile proof's expressions (tests/test_compile.py: a capped score, an ALiBi-like one over a slopes
# tensor, a relative-bias table read per element; NVRTC 12.9) where the softcap / ALiBi tilings spill, each time with
# an expression that reads a tensor: the mma.sync forward at head_dim 64 with four warps (116-120 bytes, bias table),
# the warp-specialised forward with 80- or 128-key tiles above head_dim 64 (12-56 bytes), the wgmma dQ at two blocks
# per SM (128-200 bytes). An expression of s and the positions alone keeps the softcap tilings (the 64-key ones cost
# a capped score's head_dim 128 forward 1.14-1.30x the built-in softcap's time, against 0.95-1.14x at 64, H200).
_USER_MOD_PREFERENCES = {
    "fwd": [(0, 64, [(128, 64, 8)])],
    "fwd_sm90_ws": [(64, 256, [(128, 64, 12)])],
    "bwd_dq_sm90": [(0, 64, [(128, 64, 8)])],
}
# Tilings with element masks beyond lengths (window, block / segment ids): family -> buckets as in _PREFERENCES,
# replacing that family's for such masks. Chosen by spills: the mask predicate's registers make some preferred
# tilings spill (NVRTC 12.9, tests/test_compile.py); these replace them for masked variants.
_MASKED_PREFERENCES = {
    "fwd": [(192, [(128, 64, 8), (64, 64, 4)]), (256, [(64, 32, 4)])],
    # (the head_dim 64 dQ at two blocks per SM spills 8-156 bytes with window, block or segment ids)
    "bwd_dq_sm90": [(64, [(128, 128, 8)]), (256, [(128, 64, 8)])],
    "bwd_fused": [(256, [(64, 64, 8), (64, 32, 8)])],
    # (the wgmma fused backward's 128-query tiles at head_dim 64 spill 8-36 bytes with windows or ids)
    "bwd_fused_sm90": [(128, [(64, 128, 12)])],
    # (the warp-specialised forward with segment or block ids, whose consumers keep 216 registers: at head_dim 256
    # 80-key tiles spill 4-20 bytes, 64-key ones none; at 192 112-key ones 16-28, 96-key ones none; at head_dim 64
    # 192-row tiles spill 8-176 bytes)
    "fwd_sm90_ws": [(128, [(128, 128, 12)]), (192, [(128, 96, 12)]), (256, [(128, 64, 12)])],
}
# Tilings with a mask_mod expression (MASK_BITS["mod"]): family -> buckets as in _PREFERENCES, replacing both
# tables above for it. Chosen by spills and the timings cited: with an expression as well, the fused backward at
# head_dim > 128 spills at 64x64 (12 bytes with every built-in mask and a tensor-reading expression, NVRTC 12.9).
_MOD_PREFERENCES = {
    "bwd_fused": [(128, [(64, 64, 8), (64, 32, 8)]), (256, [(64, 32, 8)])],
    # (the wgmma forward at head_dim 128 with 128-key tiles sits at 255 registers with an expression, no
    # spills; against 64-key tiles it is 1.12x faster on documents-mod at 8k, H200, docs/perf-notes.md: Forward: wgmma
    # (fwd_sm90))
    "fwd_sm90": [(64, [(128, 64, 8)]), (128, [(128, 128, 8), (128, 64, 8)]), (256, [(128, 64, 8)])],
    # (the wgmma dQ at head_dim 64 with 128-key tiles spills 32 bytes with an expression alone, NVRTC 12.9)
    "bwd_dq_sm90": [(256, [(128, 64, 8)])],
    # (the warp-specialised forward at head_dim 64 with 192-row tiles spills 36 bytes with an expression, lengths and a
    # window; above head_dim 128 64-key tiles: mask_map's rounds of 32 / ceil(block_n / 32) rows (mask_classify.cu) do
    # not divide 128 rows at 80 keys)
    "fwd_sm90_ws": [(128, [(128, 128, 12)]), (256, [(128, 64, 12)])],
}
# Tilings for long query sequences: family -> ((the least query length causal, not causal), {head_dim: tilings}),
# replacing the plain table (_PREFERENCES; not those of masks beyond lengths or mask_mod) at those head dims from that
# length on (long_rows). The warp-specialised forward at head_dim 64 with 192-row tiles and three consumer warpgroups,
# against 128 x 128 (H200, 16k tokens, docs/perf-notes.md: head_dim 64: 192-row tiles): dense / causal 1.09x / 1.02x
# as fast at S=4k, 1.14x / 1.09x at 16k, 0.99x / 0.83x at 1k (a third of the last tile idle; no causal diagonal loop);
# dense 1.10-1.17x at 1.5k-3k, causal 0.98-1.05x there.
_LONG_PREFERENCES = {"fwd_sm90_ws": ((4096, 1536), {64: [(192, 128, 16)]})}
# Tilings of non-causal calls without masks beyond lengths and without score modifications or dropout, ahead of the
# plain table: family -> {head_dim: tilings}. The warp-specialised forward at head_dim 128 with 176-key tiles and one Q
# slot (FlashAttention-3's choice) against 128 x 128 with two (16k tokens, docs/perf-notes.md: head_dim 128: 176-key
# tiles): H200 1.01x at S=1k, 1.02x at 2k-4k, 1.06x at 16k; H100 1.01-1.05x. (Causal calls keep 128 x 128 and its
# diagonal loop; with ids or a score_mod 176 keys spill, and a mask_mod needs 64-key multiples.)
_DENSE_PREFERENCES = {"fwd_sm90_ws": {128: [(128, 176, 12)]}}


def long_rows(family: str, head_dim: int, seqlen_q: int, causal: bool = True) -> bool:
    """Whether a call with query sequences of up to `seqlen_q` rows takes `family`'s long-sequence tiling
    (_LONG_PREFERENCES) at this head_dim, causal or not."""
    least, tables = _LONG_PREFERENCES.get(family, ((0, 0), {}))
    return head_dim in tables and seqlen_q >= least[0 if causal else 1]


# Spills allowed: measured exceptions to "no register spills": (family, head_dim, min_blocks) -> bytes of local
# memory a variant may use (tests/test_compile.py, tests/test_gpu.py check the rest). The head_dim 64 dQ at two
# blocks per SM (128 registers) spills 20-24 bytes in its causal and lengths variants and still runs 1-9% faster
# than at one block (H200, docs/perf-notes.md: head_dim 64 backward).
# The warp-specialised fused backward at head_dim 128 spills 24-48 bytes (by mask) in its producer warpgroup, which
# keeps 24 registers so that the consumers have the 240 they need (bwd_fused_sm90_ws.cu: FusedWsTraits).
# With ALiBi its 128-query tiles at head_dim 64 spill 20-32 bytes (a 40-byte stack) and run 1.00-1.20x as fast as
# 64-query ones (H200, docs/perf-notes.md: ALiBi; _ALIBI_PREFERENCES).
# The mma.sync forward at head_dim 256 with swizzled tiles spills 8 bytes in its 128 x 64 tiles (sm_90a, not
# causal) and runs 8-9% faster than with padded ones (H100, docs/perf-notes.md: Forward: mma.sync).
# Not measured (no such GPU here): with 99 KB (sm_86, sm_89) the dK / dV kernels' 32 x 16 w2 tiles spill 8-104 bytes
# (NVRTC 12.9) with dropout at head_dim 232-256 and with block / segment ids at 232-240, where the 16 x 32 w2 ones they
# replace spilled 452-544 (dropout) or, with ids, did not launch (their static shared memory: _first_fit).
# Not measured yet: the wgmma dK / dV kernel at head_dim 128 (255 registers) spills 4 bytes in its causal variant with
# a score_mod reading a bias table since its descriptors are stepped (docs/perf-notes.md, Per-pair fixed cost).
SPILL_ALLOWANCE = {("bwd_dq_sm90", 64, 2): 32, ("bwd_fused_sm90", 128, 1): 64, ("fwd", 256, 1): 8,
                   ("bwd_fused_sm90", 64, 1, "alibi", 128): 40,
                   ("bwd_dkdv_sm90", 128, 1, "sm_90a"): 8,
                   **{(f, d, 1, arch): 112 for f in ("bwd_dkdv", "bwd_fused") for d in (232, 240, 248, 256)
                      for arch in ("sm_86", "sm_89")}}


# Smaller tilings of each family, tried in order after its preferred ones (candidates) when none of those fits the
# device's shared memory; not timed, only valid layouts (spec.KernelSpec.layout_problem) of decreasing size.
_FALLBACKS = {
    # (64 x 16 w4 where masks' static shared memory leaves no room for 64 x 32 with 99 KB at head_dim 241-248: the
    # 32 x 32 w2 after it spilled 24 bytes there, sm_86; bwd_dq's 32 x 16 w2 likewise at 241-256, where 16 x 16 w1
    # spilled 36)
    "fwd": [(64, 32, 4), (64, 16, 4), (32, 32, 2), (16, 16, 1)],
    "fwd_sm90": [],
    "fwd_sm90_ws": [],
    "bwd_dq_sm90": [],
    "bwd_dkdv_sm90": [],
    "bwd_fused_sm90": [],
    "bwd_dq": [(64, 32, 4), (32, 32, 2), (32, 16, 2), (16, 16, 1)],
    # (16 x 32 with 4 warps before 2: at head_dim 248-256 with 99 KB, sm_86 / sm_89, 2 warps spilled 452-540 bytes
    # beside the dK / dV accumulators, 4 none; with dropout, whose draws need 16 query columns a warp, and with ids at
    # 232-240, 32 x 16 w2: SPILL_ALLOWANCE)
    "bwd_dkdv": [(32, 32, 4), (16, 32, 4), (32, 16, 2), (16, 32, 2), (16, 16, 1)],
    "decode_combine": [],
    "combine": [],
    "combine_f32": [],
    "combine_rows": [],
    "combine_rows_f32": [],
    "bwd_fused": [(32, 32, 4), (16, 32, 4), (32, 16, 2), (16, 32, 2), (16, 16, 1)],
    "bwd_preprocess": [],
    "bwd_dkdv_reduce": [],
    "bwd_dq_convert": [],
}


def spill_allowance(spec: KernelSpec) -> int:
    """Bytes of local memory (register spills) `spec` may use: 0 unless SPILL_ALLOWANCE says otherwise (for its arch,
    or for every arch; for its ALiBi variants of its query tile)."""
    key = (spec.family, spec.head_dim, spec.min_blocks)
    if spec.alibi and (*key, "alibi", spec.block_m) in SPILL_ALLOWANCE:
        return SPILL_ALLOWANCE[(*key, "alibi", spec.block_m)]
    return SPILL_ALLOWANCE.get((*key, spec.arch), SPILL_ALLOWANCE.get(key, 0))


class TilingError(RuntimeError):
    """No tiling of a kernel fits the device."""


def candidates(family: str, head_dim: int, mask: int = 0, softcap: bool = False,
               alibi: bool = False, long: bool = False, score_mod: tuple = (),
               dropout: bool = False) -> list[tuple[int, int, int, int]]:
    """(block_m, block_n, warps, min_blocks) of `family` at `head_dim` in order of preference (`long`: for long query
    sequences, long_rows; `dropout`: _DROPOUT_PREFERENCES first)."""
    table = _PREFERENCES[family]
    if (long and not score_mod and not (dropout and mask & ~MASK_BITS["lengths"])
            and head_dim in _LONG_PREFERENCES.get(family, ((0, 0), {}))[1]):
        table = [(head_dim, _LONG_PREFERENCES[family][1][head_dim])]
    if mask & ~MASK_BITS["lengths"]:
        table = _MASKED_PREFERENCES.get(family, table)
    if mask & MASK_BITS["mod"]:
        table = _MOD_PREFERENCES.get(family, table)
    if softcap or alibi or score_mod:
        table = _SCORE_MOD_PREFERENCES.get(family, table)
    if alibi and not mask & ~MASK_BITS["lengths"]:
        table = _ALIBI_PREFERENCES.get(family, table)
    if score_mod and score_mod[2]:  # (it reads tensors)
        table = [(256, prefs) for lo, hi, prefs in _USER_MOD_PREFERENCES.get(family, ()) if lo < head_dim <= hi] + table
    if dropout:
        table = [(256, prefs) for lo, hi, prefs in _DROPOUT_PREFERENCES.get(family, ()) if lo < head_dim <= hi] + table
    for max_d, prefs in table:
        if head_dim <= max_d:
            return [(*t, 1) if len(t) == 3 else t for t in prefs + [f for f in _FALLBACKS[family] if f not in prefs]]
    raise ValueError(f"head_dim must be at most 256, got {head_dim}")


def tiling(family: str, head_dim: int, dtype: str, causal: bool, arch: str, smem_limit: int,
           mask: int = 0, mask_mod: str = "", mod_tensors: tuple = (), softcap: bool = False,
           alibi: bool = False, long: bool = False, score_mod: tuple = (), dropout: int = 0) -> KernelSpec:
    """The kernel of `family` for an arch and a shared-memory limit: the first of its candidates (tiles and
    warps) that is valid at this head_dim and fits `smem_limit` bytes; TilingError if none does.

    `mask` (spec.MASK_BITS): element masks beyond lengths take _MASKED_PREFERENCES where a family has them,
    mask_mod _MOD_PREFERENCES; `mask_mod`, `mod_tensors`: a user's expression (spec.KernelSpec); `softcap`, `alibi`:
    the score cap or ALiBi compiled in (families without scores ignore them); `long`: the tiling for long query
    sequences where the family has one (long_rows); `score_mod`: a user's expression (spec.KernelSpec.score_mod; the
    families without a score_mod variant ignore it); `dropout`: attention dropout compiled in, the bits of its draws
    (spec.dropout_resolution; DROPOUT_FAMILIES, the others ignore it).
    kernel_for is this for a device (what a call runs); this form serves prewarm and tests, with no GPU.
    """
    elementwise = family in ELEMENTWISE
    if family in ANY_HEAD_DIM:  # (head_dim is a run-time argument there)
        head_dim = 256
    scores = family in SOFTCAP_FAMILIES
    score_mod = score_mod if family in SCORE_MOD_FAMILIES else ()
    dropout = dropout if family in DROPOUT_FAMILIES else 0
    shapes = candidates(family, head_dim, mask, softcap, alibi, long, score_mod, dropout)
    if not (causal or long or mask & ~MASK_BITS["lengths"] or softcap or alibi or score_mod or dropout):
        shapes = [(*t, 1) for t in _DENSE_PREFERENCES.get(family, {}).get(head_dim, [])] + shapes
    return _first_fit(family, head_dim, smem_limit, shapes,
                      lambda bm, bn, nw, mb: KernelSpec(family, head_dim, dtype, bm, bn, nw, causal and not elementwise,
                                                        arch, 0 if elementwise else mask,
                                                        "" if elementwise else mask_mod,
                                                        () if elementwise else tuple(mod_tensors), mb,
                                                        softcap and scores, alibi and scores, score_mod, dropout))


def _first_fit(family: str, head_dim: int, smem_limit: int, shapes, make) -> KernelSpec:
    """The first of `shapes` whose spec (make(*shape)) is a valid layout at this head_dim and fits `smem_limit`
    bytes of shared memory, its static shared memory included (spec.KernelSpec.static_smem_bound); TilingError naming
    each one tried otherwise."""
    tried = []
    for shape in shapes:
        try:
            spec = make(*shape)
        except ValueError as exc:  # this tiling does not divide this head_dim; try the next
            tried.append(str(exc))
            continue
        if spec.smem_bytes + spec.static_smem_bound <= smem_limit:
            return spec
        tried.append(f"{spec.name}: {spec.smem_bytes} B" + (f" + {spec.static_smem_bound} static" * bool(spec.mask)))
    raise TilingError(f"no tiling of {family} for head_dim={head_dim} fits the device's shared memory limit of "
                      f"{smem_limit} bytes per block; required: " + ", ".join(tried))


@functools.cache
def kernel_for(family: str, head_dim: int, dtype: str, causal: bool, dev: Device, mask: int = 0, mask_mod: str = "",
               mod_tensors: tuple = (), softcap: bool = False, alibi: bool = False, long: bool = False,
               score_mod: tuple = (), dropout: int = 0) -> KernelSpec:
    """The kernel of `family` that runs on the device `dev` (launch.Device): tiling for its arch and opt-in
    shared-memory limit, cached."""
    return tiling(family, head_dim, dtype, causal, dev.arch, dev.smem_optin, mask, mask_mod, mod_tensors, softcap,
                  alibi, long, score_mod, dropout)


# ---------------------------------------------------------------------------
# Helper kernels: mask_mod's classification, the device check of mask arrays
# ---------------------------------------------------------------------------
# Warps of mask_mod's classification kernels (spec.CLASSIFY), family -> warps: fixed by their layout, not timed.
# The map evaluates the expression with four warps per tile and 32 per block (mask_classify.cu); a list
# maker is a warp per list.
CLASSIFY_WARPS = {"mask_map": 32, "mask_rows": 8, "mask_cols": 8}


def classifier_spec(consumer: KernelSpec, family: str) -> KernelSpec:
    """The mask_mod classification kernel `family` (spec.CLASSIFY) for the tiles of `consumer`, the kernel that
    reads its map or lists: head_dim and dtype fixed (it reads no q/k/v), CLASSIFY_WARPS; the list makers read
    only the map, so they take no mask bits and no expression (one compile serves every mask_mod)."""
    fixed = {"family": family, "head_dim": 64, "dtype": "bf16", "warps": CLASSIFY_WARPS[family], "min_blocks": 1,
             "softcap": False, "alibi": False, "score_mod": (), "dropout": 0, "head_dims": (), "qk_width": 0,
             "v_width": 0}
    if family != "mask_map":
        fixed.update(causal=False, mask=0, mask_mod="", mod_tensors=())
    return dataclasses.replace(consumer, **fixed)


CHECK_WARPS = 16  # mask_check.cu: one block; its arrays are a few ints per token


def check_spec(arch: str) -> KernelSpec:
    """The kernel that checks a call's mask arrays on the device (kernels_cu/helpers/mask_check.cu)."""
    return KernelSpec("mask_check", 64, "bf16", 0, 0, CHECK_WARPS, False, arch)


# ---------------------------------------------------------------------------
# Launch shapes: how a launch's work is chunked and split
# ---------------------------------------------------------------------------
def map_slots(spec: KernelSpec) -> int:
    """Key tiles per block of mask_map (kernels_cu/helpers/mask_classify.cu: SLOTS): its warps over the warps per
    tile (spec.KernelSpec.map_split, which the kernel takes as FRT_MAP_SPLIT). A row of key tiles that fits in one
    block gets its list from that block (api._classify)."""
    return spec.warps // spec.map_split


def item_chunk(dev: Device, B: int, Sk: int, head_dim: int, H: int, Hkv: int) -> int:
    """(batch entry, head) pairs per chunk of fwd_sm90's work items (kernels_cu/attention/params.cuh: work_item):
    at most as many as have their K and V (bf16 / fp16) in half of the L2 cache, whole KV-head groups, at most all
    B * H (so a chunk's items fit the kernel's int arithmetic as the grid does); the chunks that takes, equal in
    size, so that the last is not a small remainder whose heaviest items start last (causal at S=1k: 2.6% faster,
    docs/perf-notes.md: Work-item order)."""
    group, pairs = H // Hkv, B * H
    kv_heads = max(1, dev.l2_bytes // 2 // (4 * max(Sk, 1) * head_dim))
    even = _equal_chunks(pairs, min(kv_heads * group, pairs))
    return min(_cdiv(even, group) * group, pairs)


def key_item_chunk(dev: Device, B: int, Sq: int, head_dim: int, H: int, Hkv: int, splits: int) -> int:
    """(batch entry, grid row) pairs per chunk of a causal key-parallel launch's blocks
    (kernels_cu/attention/params.cuh: key_block; a grid row is a KV head and split): at most as many as have the
    query rows they read (q and dout of the KV head's group, bf16 / fp16) in half of the L2 cache, in chunks of
    equal size (item_chunk's rule, with the roles of queries and keys swapped)."""
    pairs = B * Hkv * splits
    per_pair = max(1, 4 * max(Sq, 1) * head_dim * (H // Hkv) // splits)
    return _equal_chunks(pairs, min(max(1, dev.l2_bytes // 2 // per_pair), pairs))


# Key tiles of each (batch entry, KV head) that the ordered causal fused backward runs together
# (ordered_key_chunk; docs/perf-notes.md: Ordered causal grid by pairs).
ORDERED_KEY_TILES_TOGETHER = 8


def ordered_key_chunk(dev: Device, pairs: int, splits: int) -> int:
    """(batch entry, KV head) pairs per chunk of the ordered causal fused backward's key-tile-major grid
    (kernels_cu/attention/params.cuh: key_block_tile_major; 0: one chunk): as many as let ORDERED_KEY_TILES_TOGETHER
    key tiles of each run together at one block per SM, so that they share their Q, dO and dQ tiles in L2 (in
    chunks of equal size); with dK/dV splits (few pairs) one chunk, which keeps a row's splits in one chunk."""
    if splits > 1:
        return 0
    return _equal_chunks(pairs, max(1, dev.sm_count // ORDERED_KEY_TILES_TOGETHER))


# The ordered non-causal fused backward's rotated order (kernels_cu/attention/params.cuh: dq_turn) has a key tile
# wait for the one above it, which the hardware may start later: safe only while a row's key tiles all fit on the GPU
# at once, here at one block per SM on at most this share of the SMs (the rest may be held by other work).
ORDERED_ROTATION_SM_SHARE = 0.5


def rotate_ordered_dq(dev: Device, key_tiles: int, splits: int, causal: bool) -> bool:
    """Whether the ordered wgmma fused backward visits each key tile's query tiles rotated by the key tile
    (p.dq_rotate; docs/perf-notes.md, Ordered grid): not causal, in one split (dkdv_splits), where a row's `key_tiles`
    blocks fit on ORDERED_ROTATION_SM_SHARE of the SMs. The kernel rotates only where the mask lets it (params.cuh:
    rotatable)."""
    return not causal and splits == 1 and key_tiles <= dev.sm_count * ORDERED_ROTATION_SM_SHARE


def _equal_chunks(pairs: int, most: int) -> int:
    """The size of the fewest chunks of at most `most` that cover `pairs`, as equal as whole numbers allow (so
    that the last chunk is not a small remainder)."""
    return _cdiv(pairs, _cdiv(pairs, most))


# Bytes of fp32 dK/dV partials a split dK/dV pass may use (dkdv_splits caps its splits by it): a memory bound,
# not timed.
DKDV_PARTIAL_LIMIT = 256 * 2**20


def dkdv_splits(spec: KernelSpec, B: int, H: int, Hkv: int, Sq: int, Sk: int, sm_count: int) -> int:
    """How many blocks share each key tile of the dK/dV pass.

    One (no partials) when the key tiles alone fill the GPU. Otherwise as many as
    still fit in one wave (MQA/GQA at small batch: the grid is Sk/BN * Hkv * B):
    a second, partial wave would cost a whole block's time for a few blocks
    (docs/perf-notes.md: Backward: split pair (bwd_dq, bwd_dkdv), 5 splits vs 4 at the seed shape). Capped by
    the (query head, query tile) pairs there are to share and by
    DKDV_PARTIAL_LIMIT bytes of fp32 partials (2 * splits * B * Hkv * Sk * D * 4).
    """
    blocks = _cdiv(Sk, spec.block_n) * Hkv * B
    if 2 * blocks > sm_count:
        return 1
    pairs = (H // Hkv) * _cdiv(Sq, spec.block_m)
    by_memory = DKDV_PARTIAL_LIMIT // (8 * B * Hkv * Sk * spec.head_dim)
    return max(1, min(sm_count // blocks, pairs, by_memory))


# ---------------------------------------------------------------------------
# Decoding (kernels_cu/sm80/decode.cu, flashrt/decoding.py)
# ---------------------------------------------------------------------------
DECODE_WARPS = 4
# decode_splits' constants, in key tiles' time (docs/perf-notes.md, Decode: splits and the combine; its time model
# fitted on scripts/probes/decode_splits_sweep.py's single-wave shapes, H200):
DECODE_SPLIT_OVERHEAD_TILES = 2  # a split's pipeline fill and epilogue
DECODE_COMBINE_TILES = 1 / 16  # the combine's time per split (8/1 D=128 1 x 4k: 64 splits 9.7 us against 32's 8.7)
# A block streams at most its shared memory's worth of keys in flight; an SM's share of the bandwidth needs about this
# many bytes in flight (D=64 16 x 8k: one block per SM 80.3 us, two 71.7; D=128's 106 KB blocks need one).
DECODE_SM_BYTES_IN_FLIGHT = 96 * 1024
# Splits at most: 256 (combine.cu's most) ran 0.72 against 0.94 TB/s at 8/1 D=128 1 x 32k, 1.61 against 1.88 at 128k
# (H100, scripts/probes/decode_max_splits.py): 2-tile splits and a 256-part combine cost more than they spread.
DECODE_MAX_SPLITS = 128
# One split where one split already gives nearly every SM a block (this fraction of them) within one wave and a
# sequence is at most this many keys: splitting such short sequences buys little in flight and costs each split's fill,
# epilogue and the combine (H200, head_dim 64, forced counts, `h200-2026-11-27-decode-stages.md`: one split against the
# time model's / last-wave rule's two 1.09-1.20x as fast at 128-256 blocks of 1k keys, 0.99-1.11x at 2k). Only where
# measured: sm_90a at head_dim 64 (DECODE_ONE_SPLIT_HEAD_DIMS); elsewhere the models' picks stand.
DECODE_ONE_SPLIT_FILL, DECODE_ONE_SPLIT_KEYS, DECODE_ONE_SPLIT_HEAD_DIMS = 0.9, 2048, (64,)
# sm_90a: a sequence's splits, at most DECODE_CLUSTER_SPLITS (8, the portable cluster size: launch.py; 0: never) of at
# most DECODE_CLUSTER_TILES key tiles each, run as one thread block cluster that merges their parts itself
# (decode.cu: cluster_combine), not through combine.cu's launch: short splits, where that launch is much of a call.
# Longer ones ran at 0.96-0.99x (H200; on the H100, unconditional: -5 to -11% at 4 x 8k and 8/1 16 x 8k). Where an SM
# holds one block (head_dim 256), clusters of 3-8 over more than half the SMs' worth of blocks ran at 0.66-0.76x (a
# cluster's blocks wait for SMs of one GPC): there only 2 splits or small grids. Where the time model picks 9-16 splits
# over at most DECODE_CLUSTER_FEW_TILES key tiles, 8 in a cluster: 0.94-1.13x (H200, scripts/probes/decode_cluster.py;
# docs/perf-notes.md, Decode: splits and the combine).
DECODE_CLUSTER_SPLITS, DECODE_CLUSTER_TILES, DECODE_CLUSTER_FEW_TILES = 8, 8, 32


def _decode_blocks(spec: KernelSpec, B: int, Hkv: int, rows: int, smem_per_sm: int) -> tuple[int, int]:
    """A decode launch's blocks per split, and the blocks an SM holds at once."""
    blocks = max(1, B * Hkv * _cdiv(rows, spec.block_m))
    return blocks, max(1, min(16, (smem_per_sm + 1024) // (spec.smem_bytes + 1024)))


def decode_cluster(spec: KernelSpec, B: int, Hkv: int, rows: int, capacity: int, splits: int, sm_count: int,
                   smem_per_sm: int) -> bool:
    """Whether decode's `splits` blocks of a sequence merge in a thread block cluster (sm_90a) or by combine.cu."""
    if not (spec.arch == "sm_90a" and 1 < splits <= min(DECODE_CLUSTER_SPLITS, 8)):
        return False
    if _cdiv(_cdiv(max(capacity, 1), spec.block_n), splits) > DECODE_CLUSTER_TILES:
        return False
    blocks, resident = _decode_blocks(spec, B, Hkv, rows, smem_per_sm)
    return resident >= 2 or splits == 2 or 2 * blocks * splits <= sm_count


def decode_block_m(rows: int) -> int:
    """Packed rows (query heads per KV head x new tokens) per decode block: the fewest 16-row multiples up to 64 that
    hold them (the mma rows past them are wasted work, not bytes: K/V are read once per block)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def decode_spec(head_dim: int, dtype: str, rows: int, arch: str, smem_limit: int, softcap: bool = False,
                alibi: bool = False) -> KernelSpec:
    """The decode kernel for `rows` packed rows (`softcap`, `alibi`: with them): 64-key tiles over DECODE_WARPS warps
    (16 keys per warp at 16 rows), 32 at 32 and 64 rows above head_dim 128 (64 keys spill there: 12-152 bytes, NVRTC
    12.9), 16 at 64 rows above 240, and above 224 with ALiBi (32 spill 64-76 bytes at head_dim 248, NVRTC 12.9 and
    13.0; with ALiBi 4-8 bytes at 232); where those do not fit the shared memory (sm_86 / sm_89: 99 KB), smaller
    tiles over fewer warps."""
    bm = decode_block_m(rows)
    narrow = bm == 64 and head_dim > (224 if alibi else 240)
    widths = (64, 32, 16) if head_dim <= 128 or bm < 32 else (16,) if narrow else (32, 16)
    return _first_fit("decode", head_dim, smem_limit, itertools.product(widths, (DECODE_WARPS, 2, 1)),
                      lambda bn, nw: KernelSpec("decode", head_dim, dtype, bm, bn, nw, False, arch, softcap=softcap,
                                                alibi=alibi))


def decode_variants(head_dim: int, dtype: str, arch: str, smem_limit: int, softcap: bool = False,
                    alibi: bool = False) -> list[KernelSpec]:
    """Every decode kernel a call at this head_dim and dtype (with softcap or ALiBi) may run (one per decode_block_m),
    for prewarm and tests."""
    return [decode_spec(head_dim, dtype, rows, arch, smem_limit, softcap, alibi) for rows in (16, 32, 64)]


def decode_splits(spec: KernelSpec, B: int, Hkv: int, rows: int, capacity: int, sm_count: int, smem_per_sm: int,
                  requested: int = 0) -> int:
    """Blocks over each sequence's keys (decode.cu's grid x): `requested` if > 0, else, at most DECODE_MAX_SPLITS:
    where one split per sequence already gives every SM a block, the count that wastes least of the last wave (blocks
    of equal work, as many running at once as the shared memory allows) and of each split's fixed cost
    (DECODE_SPLIT_OVERHEAD_TILES); under that, the count of least modelled time: an SM's blocks add up, each split's
    tiles rounded up plus its fixed cost, at the bandwidth share its resident blocks keep in flight
    (DECODE_SM_BYTES_IN_FLIGHT), plus the combine's DECODE_COMBINE_TILES per split, and 8 in place of its 9-16 over few
    keys where they merge in a cluster (DECODE_CLUSTER_*); one split for short sequences where one already gives nearly
    every SM a block in one wave (DECODE_ONE_SPLIT_*: sm_90a, head_dim 64). The lengths are
    on the device: the cache's capacity stands for them (docs/perf-notes.md, Decode: splits and the combine)."""
    tiles_max = _cdiv(max(capacity, 1), spec.block_n)
    most = max(1, min(DECODE_MAX_SPLITS, tiles_max))
    if requested > 0:
        return min(requested, most)
    blocks, resident = _decode_blocks(spec, B, Hkv, rows, smem_per_sm)
    if (spec.arch == "sm_90a" and spec.head_dim in DECODE_ONE_SPLIT_HEAD_DIMS and capacity <= DECODE_ONE_SPLIT_KEYS
            and DECODE_ONE_SPLIT_FILL * sm_count <= blocks <= resident * sm_count):
        return 1
    if blocks >= sm_count:
        def share_streaming(s: int) -> float:  # the share of the launch's time spent streaming keys
            waves = blocks * s / (sm_count * resident)
            tiles = tiles_max / s
            return waves / math.ceil(waves) * tiles / (tiles + DECODE_SPLIT_OVERHEAD_TILES)
        return max(range(1, most + 1), key=lambda s: (round(share_streaming(s), 3), -s))
    share = min(1.0, spec.smem_bytes / DECODE_SM_BYTES_IN_FLIGHT)  # of the SM's bandwidth, one block alone

    def time(s: int) -> float:
        per_sm = _cdiv(blocks * s, sm_count)
        tiles = _cdiv(tiles_max, s) + DECODE_SPLIT_OVERHEAD_TILES
        streaming = per_sm * tiles / min(1.0, min(per_sm, resident) * share)
        return streaming + (DECODE_COMBINE_TILES * s if s > 1 else 0.0)
    best = min(range(1, most + 1), key=lambda s: (round(time(s), 6), s))
    n = DECODE_CLUSTER_SPLITS
    few = n < best <= 2 * n and tiles_max <= DECODE_CLUSTER_FEW_TILES
    return n if few and decode_cluster(spec, B, Hkv, rows, capacity, n, sm_count, smem_per_sm) else best


# flashrt.combine takes combine.cu's thread per (row, 8 columns) (combine_rows) for at most COMBINE_ROWS_FEW_PARTS
# parts, or from COMBINE_ROWS_MIN_ROWS_PER_SM rows per SM with at most COMBINE_ROWS_MAX_PARTS (H200,
# scripts/probes/combine_rows.py, docs/perf-notes.md "Context parallelism": 0.81-0.89x warps' time at 64 rows and 2-4
# parts, 1.2-3.2x at 8-32; 0.65-0.98x at 1k rows and 2-32 parts; 0.09-0.40x from 16k rows).
COMBINE_ROWS_FEW_PARTS = 4
COMBINE_ROWS_MIN_ROWS_PER_SM = 8
COMBINE_ROWS_MAX_PARTS = 32


def combine_rows(parts: int, rows: int, sm_count: int) -> bool:
    """Whether flashrt.combine merges by a thread per (row, 8 columns) (few parts, or many rows) rather than by
    warps per row (many parts over few rows)."""
    return parts <= COMBINE_ROWS_FEW_PARTS or (parts <= COMBINE_ROWS_MAX_PARTS
                                                and rows >= COMBINE_ROWS_MIN_ROWS_PER_SM * sm_count)


def combine_row_warps(parts: int, rows: int, sm_count: int, warps: int) -> int:
    """Warps that share one row's parts in combine.cu (1, 2, 4 or 8): as many as keep 4 parts or more each, while
    the launch's warps stay within 4 per SM scheduler's worth (few rows, many parts: a single sequence's splits)."""
    best = 1
    for r in (2, 4, 8):
        if r <= warps and parts >= 4 * r and rows * r <= 4 * 4 * sm_count:
            best = r
    return best
