"""What the host and the kernels share: the argument structs of kernels_cu/attention/params.cuh, and the
tables that tables_header() gives the kernels as compile-time constants (one definition of each).

A struct is passed to a kernel by value as a one-element numpy structured
array. Every compiled variant includes `static_asserts`, a check of the
struct's size; tests/test_spec.py compares the field lists with the header.
"""
from __future__ import annotations

import functools
import struct

import numpy as np

_PTR, _I64, _I32, _F32 = np.uint64, np.int64, np.int32, np.float32
_MAP = np.dtype((np.void, 128))  # a CUtensorMap (flashrt/tma.py), 64-byte aligned in the struct


# Compile-time mask features: the bits of FRT_MASK (spec.KernelSpec.mask; kernels_cu/attention/mask.cuh: MASK_*).
MASK_BITS = {"lengths": 1, "window": 2, "block_ids": 4, "segments": 8, "mod": 16}
# The device check's report (kernels_cu/helpers/mask_check.cu; masks.raise_reported reads it): its int32 words in
# order, and its failures, whose codes are 1, 2, ... in this order (0: none).
REPORT_WORDS = ("code", "arg", "seq", "pos", "value", "limit", "call")
CHECK_FAILURES = ("length", "cu_start", "cu_order", "cu_end", "cu_longest", "ids_order",
                  "cache_seqlens", "page_id")  # (the last two: decode.cu)
# The tiled kernels' grids: the coordinate each CUDA grid axis (x, y, z) carries. launch.grid sizes the axes from it,
# and the kernels read their coordinates through it (kernels_cu/attention/params.cuh: grid_index, grid_extent). A
# coordinate "a_b" holds a * (b's extent) + b. The tile axis is x, which the hardware starts fastest (the chunked
# orders of params.cuh count on it).
GRID_AXES = {"query": ("tile", "head", "batch"),          # query-parallel kernels: fwd, bwd_dq, bwd_dq_sm90
             "key": ("tile", "split_kv_head", "batch"),   # key-parallel ones: bwd_dkdv, bwd_fused and their sm90 forms
             "decode": ("split", "kv_head_row_tile", "batch"),
             "mask_map": ("slot_block", "query_tile", "batch_head")}  # mask_classify.cu: key tiles by slots
TABLES_HEADER = "flashrt_tables.cuh"


def tables_header() -> str:
    """The in-memory header TABLES_HEADER (cache.kernel_sources: in every compile and every cache key): the tables
    above as macros and enums of namespace frt, so that no kernel keeps a copy of its own."""
    def enum(names):
        return "enum : int { " + ", ".join(names) + " };"
    return "\n".join([
        "// Generated from flashrt/params.py (tables_header): the tables the host and the kernels share.",
        "#pragma once",
        *(f"#define FRT_MASK_{name.upper()} {bit}" for name, bit in MASK_BITS.items()),  # for #if
        "namespace frt {",
        enum(f"MASK_{name.upper()} = {bit}" for name, bit in MASK_BITS.items()),
        enum([f"REPORT_{w.upper()}" for w in REPORT_WORDS] + ["REPORT_WORDS"]),
        enum(f"BAD_{name.upper()} = {code}" for code, name in enumerate(CHECK_FAILURES, 1)),
        enum(f"GRID_{layout.upper()}_{coord.upper()} = {axis}" for layout, coords in GRID_AXES.items()
             for axis, coord in enumerate(coords)),
        "}  // namespace frt", ""])


def _strides(*tensors: str) -> list[tuple[str, type]]:
    return [(f"{t}_{axis}", _I64) for t in tensors for axis in ("sb", "ss", "sh")]


# kernels_cu/attention/mask.cuh's run-time inputs, in both structs.
_MASK_PTRS = [(n, _PTR) for n in ("seqlens_q", "seqlens_k", "cu_q", "cu_k", "block_q", "block_k", "seg_q", "seg_k")]
_STATS = [("st_sb", _I64), ("st_sh", _I64)]
_DIMS = [(n, _I32) for n in ("B", "H", "Hkv", "Sq", "Sk", "win_left", "win_right", "top_left", "total_q", "total_k")]
# mask_mod's fields, last in both structs.
_MOD = ([(n, _PTR) for n in ("mod_map", "mod_rows", "mod_rows_count", "mod_cols", "mod_cols_count", "mod_t0", "mod_t1",
                             "mod_t2", "mod_t3")]
        + [("mod_heads", _I32), ("mod_batches", _I32)])
# ALiBi's slopes (null: none) and their batch stride (H for (B, H) slopes, 0 for (H,)), last in both structs.
_ALIBI = [("alibi", _PTR), ("alibi_bstride", _I32)]
# A score_mod expression's tensors (null: unused), last in both structs.
_SCORE = [(f"score_t{i}", _PTR) for i in range(4)]
# Dropout (kernels_cu/attention/dropout.cuh): the (seed, offset) pair in device memory, the keep threshold of an
# element's 8 or 16 bits (spec.dropout_resolution) and the kept probabilities' scale, ~1 / (1 - p).
_DROPOUT = [("drop_rng", _PTR), ("drop_keep", _I32), ("drop_scale", _F32)]
# The tensors' head_dims, q's and k's and v's (a kernel's D is their larger or the wgmma instance above it:
# tiles.sm90_head_dim), last in both structs.
_HEAD_DIM = [("head_dim", _I32), ("head_dim_v", _I32)]

FWD = np.dtype(
    [(n, _MAP) for n in ("q_map", "k_map", "v_map")]
    + [(n, _PTR) for n in ("q", "k", "v", "o", "lse")]
    + _MASK_PTRS
    + _strides("q", "k", "v", "o")
    + _STATS + _DIMS
    + [("scale_log2", _F32)]
    + _MOD
    + [("sched_pairs", _I32), ("sched", _PTR), ("use_tma", _I32), ("sinks", _PTR), ("softcap", _F32)]
    + _ALIBI + _SCORE + _DROPOUT + _HEAD_DIM,
    align=True,
)
# The C struct's size is a multiple of its alignment, 64 with the maps (numpy's align=True goes to 8); BWD's too.
FWD = np.dtype({"names": FWD.names, "formats": [FWD.fields[n][0] for n in FWD.names],
                "offsets": [FWD.fields[n][1] for n in FWD.names], "itemsize": -(-FWD.itemsize // 64) * 64})

BWD = np.dtype(
    [(n, _MAP) for n in ("q_map", "do_map", "k_map", "v_map")]
    + [(n, _PTR) for n in ("q", "k", "v", "o", "dout", "lse", "lse2", "delta", "dq", "dk", "dv", "dkv_partial",
                           "dq_accum", "dq_sem")]
    + [("splits", _I32), ("sched_pairs", _I32), ("sched_key_pairs", _I32), ("dq_swizzle", _I32), ("use_tma", _I32),
       ("dq_rotate", _I32), ("dq_first_store", _I32)]
    + _MASK_PTRS
    + _strides("q", "k", "v", "o", "do", "dq", "dk", "dv")
    + _STATS + _DIMS
    + [("scale_log2", _F32), ("scale", _F32)]
    + _MOD
    + [("softcap", _F32)]
    + _ALIBI + _SCORE + [(f"score_g{i}", _PTR) for i in range(4)] + [(f"score_n{i}", _I64) for i in range(4)]
    + _DROPOUT + _HEAD_DIM,
    # (the score tensors' gradients and sizes: bwd_dq.cu's tensor-gradient pass)
    align=True,
)
BWD = np.dtype({"names": BWD.names, "formats": [BWD.fields[n][0] for n in BWD.names],
                "offsets": [BWD.fields[n][1] for n in BWD.names], "itemsize": -(-BWD.itemsize // 64) * 64})

# kernels_cu/helpers/mask_check.cu's: the mask arrays (named as in FWD / BWD), the outputs it sets to NaN on a failure
# (linked to the call's outputs: api._add_check) and their sizes, the report's address and the extents.
CHECK = np.dtype(
    _MASK_PTRS
    + [(f"poison{i}", _PTR) for i in range(3)] + [(f"poison_bytes{i}", _I64) for i in range(3)]
    + [("report", _PTR)]
    + [(n, _I32) for n in ("B", "Sq", "Sk", "total_q", "total_k", "call")],
    align=True,
)

# kernels_cu/sm80/decode.cu's and kernels_cu/helpers/combine.cu's (flashrt/decoding.py fills them).
DECODE = np.dtype(
    [(n, _PTR) for n in ("q", "k_cache", "v_cache", "k_new", "v_new", "o", "lse", "o_part", "lse_part",
                        "cache_seqlens", "page_table", "report")]
    + [(f"{t}_{axis}", _I64) for t in ("q", "kc", "kn", "o") for axis in ("sb", "ss", "sh")]
    + [("pt_sb", _I64)]
    + [(n, _I32) for n in ("B", "H", "Hkv", "Sq", "capacity", "seqlen", "page_size", "page_shift", "num_pages",
                           "splits", "causal", "win_left", "win_right")]
    + [("scale_log2", _F32), ("softcap", _F32), ("sinks", _PTR), ("alibi", _PTR), ("alibi_bstride", _I32),
       ("cluster", _I32)],
    align=True,
)
COMBINE = np.dtype([(n, _PTR) for n in ("o_part", "lse_part", "o", "lse")]
                   + [(n, _I32) for n in ("n", "B", "Sq", "H", "D", "row_warps")] + [("sinks", _PTR)], align=True)

C_NAMES = {FWD: "frt::FwdParams", BWD: "frt::BwdParams", CHECK: "frt::CheckParams", DECODE: "frt::DecodeParams",
           COMBINE: "frt::CombineParams"}
_CODES = {np.dtype(_PTR): "Q", np.dtype(_I64): "q", np.dtype(_I32): "i", np.dtype(_F32): "f", _MAP: "128s"}


@functools.lru_cache(maxsize=None)
def _packer(dtype: np.dtype) -> struct.Struct:
    """A struct.Struct with dtype's field order, types, alignment padding and size."""
    fmt, pos = "<", 0
    for name in dtype.names:
        field, offset = dtype.fields[name][:2]
        fmt += f"{offset - pos}x" * (offset > pos) + _CODES[field]
        pos = offset + field.itemsize
    fmt += f"{dtype.itemsize - pos}x" * (dtype.itemsize > pos)
    return struct.Struct(fmt)


def pack(dtype: np.dtype, values: dict) -> np.ndarray:
    """The kernel argument struct as one field-less element (fields not in `values` are 0, maps zero bytes).

    Built with struct.pack and passed without a structured dtype: CuPy reads a NumPy kernel
    argument through __array_interface__, which for a structured dtype rebuilds its field
    list on every launch (~0.1 ms); filling a structured array field by field cost as much.
    """
    data = _packer(dtype).pack(*(values.get(name, b"" if dtype.fields[name][0] == _MAP else 0) for name in dtype.names))
    return np.frombuffer(data, dtype=np.dtype((np.void, dtype.itemsize)))


def static_asserts(dtype: np.dtype) -> str:
    c = C_NAMES[dtype]
    return f'static_assert(sizeof({c}) == {dtype.itemsize}, "flashrt/params.py disagrees on sizeof({c})");\n'
