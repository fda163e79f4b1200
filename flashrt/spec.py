"""KernelSpec: one compiled kernel variant.

A spec fixes everything that is baked in at compile time (family, head_dim,
dtype, tiles, warps, mask mode, arch). It derives the variant's name (used for
the kernel symbol, the cache file, log lines and errors), its NVRTC options,
its translation unit, and its dynamic shared memory, computed by the same
formula as the kernel's traits struct (the kernel static_asserts the two agree).
Sequence lengths, batch, heads and strides are run-time arguments.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import re

from . import params

FAMILIES = {
    # family: (source file, params struct, extra defines)
    "fwd": ("sm80/fwd.cu", params.FWD, {}),
    "fwd_sm90": ("sm90/fwd_sm90.cu", params.FWD, {}),  # the forward with wgmma (sm_90a, head_dim a multiple of 64)
    "fwd_sm90_ws": ("sm90/fwd_sm90_ws.cu", params.FWD, {}),  # ... warp-specialised and persistent (FWD_WS_NO_MASKS)
    "bwd_preprocess": ("helpers/bwd_preprocess.cu", params.BWD, {}),
    "bwd_dq": ("sm80/bwd_dq.cu", params.BWD, {}),
    "bwd_dkdv": ("sm80/bwd_dkdv.cu", params.BWD, {}),
    # the split backward with wgmma (sm_90a, head_dim 64, 128, 192, 256): tiles.split_families
    "bwd_dq_sm90": ("sm90/bwd_dq_sm90.cu", params.BWD, {}),
    "bwd_dkdv_sm90": ("sm90/bwd_dkdv_sm90.cu", params.BWD, {}),
    "bwd_dkdv_reduce": ("helpers/bwd_dkdv_reduce.cu", params.BWD, {}),
    "bwd_fused": ("sm80/bwd_dkdv.cu", params.BWD, {"FRT_FUSED_DQ": 1}),  # dK/dV + atomic dQ
    "bwd_fused_sm90": ("sm90/bwd_fused_sm90_ws.cu", params.BWD, {}),  # ... wgmma, warp-specialised, TMA reduce-add dQ
    "bwd_dq_convert": ("helpers/bwd_dq_convert.cu", params.BWD, {}),
    # mask_mod: the tile map (the expression evaluated per pair), then the tile lists (ModLists) made
    # from it, per query tile (fwd, bwd_dq) and per key tile (bwd_dkdv, bwd_fused)
    "mask_map": ("helpers/mask_classify.cu", params.FWD, {"FRT_CLASSIFY": 0}),
    "mask_rows": ("helpers/mask_classify.cu", params.FWD, {"FRT_CLASSIFY": 1}),
    "mask_cols": ("helpers/mask_classify.cu", params.FWD, {"FRT_CLASSIFY": 2}),
    # validate=True: the mask arrays checked on the device after the attention kernels (no host copy)
    "mask_check": ("helpers/mask_check.cu", params.CHECK, {}),
    # decoding against a KV cache (flashrt/decoding.py): split-KV over GQA-packed rows, then its fp32 partials merged
    "decode": ("sm80/decode.cu", params.DECODE, {}),
    "decode_combine": ("helpers/combine.cu", params.COMBINE, {"FRT_PART_F32": 1, "FRT_OUT_F32": 0}),
    # flashrt.combine: parts in the 16-bit dtype, or fp32 parts and out
    "combine": ("helpers/combine.cu", params.COMBINE, {"FRT_PART_F32": 0, "FRT_OUT_F32": 0}),
    "combine_f32": ("helpers/combine.cu", params.COMBINE, {"FRT_PART_F32": 1, "FRT_OUT_F32": 1}),
    # the same with a thread per (row, 8 columns): few parts over many rows (tiles.combine_rows)
    "combine_rows": ("helpers/combine.cu", params.COMBINE,
                     {"FRT_PART_F32": 0, "FRT_OUT_F32": 0, "FRT_COMBINE_ROWS": 1}),
    "combine_rows_f32": ("helpers/combine.cu", params.COMBINE,
                         {"FRT_PART_F32": 1, "FRT_OUT_F32": 1, "FRT_COMBINE_ROWS": 1}),
}
# Families with no tiles or mask: one thread (or warp) per row or chunk, grid-stride.
ELEMENTWISE = ("bwd_preprocess", "bwd_dkdv_reduce", "bwd_dq_convert", "decode_combine", "combine", "combine_f32",
               "combine_rows", "combine_rows_f32")
# Families that take head_dim at run time (kernels_cu/helpers/combine.cu: p.D): one variant per dtype serves every
# head_dim, compiled at 256 (tiles.tiling), and the name leaves it out.
ANY_HEAD_DIM = ("decode_combine", "combine", "combine_f32", "combine_rows", "combine_rows_f32")
# Families whose tiles tiles.decode_spec chooses from the packed rows (query heads per KV head x new tokens), not
# tiles.tiling; their mask is a run-time argument (no causal or mask bits in the variant).
PACKED_ROWS = ("decode",)
# Key-parallel families (bwd_dkdv.cu, bwd_dkdv_sm90.cu): grid over key tiles (KeyTile in params.cuh).
KEY_PARALLEL = ("bwd_dkdv", "bwd_fused", "bwd_dkdv_sm90", "bwd_fused_sm90")
# Query-parallel families: grid over query tiles (QueryTile in params.cuh).
QUERY_PARALLEL = ("fwd", "fwd_sm90", "fwd_sm90_ws", "bwd_dq", "bwd_dq_sm90")
# Families that apply a softcap (or ALiBi) to the scores when compiled with it (kernels_cu/attention/score_mod.cuh).
SOFTCAP_FAMILIES = QUERY_PARALLEL + KEY_PARALLEL + PACKED_ROWS
# Families that apply a user's score_mod expression (score_mod.cuh: ScoreMod), and those of them that take its
# derivative (the backward's: score_mod_source defines flashrt_score_mod_grad in them).
SCORE_MOD_FAMILIES = QUERY_PARALLEL + KEY_PARALLEL
SCORE_GRAD_FAMILIES = KEY_PARALLEL + ("bwd_dq", "bwd_dq_sm90")
# Families that apply attention dropout when compiled with it (kernels_cu/attention/dropout.cuh): every one that
# computes P but decode's (the wgmma backward's not with a score_mod: flashrt/api.py sends those to mma.sync).
DROPOUT_FAMILIES = QUERY_PARALLEL + KEY_PARALLEL
# Dropout's resolution: an element is kept where its 8 or 16 bits of a draw are under keep = round((1 - p) 2^bits)
# (dropout.cuh: FRT_DROPOUT; the kept ones scaled by 2^bits / keep, the expectation exact). 8-bit draws cost half the
# RNG work (docs/perf-notes.md: Dropout); they serve a p whose drop rate they give within DROPOUT_8BIT_TOLERANCE of
# itself (every p from 0.078 on, and e.g. 0.05), 16-bit ones the others (e.g. 0.01: 8 bits would drop 0.0117).
DROPOUT_8BIT_TOLERANCE = 0.025


def dropout_resolution(p: float) -> tuple[int, int]:
    """(bits, keep) of dropout probability 0 < p < 1: the draw's bits an element takes and the threshold under which
    it is kept."""
    keep8 = round((1 - p) * 256)
    if 1 <= keep8 and abs((256 - keep8) / 256 - p) <= DROPOUT_8BIT_TOLERANCE * p:
        return 8, keep8
    return 16, min(1 << 16, round((1 - p) * (1 << 16)))

# Families compiled for a v whose head_dim differs from q's and k's (KernelSpec.head_dims: the columns each tile loads
# and stores at compile time, kernels_cu/attention/params.cuh: FRT_QK_DIM, FRT_V_DIM); the wgmma ones take them at run
# time (params.cuh: head_dim, head_dim_v), as the helper kernels do: one variant serves every pair.
V_DIM_FAMILIES = ("fwd", "bwd_dq", "bwd_dkdv", "bwd_fused")
# wgmma families (sm_90a only; kernels_cu/common/wgmma.cuh) and the head_dims each has a variant at (layout_problem
# rejects the others; tiles.applies chooses among them).
SM90_HEAD_DIMS = {"fwd_sm90": (64, 128, 192, 256), "fwd_sm90_ws": (64, 128, 192, 256),
                  "bwd_dq_sm90": (64, 128, 192, 256), "bwd_dkdv_sm90": (64, 128, 192, 256), "bwd_fused_sm90": (64, 128)}
# The widths of O (wgmma's N) fwd_sm90_ws takes under its instance at a head_dim it pads (KernelSpec.v_width;
# kernels_cu/common/wgmma.cuh: wgmma_rs)
V_WIDTHS = (64, 96, 128, 160, 192, 224)
# mask_mod's classification kernels: launched with the tiles of the kernel that reads their lists
# (tiles.classifier_spec); they read no q/k/v, so head_dim and dtype are fixed and not in the name.
# The list makers read only the map: no mask bits, no expression (one compile serves every mask_mod).
CLASSIFY = ("mask_map", "mask_rows", "mask_cols")
# Families launched as programmatic dependents of the kernel before them on sm_90+ (KernelSpec.programmatic): each waits
# for that kernel's grid (common.cuh: wait_previous_grid) before it reads what that kernel wrote, and ends no sooner.
# -> the family that must come right before it (launch.Sequence checks), or None: any. (The fused wgmma backward reads
# the caller's K and V before its wait: bwd_preprocess, an ordinary launch, has seen every earlier kernel end.)
PROGRAMMATIC = {"mask_check": None, "decode_combine": None, "bwd_fused_sm90": "bwd_preprocess"}
# Families that read no q, k or v: one compiled kernel serves every head_dim and dtype (fixed at 64 and bf16,
# not in the name; tiles.check_spec, tiles.classifier_spec).
NO_INPUTS = CLASSIFY + ("mask_check",)
DTYPES = ("bf16", "fp16")
MASK_BITS = params.MASK_BITS  # compile-time mask features; the name tag of each in the variant name:
_MASK_TAGS = {1: "len", 2: "win", 4: "blk", 8: "seg", 16: "mod"}
# Mask combinations fwd_sm90_ws has no variant for (each: a mask holding all of its bits; layout_problem rejects
# them, as the kernel's static_assert does): block or segment ids with mask_mod spill its registers (tiles.py:
# _SM90_MASK_LIMITS); fwd_sm90 has them.
FWD_WS_NO_MASKS = (MASK_BITS["block_ids"] | MASK_BITS["mod"], MASK_BITS["segments"] | MASK_BITS["mod"])
# What a mask_mod expression sees besides its tensors (kernels_cu/attention/mask.cuh: flashrt_mask_mod).
MOD_VARIABLES = ("b", "h", "q", "k", "Lq", "Lk")
MAX_MOD_TENSORS = 4
# What a score_mod expression sees besides its tensors (score_mod.cuh: flashrt_score_mod): the scaled score first,
# then mask_mod's, then q and k as floats (cheaper than converting them per score); its tensors' element types
# (KernelSpec.score_mod).
SCORE_VARIABLES = ("s",) + MOD_VARIABLES + ("qf", "kf")
# "float_grad": a float tensor whose gradient the backward computes, by fp32 atomics ("float_grad_exact": into exact
# fixed-point sums, deterministic; score_mod.cuh: tensor_grad_add), which only the dQ kernel's tensor-gradient variant
# keeps (KernelSpec.score_grads); every other variant reads it as "float".
SCORE_TENSOR_TYPES = ("float", "int", "float_grad", "float_grad_exact")


def read_types(tensors: tuple) -> tuple:
    """A score_mod's ((name, type), ...) as the expression reads them: a learned tensor ("float_grad*") is a float."""
    return tuple((n, "float" if t.startswith("float_grad") else t) for n, t in tensors)
ARCH_RE = re.compile(r"sm_(\d+)(a?)")
HEAD_DIMS = tuple(range(8, 257, 8))
NVRTC_OPTIONS = ("-std=c++17",)
SM90_SMEM_OPTIN = 232448  # sm_90's opt-in dynamic shared memory per block (cli.SMEM_OPTIN[90])


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def gemm_warps_m(nw: int, m: int, n: int, max_mt: int = 1 << 30) -> int:
    """Warps along M of an M x N warp GEMM of nw warps (the rest go along N): the split that minimises the fragments
    the warps read from shared memory (each A row is read by every warp along N, each B column by every warp along
    M); ties: more warps along M; 0 if none divides. bwd_dkdv.cu takes its layouts from here (KernelSpec.gemm_warps)."""
    best, best_cost = 0, None
    for wm in range(1, nw + 1):
        wn = nw // wm
        if nw % wm or m % (16 * wm) or n % (8 * wn) or m // (16 * wm) > max_mt:
            continue
        cost = wn * m + wm * n
        if best_cost is None or cost <= best_cost:
            best, best_cost = wm, cost
    return best


# The mma.sync forward's swizzled tiles (KernelSpec.swizzled), where they ran faster than padded ones (H100,
# FLASHRT_NO_SM90=1, scripts/probes/fwd_swizzle.py): +0-4% at 64, +9-11% at 192, +8-9% at 256; 128 ran 0.98-1.01x.
SWIZZLED_FWD_HEAD_DIMS = (64, 192, 256)
# The mma.sync backward's, by family, where they ran faster (H200, FLASHRT_NO_SM90=1, scripts/probes/bwd_swizzle.py;
# docs/perf-notes.md, Backward: split pair): the split pair +5-7% at 128 and 256, the fused kernel +3-4% at 256; at 64
# both and the fused kernel at 128 ran 0.99-1.02x. Not with dropout, softcap, ALiBi, score_mod or mask_mod (swizzled).
SWIZZLED_BWD_HEAD_DIMS = {"bwd_dq": (128, 256), "bwd_dkdv": (128, 256), "bwd_fused": (256,)}
SWIZZLED_FAMILIES = ("decode", "fwd", "bwd_dq", "bwd_dkdv", "bwd_fused")  # (the kernels' FRT_SWIZZLE)


def _swz_disjoint(n: int) -> bool:
    """common.cuh: swz_disjoint (an operand of n chunks per warp, read from a warp's column on)."""
    return n in (1, 2, 4) or n % 8 == 0


def _pitch(cols: int) -> int:
    """Bytes per row of a padded shared tile of `cols` 16-bit elements (common.cuh: Pitch)."""
    return (cols + 8) * 2


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    family: str
    head_dim: int
    dtype: str
    block_m: int
    block_n: int
    warps: int
    causal: bool
    arch: str
    mask: int = 0  # MASK_BITS of the mask features compiled in (0 for ELEMENTWISE families)
    mask_mod: str = ""              # the user's expression (MASK_BITS["mod"])
    mod_tensors: tuple = ()         # names the expression gives its int32 tensors, in order
    min_blocks: int = 1             # blocks per SM the registers must allow (__launch_bounds__; 1: no cap)
    softcap: bool = False           # scores capped by c tanh(s / c) (SOFTCAP_FAMILIES; c is a run-time argument)
    alibi: bool = False             # ALiBi: scores less slope * |j - i - shift| (SOFTCAP_FAMILIES; slopes at run time)
    # A user's score_mod (SCORE_MOD_FAMILIES): (expression, its derivative's expression or "" for the automatic one,
    # ((tensor name, element type in SCORE_TENSOR_TYPES), ...)), or () for none
    score_mod: tuple = ()
    dropout: int = 0                # attention dropout, the bits of its draws (DROPOUT_FAMILIES; dropout_resolution;
                                    # p and the seed are run-time arguments), 0 for none
    # (q's and k's head_dim, v's) where they differ (V_DIM_FAMILIES; the larger is head_dim), or () for both head_dim
    head_dims: tuple = ()
    # fwd_sm90_ws at a head_dim it pads (tiles.qk_width, tiles.v_width): the columns S = Q K^T covers (a multiple of 16
    # under head_dim), and those O = P V does (one of wgmma's widths, V_WIDTHS, under head_dim); 0 for head_dim
    qk_width: int = 0
    v_width: int = 0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown kernel family {self.family!r}; expected one of {sorted(FAMILIES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be a multiple of 8 in [8, 256], got {self.head_dim}")
        if not ARCH_RE.fullmatch(self.arch):
            raise ValueError(f"arch must look like sm_80 or sm_90a, got {self.arch!r}")
        if self.mask & ~sum(MASK_BITS.values()) or (self.mask and self.family in ELEMENTWISE):
            raise ValueError(f"mask bits {self.mask} are not valid for {self.family} (MASK_BITS: {MASK_BITS})")
        if bool(self.mask & MASK_BITS["mod"]) != bool(self.mask_mod) or (self.mod_tensors and not self.mask_mod):
            raise ValueError("a mask_mod expression goes with the mod mask bit, and tensors with an expression")
        if self.family == "mask_map" and not self.mask_mod:
            raise ValueError("mask_map evaluates a mask_mod expression; it needs one")
        if self.family in ANY_HEAD_DIM and self.head_dim != 256:
            raise ValueError(f"{self.family} takes head_dim at run time: its variant is compiled at 256")
        if self.family in PACKED_ROWS and (self.mask or self.causal):
            raise ValueError(f"{self.family} takes its mask at run time: no causal or mask bits")
        if self.family in ("mask_rows", "mask_cols", "mask_check") and (self.mask or self.causal):
            raise ValueError(f"{self.family} reads no attention inputs: it takes no mask")
        if self.softcap and self.family not in SOFTCAP_FAMILIES:
            raise ValueError(f"{self.family} computes no scores: it takes no softcap")
        if self.alibi and self.family not in SOFTCAP_FAMILIES:
            raise ValueError(f"{self.family} computes no scores: it takes no ALiBi")
        if self.alibi and self.softcap:
            raise ValueError("softcap and alibi together are not supported yet")
        if self.dropout not in (0, 8, 16):  # (True == 1: refused too)
            raise ValueError(f"dropout is 0 or the bits of a draw, 8 or 16, got {self.dropout!r}")
        if self.dropout and self.family not in DROPOUT_FAMILIES:
            raise ValueError(f"{self.family} has no dropout variant")
        if self.dropout and self.score_mod and self.family in ("bwd_dkdv_sm90", "bwd_fused_sm90"):
            raise ValueError(f"{self.family} has no variant with dropout and a score_mod")
        if self.dropout and self.family == "bwd_dkdv_sm90" and self.head_dim == 128:  # (tiles._DROPOUT_MASK_LIMITS)
            raise ValueError("bwd_dkdv_sm90 has no dropout variant at head_dim 128")
        if self.head_dims and (self.family not in V_DIM_FAMILIES or len(self.head_dims) != 2
                               or max(self.head_dims) != self.head_dim or self.head_dims[0] == self.head_dims[1]
                               or any(d not in HEAD_DIMS for d in self.head_dims)):
            raise ValueError(f"head_dims (q's and k's, v's) must differ, their larger being head_dim "
                             f"({self.head_dim}), for {V_DIM_FAMILIES}; got {self.head_dims!r} for {self.family}")
        if self.qk_width and (self.family != "fwd_sm90_ws" or self.qk_width % 16 or not 0 < self.qk_width
                              < self.head_dim):
            raise ValueError(f"qk_width (the columns S covers, a multiple of 16 under head_dim, {self.head_dim}) is "
                             f"fwd_sm90_ws's; got {self.qk_width!r} for {self.family}")
        if self.v_width and (self.family != "fwd_sm90_ws" or self.v_width not in V_WIDTHS
                             or not self.v_width < self.head_dim):
            raise ValueError(f"v_width (the columns O covers, one of {V_WIDTHS} under head_dim, {self.head_dim}) is "
                             f"fwd_sm90_ws's; got {self.v_width!r} for {self.family}")
        if len(self.mod_tensors) > MAX_MOD_TENSORS:
            raise ValueError(f"a mask_mod expression reads at most {MAX_MOD_TENSORS} tensors")
        if self.score_mod:
            if self.family not in SCORE_MOD_FAMILIES:
                raise ValueError(f"{self.family} has no score_mod variant")
            if self.softcap or self.alibi:
                raise ValueError("score_mod with softcap or alibi: write them into the expression")
            shaped = isinstance(self.score_mod, tuple) and len(self.score_mod) == 3
            expr, grad, tensors = self.score_mod if shaped else (None, None, None)
            if not (shaped and isinstance(expr, str) and expr and isinstance(grad, str) and isinstance(tensors, tuple)
                    and len(tensors) <= MAX_MOD_TENSORS
                    and all(isinstance(t, tuple) and len(t) == 2 and t[1] in SCORE_TENSOR_TYPES for t in tensors)):
                raise ValueError(f"score_mod must be (expression, derivative or '', ((name, type), ...) with at most "
                                 f"{MAX_MOD_TENSORS} tensors of types {SCORE_TENSOR_TYPES}), got {self.score_mod!r}")
            if grad and self.family not in SCORE_GRAD_FAMILIES:  # (compiled without it: one variant, one cache key)
                object.__setattr__(self, "score_mod", (expr, "", tensors))
            if self.family != "bwd_dq" and read_types(tensors) != tensors:  # (a learned tensor is read as a float:
                # one variant, one cache key)
                object.__setattr__(self, "score_mod", (*self.score_mod[:2], read_types(tensors)))
        problem = self.layout_problem()
        if problem:
            raise ValueError(f"invalid tiling for {self.name}: {problem}")

    # -- identity -----------------------------------------------------------------
    @functools.cached_property  # (a frozen dataclass without __slots__: the cache lands in __dict__)
    def name(self) -> str:
        if self.family == "mask_check":
            return f"flashrt_mask_check_w{self.warps}_{self.arch}"
        if self.family in ANY_HEAD_DIM:
            return f"flashrt_{self.family}_{self.dtype}_w{self.warps}_{self.arch}"
        if self.family in ELEMENTWISE:
            return f"flashrt_{self.family}_hd{self.head_dim}_{self.dtype}_w{self.warps}_{self.arch}"
        mask = "causal" if self.causal else "full"
        mask += "".join(f"_{tag}" for bit, tag in _MASK_TAGS.items() if self.mask & bit)
        if self.mask_mod:  # the expression's identity
            mask += hashlib.sha256(repr((self.mask_mod, self.mod_tensors)).encode()).hexdigest()[:12]
        if self.softcap:
            mask += "_cap"
        if self.alibi:
            mask += "_alibi"
        if self.score_mod:  # the expression's identity (its derivative's where the variant takes one: __post_init__)
            mask += "_smod" + hashlib.sha256(repr(self.score_mod).encode()).hexdigest()[:12]
        if self.dropout:
            mask += f"_drop{self.dropout}"
        if self.head_dims:
            mask += f"_qk{self.head_dims[0]}v{self.head_dims[1]}"
        if self.qk_width:
            mask += f"_s{self.qk_width}"
        if self.v_width:
            mask += f"_o{self.v_width}"
        what = self.family if self.family in CLASSIFY else f"{self.family}_hd{self.head_dim}_{self.dtype}"
        occupancy = f"b{self.min_blocks}" if self.min_blocks > 1 else ""
        return f"flashrt_{what}_{mask}_m{self.block_m}n{self.block_n}w{self.warps}{occupancy}_{self.arch}"

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def programmatic(self) -> bool:
        """Launched as a programmatic dependent of the kernel before it (launch.Sequence): it may start while that
        kernel runs, and waits for it where it must (kernels_cu/common/common.cuh: wait_previous_grid). The device
        check, decode's combine and the fused wgmma backward (after bwd_preprocess), from sm_90 on (docs/perf-notes.md:
        Device check of mask arrays; Decode; Per-block fixed cost)."""
        return self.family in PROGRAMMATIC and int(ARCH_RE.fullmatch(self.arch).group(1)) >= 90

    # -- geometry: the traits structs' rules in kernels_cu/ -----------------------------
    def layout_problem(self) -> str | None:
        """Why the kernel's static_asserts would reject this tiling, or None. The two agree over a grid of tilings of
        every tiled family (tests/test_compile.py: test_host_layout_rules_are_the_kernels_static_asserts)."""
        bm, bn, nw = self.block_m, self.block_n, self.warps
        most = 32 if self.family in CLASSIFY else 16
        if nw < 1 or nw > most:
            return f"warps must be in [1, {most}]"
        if self.min_blocks < 1 or self.min_blocks * nw > 64:
            return "min_blocks must be in [1, 64 / warps]"
        if self.family in ELEMENTWISE or self.family == "mask_check":
            return None
        if self.family in CLASSIFY:
            return None if bm % 16 == 0 and bn % 16 == 0 and bm > 0 and bn > 0 else \
                "block_m and block_n must be positive multiples of 16"
        if bn % 16 or bm % 16 or bm <= 0 or bn <= 0:
            return "block_m and block_n must be positive multiples of 16"
        if self.family in SM90_HEAD_DIMS:
            if self.arch != "sm_90a" or self.head_dim not in SM90_HEAD_DIMS[self.family]:
                return f"{self.family} is for sm_90a at head_dim {', '.join(map(str, SM90_HEAD_DIMS[self.family]))}"
            if self.family == "bwd_fused_sm90":  # 64 keys per consumer warpgroup, and a producer warpgroup
                ok = (bn, nw) == (128, 12) and (bm == 64 or (bm == 128 and self.head_dim == 64))
                return None if ok else "block_m 64 (or 128 at head_dim 64), block_n 128, 12 warps"
            if self.family == "bwd_dkdv_sm90":  # 64 keys per warpgroup, or one warpgroup per gradient above 128
                bn_sm90 = 128 if self.head_dim <= 128 else 64
                return None if (bm, bn, nw) == (64, bn_sm90, 8) else f"block_m 64, block_n {bn_sm90}, 8 warps"
            if self.family == "bwd_dq_sm90" and self.head_dim > 128 and bn != 64:
                return "block_n 64 above head_dim 128"
            if self.family == "fwd_sm90_ws":  # two consumer warpgroups and a producer one
                if any(self.mask & c == c for c in FWD_WS_NO_MASKS):
                    return "no block / segment ids with mask_mod (fwd_sm90 has them)"
                if (bm, nw) != (128, 12) and (bm, nw, self.head_dim) != (192, 16, 64):
                    return "block_m 128 with 12 warps (192 with 16 at head_dim 64)"
                if self.mask & MASK_BITS["mod"] and bn % 64:  # (FwdRows::mod_mask)
                    return "block_n 64 or 128 with a mask_mod"
                if self.head_dim > 128:  # (shared memory: 4 K / V stages beside one or two Q slots)
                    top = 112 if self.head_dim == 192 else 80
                    return None if bn % 16 == 0 and 64 <= bn <= top else \
                        "block_n 64 or 80 above head_dim 128 (64 to 112 at 192), a multiple of 16"
                if bn == 176 and self.head_dim == 128 and not self.causal:  # (tiles._DENSE_PREFERENCES)
                    return None
                return None if bn in (64, 128) else "block_n 64 or 128 (176 at head_dim 128, not causal)"
            return None if (bm, nw) == (128, 8) and bn in (64, 128) else "block_m 128, 8 warps, block_n 64 or 128"
        if self.family in ("fwd", "bwd_dq"):
            return None if bm % (16 * nw) == 0 else "block_m must be a multiple of 16 * warps"
        if self.family == "decode":  # warps over 16-row and 16-key multiples (decode.cu: DecodeTraits)
            wm = bm // 16
            ok = nw % wm == 0 and bn % (nw // wm) == 0 and bn // (nw // wm) % 16 == 0
            if not ok:
                return "warps must tile block_m by 16 rows and block_n by multiples of 16 keys"
            return None
        dp = _round_up(self.head_dim, 16)
        for what, m, n, wm in zip(("keys x queries", "keys x head_dim", "queries x head_dim"),
                                  (bn, bn, bm), (bm, dp, dp), self.gemm_warps):
            if not wm:
                return f"{nw} warps do not tile the {m} x {n} ({what}) GEMM in 16 x 8 fragments"
        if self.dropout and (bm // (8 * (nw // self.gemm_warps[0]))) % 2:  # (dropout.cuh: Dropout::bits)
            return "with dropout a warp's share of S^T must span 16-query multiples (draws cover 16 columns)"
        return None

    @property
    def map_split(self) -> int:
        """mask_map: the warps that share a (query tile, key tile) pair's rounds, FRT_MAP_SPLIT (kernels_cu/helpers/
        mask_classify.cu; tiles.map_slots: the tiles a block holds): four, or fewer where the tile has fewer rounds
        of R rows (R: the 32 lanes' pairs over the columns a lane owns)."""
        cols = -(-self.block_n // 32)
        rows_per_round = 1 if cols >= 32 else 32 // cols
        return min(4, self.block_m // rows_per_round)

    @property
    def gemm_warps(self) -> tuple[int, int, int]:
        """bwd_dkdv / bwd_fused: warps along M of each of its warp GEMMs (gemm_warps_m; 0: none tiles it), the kernel's
        FRT_GEMM_WM1..3 (kernels_cu/sm80/bwd_dkdv.cu): S^T and dP^T (keys x queries), dK and dV (keys x head_dim, at
        most 2 m-tiles per warp: 4 at 64 x 128 w8 read fewer fragments but spilled next to the dK / dV accumulators),
        the fused dQ (queries x head_dim; 1 when not fused)."""
        bm, bn, nw, dp = self.block_m, self.block_n, self.warps, _round_up(self.head_dim, 16)
        return (gemm_warps_m(nw, bn, bm), gemm_warps_m(nw, bn, dp, 2),
                gemm_warps_m(nw, bm, dp) if self.family == "bwd_fused" else 1)

    def _ws_smem(self, slots: int) -> int:
        """fwd_sm90_ws: `slots` Q slots + 2 K and 2 V stages + mbarriers and work items (192) [+ the slots' key
        intervals] + alignment slack (kernels_cu/sm90/fwd_sm90_ws.cu: FwdWsTraits::SMEM)."""
        ids = self.mask & (MASK_BITS["block_ids"] | MASK_BITS["segments"])
        return ((slots * self.block_m + 4 * self.block_n) * self.head_dim * 2 + 192
                + (slots * (8 * self.block_m + 16) if ids else 0) + 1024)

    @property
    def q_slots(self) -> int:
        """fwd_sm90_ws's Q slots (FRT_Q_SLOTS): two where they fit in sm_90's shared memory beside the K / V stages
        (the next item's Q loads under the current one), else one (head_dim 256; 192 with key tiles over 80, 128 with
        176), which goes back at the item's last S (FwdWsTraits::EARLY_Q)."""
        return 2 if self._ws_smem(2) <= SM90_SMEM_OPTIN else 1

    @property
    def decode_stages(self) -> int:
        """decode's cp.async ring depth (FRT_DECODE_STAGES; decode.cu: DecodeTraits::STAGES): 3 up to head_dim 128,
        2 above (shared memory). Deeper rings ran 0.86-1.02x (scripts/probes/decode_stages.py; docs/perf-notes.md,
        Decode: the loader)."""
        return 3 if self.head_dim <= 128 else 2

    @property
    def swizzled(self) -> bool:
        """The mma.sync kernels' Q / K / V (/ dO) tiles unpadded and swizzled (FRT_SWIZZLE; common.cuh: chunk_at),
        else padded: cp.async into a padded pitch made L1 fetch 1.5x each tile's sectors from L2. decode wherever rows
        are a multiple of 128 bytes (head_dim 64, 128, 192, 256 and those padded to them); the forward at exactly
        SWIZZLED_FWD_HEAD_DIMS, the backward at SWIZZLED_BWD_HEAD_DIMS where swizzle_fits, without dropout or modified
        scores (docs/perf-notes.md, Decode: the loader; Forward: mma.sync; Backward: split pair)."""
        if self.family == "fwd":  # (exactly those: 56, run at 64, spilled 8 bytes with NVRTC 13.0)
            return self.head_dim in SWIZZLED_FWD_HEAD_DIMS
        if self.family in ("bwd_dq", "bwd_dkdv", "bwd_fused"):  # (not measured with these; 256 spilled 4-8 bytes)
            modified = self.softcap or self.alibi or self.score_mod or self.dropout or self.mask & MASK_BITS["mod"]
            return not modified and self.head_dim in SWIZZLED_BWD_HEAD_DIMS[self.family] and self.swizzle_fits
        return self.family == "decode" and _round_up(self.head_dim, 16) % 64 == 0

    @property
    def swizzle_fits(self) -> bool:
        """Whether the mma.sync kernel can take swizzled tiles: rows a multiple of 128 bytes; bwd_dkdv / bwd_fused
        read dO, Q (dK, dV) and K (the fused dQ) from a warp's column on, in chunk groups that lane_chunk_at's sw
        rule allows (common.cuh: swz_disjoint; bwd_dkdv.cu: DkdvTraits)."""
        dp = _round_up(self.head_dim, 16)
        if dp % 64:
            return False
        if self.family not in ("bwd_dkdv", "bwd_fused"):
            return True
        if 0 in self.gemm_warps:  # (not a layout: layout_problem)
            return False
        wn1, wn2, wm3 = self.gemm_warps
        nt2 = dp // (8 * (self.warps // wn2))
        if self.family == "bwd_dkdv":
            return _swz_disjoint(nt2)
        mt3, nt3 = self.block_m // (16 * wm3), dp // (8 * (self.warps // wm3))
        cap = max(8 // mt3, 1)
        nq = max(c for c in range(1, min(nt3, cap) + 1) if nt3 % c == 0)  # (bwd_dkdv.cu: chunk_of)
        return _swz_disjoint(nt2) and _swz_disjoint(nq)

    @property
    def static_smem_bound(self) -> int:
        """Bytes of static shared memory the kernel may declare beside its dynamic block (smem_bytes), an upper bound: a
        masked kernel's block Visibility and a mask_mod's state (mask.cuh; 32-240 bytes, NVRTC 12.9), with block or
        segment ids its tile's TileIntervals too (8 bytes a query row of a query-parallel kernel's tile, a key row of
        a key-parallel one's, + 16); decode's page flags (128). tests/test_compile.py checks it against ptxas for every
        variant; the tiling keeps the two within the device's limit (tiles._first_fit: with ids, head_dim 200-208's
        128-row dQ tiles filled sm_80's and did not launch)."""
        if self.family == "decode":
            return 256
        if not self.mask or self.family in ELEMENTWISE or self.family == "fwd_sm90_ws":  # (its intervals: dynamic)
            return 0
        rows = self.block_m if self.family in QUERY_PARALLEL else self.block_n
        return 384 + (8 * rows + 16 if self.mask & (MASK_BITS["block_ids"] | MASK_BITS["segments"]) else 0)

    @functools.cached_property  # read at every launch
    def smem_bytes(self) -> int:
        bm, bn = self.block_m, self.block_n
        dp = _round_up(self.head_dim, 16)
        ld = 2 * dp if self.swizzled else _pitch(dp)  # the mma.sync families' row pitch
        if self.family == "fwd":  # Q + 2 stages of (K, V)
            return bm * ld + 2 * 2 * bn * ld
        # wgmma families: unpadded swizzled tiles + 1024-byte alignment slack
        if self.family == "fwd_sm90":  # Q + 2 stages of (K, V)
            return (bm + 4 * bn) * self.head_dim * 2 + 1024
        if self.family == "fwd_sm90_ws":
            return self._ws_smem(self.q_slots)
        if self.family == "bwd_dq_sm90":  # Q, dO + 2 stages of (K, V); above head_dim 192 one V buffer
            return (2 * bm + (3 if self.head_dim > 192 else 4) * bn) * self.head_dim * 2 + 1024
        if self.family == "bwd_dkdv_sm90":  # K, V + stages of (Q, dO, lse2, delta) [+ P^T]
            stages = 3 if self.head_dim == 64 else 2  # head_dim 64: pipelined (bwd_dkdv_sm90.cu)
            xch = 128 * (bm // 2) * 4 if self.head_dim > 128 else 0  # fp32 P^T between the warpgroups
            return (2 * bn + 2 * stages * bm) * self.head_dim * 2 + stages * 2 * bm * 4 + xch + 1024
        if self.family == "bwd_fused_sm90":  # K, V + stages of (Q, dO, lse2, delta, pair) + two dS^T tiles + fp32 dQ
            # tile + mbarriers + the writer's job (bwd_fused_sm90_ws.cu: FusedWsTraits)
            stages = 4 if self.head_dim == 64 and bm == 64 else 2
            return ((2 * bn + 2 * stages * bm) * self.head_dim * 2 + stages * (2 * bm * 4 + 16) + 2 * bn * bm * 2
                    + bm * self.head_dim * 4 + 8 * (3 + 2 * stages) + 32 + 1024)
        if self.family == "decode":  # Q + stages of (K, V); Q in the last stage where it is read into registers and
            # fits there; at least the epilogue's exchange: each warp column's row statistics and fp32 O rows
            # (decode.cu: DecodeTraits::SMEM)
            q_in_stage = dp <= 128 and bm <= 2 * bn
            wn = max(1, self.warps // (bm // 16))
            return max((0 if q_in_stage else bm) * ld + self.decode_stages * 2 * bn * ld,
                       2 * wn * bm * 4 + wn * bm * (dp + 4) * 4)
        if self.family == "bwd_dq":  # Q, dO + 2 stages of (K, V)
            return 2 * bm * ld + 2 * 2 * bn * ld
        if self.family in KEY_PARALLEL:  # K, V + 2 stages of (Q, dO) + P^T, dS^T + 2 stages of (lse2, delta)
            return 2 * bn * ld + 2 * 2 * bm * ld + 2 * bn * _pitch(bm) + 2 * 2 * bm * 4
        return 0

    # -- compilation ----------------------------------------------------------------
    @property
    def source_file(self) -> str:
        return FAMILIES[self.family][0]

    def options(self) -> list[str]:
        defines = {
            "FRT_KERNEL_NAME": self.name,
            "FRT_HEAD_DIM": self.head_dim,
            "FRT_BLOCK_M": self.block_m,
            "FRT_BLOCK_N": self.block_n,
            "FRT_WARPS": self.warps,
            "FRT_MIN_BLOCKS": self.min_blocks,
            "FRT_BF16": int(self.dtype == "bf16"),
            "FRT_CAUSAL": int(self.causal),
            "FRT_SMEM_BYTES": self.smem_bytes,
            "FRT_MASK": self.mask,
            "FRT_SOFTCAP": int(self.softcap),
            "FRT_ALIBI": int(self.alibi),
            "FRT_DROPOUT": int(self.dropout),
            **FAMILIES[self.family][2],
        }
        if self.family == "fwd_sm90_ws":
            defines["FRT_Q_SLOTS"] = self.q_slots
            if self.qk_width:
                defines["FRT_QK_WIDTH"] = self.qk_width
            if self.v_width:
                defines["FRT_V_WIDTH"] = self.v_width
        if self.family == "decode":
            defines["FRT_DECODE_STAGES"] = self.decode_stages
        if self.family in SWIZZLED_FAMILIES:
            defines["FRT_SWIZZLE"] = int(self.swizzled)
        if self.head_dims:  # (kernels_cu/attention/params.cuh)
            defines["FRT_QK_DIM"], defines["FRT_V_DIM"] = self.head_dims
        if self.score_mod:
            defines["FRT_SCORE_MOD"] = 1
            if self.score_grads:  # (score_mod.cuh: tensor_grad_add)
                defines["FRT_SCORE_TGRAD"] = 2 if any(t[1] == "float_grad_exact" for t in self.score_mod[2]) else 1
        if self.family == "mask_map":
            defines["FRT_MAP_SPLIT"] = self.map_split
        if self.family in ("bwd_dkdv", "bwd_fused"):
            defines.update(zip(("FRT_GEMM_WM1", "FRT_GEMM_WM2", "FRT_GEMM_WM3"), self.gemm_warps))
        # (a score_mod's divisions approximate, 2 ulp, as Triton's are: a MUFU op and a multiply, not IEEE division's
        # longer sequence, though a capped score's time was within noise of it, H200; elsewhere the kernels divide
        # only once per row, in the mma.sync forward's normalisation, approximate then too. kernels_cu/attention/
        # dual.cuh: the expression's other fast functions)
        fast = ["--prec-div=false"] if self.score_mod else []
        return [*NVRTC_OPTIONS, *fast, f"--gpu-architecture={self.arch}", *(f"-D{k}={v}" for k, v in defines.items())]

    def translation_unit(self) -> str:
        return (f'#include "{self.source_file}"\n' + params.static_asserts(FAMILIES[self.family][1])
                + (mask_mod_source(self.mask_mod, self.mod_tensors) if self.mask_mod else "")
                + (score_mod_source(*self.score_mod, self.family in SCORE_GRAD_FAMILIES) if self.score_mod else ""))

    @property
    def score_grads(self) -> bool:
        """The dQ kernel's tensor-gradient variant (kernels_cu/sm80/bwd_dq.cu: FRT_SCORE_TGRAD): it computes no dQ but
        adds the gradients of the score tensors marked "float_grad" (a bwd_dq spec keeps that type, no other does)."""
        return bool(self.score_mod) and any(t[1].startswith("float_grad") for t in self.score_mod[2])

    def key_fields(self) -> dict:
        return dataclasses.asdict(self)


MOD_FILE = "mask_mod"  # the file name NVRTC gives the expression in its messages
MOD_END_FILE = "flashrt_mask_mod_end"  # ... and what follows it


def mask_mod_source(expr: str, tensors: tuple) -> str:
    """The definition of kernels_cu/attention/mask.cuh's flashrt_mask_mod around a user's expression.

    At global scope (the expression sees its variables, CUDA's built-ins and macros, the same in
    every kernel); `#line` makes NVRTC report errors in the expression as `mask_mod(LINE): error:
    ...`, with the expression's own line and a caret under the fault.
    """
    names = "".join(f"    const int* const {n} = t{i};\n" for i, n in enumerate(tensors))
    return ("FRT_DEVICE bool flashrt_mask_mod(int b, int h, int q, int k, int Lq, int Lk, const int* t0,\n"
            "                                 const int* t1, const int* t2, const int* t3) {\n"
            f"{names}"
            "    return static_cast<bool>(\n"
            f'#line 1 "{MOD_FILE}"\n'
            f"{expr}\n"
            f'#line 1 "{MOD_END_FILE}"\n'
            "    );\n"
            "}\n")


SCORE_FILE = "score_mod"  # the file names NVRTC gives a score_mod expression, its derivative, and the expression
SCORE_GRAD_FILE = "score_mod_grad"  # over dual numbers (the automatic derivative), in its messages
SCORE_DUAL_FILE = "score_mod (its automatic derivative)"
SCORE_TGRAD_FILE = "score_mod (its tensors' gradient)"  # the expression over Seeded reads (bwd_dq's FRT_SCORE_TGRAD)
SCORE_END_FILE = "flashrt_score_mod_end"


def score_mod_source(expr: str, grad: str, tensors: tuple, with_grad: bool) -> str:
    """The definitions of kernels_cu/attention/score_mod.cuh's flashrt_score_mod (and with_grad its derivative,
    flashrt_score_mod_grad: `grad` over float s, or with grad == "" the expression over dual numbers, dual.cuh)
    around a user's expressions, in namespace flashrt_expr (dual.cuh: the fast tanh, exp and log it sees), after the
    kernel source as mask_mod_source writes mask_mod's."""
    args = ("int b, int h, int q, int k, int Lq, int Lk, float qf, float kf, const void* t0, const void* t1, "
            "const void* t2, const void* t3")
    plain = read_types(tensors)
    names = "".join(f"    const {ctype}* const {n} = static_cast<const {ctype}*>(t{i});\n"
                    for i, (n, ctype) in enumerate(plain))

    def wrapped(text: str, file: str) -> str:  # (parenthesised: a top-level comma is the comma operator in both forms)
        return f'(\n#line 1 "{file}"\n{text}\n#line 1 "{SCORE_END_FILE}"\n)\n'

    out = (f"namespace flashrt_expr {{\nFRT_DEVICE float flashrt_score_mod(float s, {args}) {{\n{names}"
           f"    return static_cast<float>(\n{wrapped(expr, SCORE_FILE)}    );\n}}\n")
    if any(c.startswith("float_grad") for _, c in tensors):  # (dual.cuh: Reads, Seeded; score_mod.cuh: tensor_grads)
        seeded = "".join(f"        const {c}* const {n} = static_cast<const {c}*>(t{i});\n"
                         if c in ("float", "int") else
                         f"        const flashrt_dual::Seeded {n}{{static_cast<const float*>(t{i}), flashrt_g{i}, "
                         f"flashrt_n{i}, &flashrt_reads}};\n" for i, (n, c) in enumerate(tensors))
        out += (f"FRT_DEVICE void flashrt_score_mod_tgrad(float flashrt_s, {args}, float flashrt_dz, "
                + ", ".join(f"void* flashrt_g{i}" for i in range(4)) + ", "
                + ", ".join(f"long long flashrt_n{i}" for i in range(4))
                + ") {\n    for (int flashrt_target = 0;; ++flashrt_target) {\n"
                f"        flashrt_dual::Reads flashrt_reads{{flashrt_target}};\n{seeded}"
                f"        const float s = flashrt_s;\n"
                f"        const flashrt_dual::Dual flashrt_r = flashrt_dual::Dual(\n{wrapped(expr, SCORE_TGRAD_FILE)}"
                f"        );\n"
                f"        if (!flashrt_reads.hit) return;\n"
                f"        if (flashrt_reads.grad != nullptr && flashrt_r.d != 0.f)\n"
                f"            frt::tensor_grad_add(flashrt_reads.grad, flashrt_reads.index,\n"
                f"                                 flashrt_dz * flashrt_r.d);\n"
                f"    }}\n}}\n")
    if not with_grad:
        return out + "}\n"
    if grad:
        return out + (f"FRT_DEVICE float flashrt_score_mod_grad(float s, {args}, float* flashrt_value) {{\n"
                      f"    *flashrt_value = flashrt_score_mod(s, b, h, q, k, Lq, Lk, qf, kf, t0, t1, t2, t3);\n{names}"
                      f"    return static_cast<float>(\n{wrapped(grad, SCORE_GRAD_FILE)}    );\n}}\n}}\n")
    return out + (f"FRT_DEVICE float flashrt_score_mod_grad(float flashrt_s, {args}, float* flashrt_value) {{\n"
                  f"{names}    const flashrt_dual::Dual s(flashrt_s, 1.f);\n"
                  f"    const flashrt_dual::Dual flashrt_r = flashrt_dual::Dual(\n{wrapped(expr, SCORE_DUAL_FILE)}"
                  f"    );\n    *flashrt_value = flashrt_r.v;\n    return flashrt_r.d;\n}}\n}}\n")
