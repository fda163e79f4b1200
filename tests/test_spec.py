"""Variant naming, keys, tile/smem/grid arithmetic, argument structs: pure functions, no GPU."""
import dataclasses
import json
import re

import numpy as np
import pytest

from flashrt import cache, launch, masks, params, tiles
from flashrt.cli import SMEM_OPTIN
from flashrt.spec import (ANY_HEAD_DIM, FAMILIES, HEAD_DIMS, MASK_BITS, NO_INPUTS, PACKED_ROWS, SM90_SMEM_OPTIN,
                          SOFTCAP_FAMILIES, KernelSpec)


def spec(**kw):
    base = dict(family="fwd", head_dim=128, dtype="bf16", block_m=128, block_n=64, warps=8, causal=True,
                arch="sm_90a")
    base.update(kw)
    return KernelSpec(**base)


def test_name_is_systematic_and_unique():
    assert spec().name == "flashrt_fwd_hd128_bf16_causal_m128n64w8_sm_90a"
    assert spec(causal=False, dtype="fp16", arch="sm_80").name == "flashrt_fwd_hd128_fp16_full_m128n64w8_sm_80"
    names = {spec(family=f, head_dim=d, causal=c).name
             for f in ("fwd", "bwd_dq") for d in (64, 128) for c in (False, True)}
    assert len(names) == 8
    pre = KernelSpec("bwd_preprocess", 64, "bf16", 0, 0, 8, False, "sm_80")
    assert pre.name == "flashrt_bwd_preprocess_hd64_bf16_w8_sm_80"
    assert spec(min_blocks=2).name == "flashrt_fwd_hd128_bf16_causal_m128n64w8b2_sm_90a"


def test_options_bake_every_parameter():
    opts = spec().options()
    assert "--gpu-architecture=sm_90a" in opts
    for define in ("FRT_HEAD_DIM=128", "FRT_BLOCK_M=128", "FRT_BLOCK_N=64", "FRT_WARPS=8", "FRT_BF16=1",
                   "FRT_CAUSAL=1", f"FRT_SMEM_BYTES={spec().smem_bytes}", f"FRT_KERNEL_NAME={spec().name}",
                   "FRT_MIN_BLOCKS=1"):
        assert f"-D{define}" in opts
    assert "-DFRT_MIN_BLOCKS=2" in spec(min_blocks=2).options()


def test_tilings_for_several_blocks_per_sm_fit_their_shared_memory():
    """A tiling asking for min_blocks per SM must leave room for them in an SM's shared memory (H100 / H200:
    228 KiB, 1 KiB of it reserved per block); registers are capped by the kernel's launch bounds."""
    for family in set(FAMILIES) - set(NO_INPUTS) - set(PACKED_ROWS):
        for d in (256,) if family in ANY_HEAD_DIM else HEAD_DIMS:  # (those compiled at 256 only)
            for mask in (0, MASK_BITS["lengths"] | MASK_BITS["window"], MASK_BITS["mod"]):
                try:
                    tilings = tiles.candidates(family, d, mask)
                except ValueError:
                    continue
                for bm, bn, nw, mb in tilings:
                    if mb > 1 and tiles.applies(family, d, "sm_90a"):
                        s = KernelSpec(family, d, "bf16", bm, bn, nw, False, "sm_90a", min_blocks=mb)
                        assert mb * (s.smem_bytes + 1024) <= 228 * 1024, s.name


@pytest.mark.parametrize("bad", [dict(head_dim=12), dict(head_dim=264), dict(dtype="fp32"), dict(arch="90"),
                                 dict(family="nope"), dict(block_m=96, warps=4), dict(block_n=24),
                                 dict(min_blocks=0), dict(min_blocks=9)])
def test_invalid_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        spec(**bad)


def test_score_mods_are_compiled_in_and_named():
    assert spec(softcap=True).name == "flashrt_fwd_hd128_bf16_causal_cap_m128n64w8_sm_90a"
    assert spec(alibi=True).name == "flashrt_fwd_hd128_bf16_causal_alibi_m128n64w8_sm_90a"
    assert "-DFRT_ALIBI=1" in spec(alibi=True).options() and "-DFRT_ALIBI=0" in spec().options()
    assert "-DFRT_SOFTCAP=0" in spec(alibi=True).options()
    with pytest.raises(ValueError, match="softcap and alibi together are not supported yet"):
        spec(softcap=True, alibi=True)
    with pytest.raises(ValueError, match="bwd_preprocess computes no scores: it takes no ALiBi"):
        KernelSpec("bwd_preprocess", 64, "bf16", 0, 0, 8, False, "sm_80", alibi=True)
    # decode takes either, at its plain tiles
    plain = tiles.decode_spec(128, "bf16", 4, "sm_90a", SMEM_OPTIN[90])
    for kw, tag in (({"softcap": True}, "cap"), ({"alibi": True}, "alibi")):
        mod = tiles.decode_spec(128, "bf16", 4, "sm_90a", SMEM_OPTIN[90], **kw)
        assert mod.name.endswith(f"_{tag}_m16n64w4_sm_90a")
        assert dataclasses.replace(mod, **{k: False for k in kw}) == plain
    # tiling: only the families that compute scores take it; the helper kernels never do
    for family in ("fwd", "bwd_dq", "bwd_dkdv", "bwd_fused", "bwd_preprocess", "bwd_dq_convert"):
        s = tiles.tiling(family, 128, "bf16", True, "sm_80", SMEM_OPTIN[80], alibi=True)
        assert s.alibi == (family in SOFTCAP_FAMILIES) and not s.softcap
        if s.alibi:  # the plain tiling (no table of its own yet)
            plain = tiles.tiling(family, 128, "bf16", True, "sm_80", SMEM_OPTIN[80])
            assert dataclasses.replace(s, alibi=False) == plain
    fwd = tiles.tiling("fwd", 64, "bf16", True, "sm_80", SMEM_OPTIN[80], MASK_BITS["mod"], "k <= q", alibi=True)
    assert fwd.alibi and not tiles.classifier_spec(fwd, "mask_map").alibi


def test_smem_formula():
    # Q tile (128 rows) + 2 stages x (K, V) tiles (64 rows), rows of 128 + 8 padding elements (2 bytes).
    assert spec().smem_bytes == (128 + 4 * 64) * (128 + 8) * 2
    # head_dim 72 pads to 80 columns
    assert spec(head_dim=72).smem_bytes == (128 + 4 * 64) * (80 + 8) * 2
    # the backward: Q, dO (64 rows each) + 2 stages x (K, V); dK/dV's P^T, dS^T tiles (always padded) and its stats.
    # head_dim 64 rows are padded (64 + 8 elements); 128 ones swizzled (spec.SWIZZLED_BWD_HEAD_DIMS): 256 bytes
    for d, row in ((64, (64 + 8) * 2), (128, 128 * 2)):
        dkdv = spec(family="bwd_dkdv", head_dim=d, block_m=64, block_n=64)
        assert dkdv.swizzled == (d == 128)
        assert dkdv.smem_bytes == (2 * 64 + 4 * 64) * row + 2 * 64 * (64 + 8) * 2 + 16 * 64
        assert spec(family="bwd_dq", head_dim=d, block_m=64, block_n=64, warps=4).smem_bytes == (2 * 64 + 4 * 64) * row


@pytest.mark.parametrize("arch,limit", [("sm_80", SMEM_OPTIN[80]), ("sm_86", SMEM_OPTIN[86]),
                                        ("sm_90a", SMEM_OPTIN[90]), ("sm_90a", 64 * 1024)])
def test_tiling_fits_every_head_dim(arch, limit):
    for family in set(FAMILIES) - set(NO_INPUTS) - set(PACKED_ROWS):
        for d in HEAD_DIMS:
            if family in ("fwd_sm90", "fwd_sm90_ws") and family not in (
                    tiles.forward_family(d, arch, limit), tiles.forward_family(d, arch, limit, MASK_BITS["window"])):
                continue  # the forward is another family there (for every mask)
            if family in ("bwd_dq_sm90", "bwd_dkdv_sm90") and family not in tiles.split_families(d, arch, limit):
                continue  # the split backward is bwd_dq.cu / bwd_dkdv.cu there
            if family == "bwd_fused_sm90" and family != tiles.fused_family(d, arch, limit):
                continue  # the fused backward is bwd_dkdv.cu's there
            s = tiles.tiling(family, tiles.sm90_head_dim(family, d), "bf16", True, arch, limit)
            instance = 256 if family in ANY_HEAD_DIM else tiles.sm90_head_dim(family, d)
            assert s.smem_bytes <= limit and s.head_dim == instance and s.arch == arch
            assert s.layout_problem() is None


def test_tiling_prefers_large_tiles_when_they_fit():
    big = tiles.tiling("fwd", 128, "bf16", False, "sm_90a", SMEM_OPTIN[90])
    small = tiles.tiling("fwd", 128, "bf16", False, "sm_86", 48 * 1024)
    assert (big.block_m, big.block_n, big.warps, big.min_blocks) == tiles.candidates("fwd", 128)[0]
    assert big.smem_bytes > 48 * 1024
    assert small.smem_bytes <= 48 * 1024 and small.block_m * small.block_n < big.block_m * big.block_n


def test_fused_wgmma_backward_query_tiles():
    """bwd_fused_sm90 (kernels_cu/sm90/bwd_fused_sm90_ws.cu): 128-query tiles at head_dim 64 without masks beyond
    lengths, plain or with ALiBi (its measured spills: tiles._ALIBI_PREFERENCES), 64 otherwise (softcap, masks) and
    at 128; no 128-query tiles at 128 (the registers)."""
    def bm(d, causal=False, mask=0, **mod):
        return tiles.tiling("bwd_fused_sm90", d, "bf16", causal, "sm_90a", SMEM_OPTIN[90], mask, **mod).block_m
    for causal in (False, True):
        assert bm(64, causal) == bm(64, causal, MASK_BITS["lengths"]) == 128
        for mask in (MASK_BITS["window"], MASK_BITS["block_ids"], MASK_BITS["segments"]):
            assert bm(64, causal, mask) == 64
        assert bm(64, causal, softcap=True) == bm(64, causal, MASK_BITS["window"], alibi=True) == 64
        assert bm(64, causal, alibi=True) == bm(64, causal, MASK_BITS["lengths"], alibi=True) == 128
        assert bm(64, causal, alibi=True, dropout=8) == bm(128, causal, alibi=True) == 64
        assert bm(128, causal) == 64
    ok = tiles.tiling("bwd_fused_sm90", 64, "bf16", False, "sm_90a", SMEM_OPTIN[90])
    assert ok.smem_bytes <= SMEM_OPTIN[90] and ok.layout_problem() is None
    with pytest.raises(ValueError, match=r"block_m 64 \(or 128 at head_dim 64\)"):
        dataclasses.replace(ok, head_dim=128)
    # impl="auto" reads its thresholds by the tile the call runs: 64-query tiles at head_dim 64 wait for longer
    # sequences than 128-query ones (ordered: 16384 against 4096)
    assert tiles.backward_impl(64, True, True, True, True, False, 4096, 0, 128) == "fused"
    assert tiles.backward_impl(64, True, True, True, True, False, 4096, MASK_BITS["window"], 64) == "split"
    # ALiBi's 128-query tiles (tiles.FUSED_WGMMA_MIN_SQ_MODIFIED): ordered non-causal fused from 1k, causal from 2k
    assert tiles.backward_impl(64, True, True, True, True, False, 1024, 0, 128, modified=True, rotated=True) == "fused"
    assert tiles.backward_impl(64, True, True, True, True, True, 1024, 0, 128, modified=True) == "split"
    assert tiles.backward_impl(64, True, True, True, True, True, 2048, 0, 128, modified=True) == "fused"


def test_tiling_error_names_required_and_limit():
    with pytest.raises(tiles.TilingError, match=r"limit of 1000 bytes.*required: flashrt_fwd_hd256"):
        tiles.tiling("fwd", 256, "bf16", False, "sm_80", 1000)


def test_grids():
    fwd = spec()
    assert launch.grid(fwd, B=3, H=8, Hkv=2, Sq=1000, Sk=10) == (8, 8, 3)
    dq = spec(family="bwd_dq", block_m=64, block_n=64, warps=4)
    assert launch.grid(dq, B=2, H=4, Hkv=1, Sq=65, Sk=7) == (2, 4, 2)
    dkdv = spec(family="bwd_dkdv", block_m=64, block_n=32, warps=8)
    assert launch.grid(dkdv, B=2, H=8, Hkv=2, Sq=5, Sk=100) == (4, 2, 2)
    pre = KernelSpec("bwd_preprocess", 64, "bf16", 0, 0, 8, False, "sm_80")
    assert launch.grid(pre, B=1, H=1, Hkv=1, Sq=3, Sk=1) == (1, 1, 1)
    assert launch.grid(pre, B=64, H=64, Hkv=64, Sq=8192, Sk=1, sm_count=132) == (32 * 132, 1, 1)
    with pytest.raises(launch.LaunchError, match="65535"):
        launch.grid(fwd, B=70000, H=8, Hkv=8, Sq=1, Sk=1)


def test_wgmma_forward_grid_is_one_dimensional():
    """fwd_sm90: a 1-D grid of work items (kernels_cu/attention/params.cuh: work_item), one per query tile: no y/z
    limit."""
    f128 = KernelSpec("fwd_sm90", 128, "bf16", 128, 128, 8, True, "sm_90a")
    assert f128.smem_bytes == (128 + 4 * 128) * 128 * 2 + 1024
    assert launch.grid(f128, B=16, H=16, Hkv=16, Sq=1000, Sk=1000) == (8 * 16 * 16, 1, 1)
    assert launch.grid(f128, B=70000, H=8, Hkv=8, Sq=1, Sk=1) == (560000, 1, 1)


def test_warp_specialised_forward_grid_is_persistent():
    """fwd_sm90_ws: one block per SM (at most one per work item); the blocks claim the other items."""
    ws = KernelSpec("fwd_sm90_ws", 128, "bf16", 128, 128, 12, True, "sm_90a")
    assert ws.smem_bytes == (2 * 128 + 4 * 128) * 128 * 2 + 192 + 1024
    assert launch.grid(ws, B=16, H=16, Hkv=16, Sq=1000, Sk=1000, sm_count=132) == (132, 1, 1)
    assert launch.grid(ws, B=1, H=8, Hkv=8, Sq=300, Sk=300, sm_count=132) == (24, 1, 1)


def test_mask_map_grid_holds_slots_key_tiles_per_block():
    """mask_map: 32 warps, four per 128 x 128 tile (eight key tiles per block); four per 64-row tile of
    64 keys too (rounds of 16 rows); two per 16-row tile (rounds of 8 rows: two rounds). A query tile's row
    of key tiles in one block (x == 1) gets its list there (api._classify)."""
    ws = KernelSpec("fwd_sm90_ws", 128, "bf16", 128, 128, 12, False, "sm_90a", mask=MASK_BITS["mod"], mask_mod="k <= q")
    mapper = tiles.classifier_spec(ws, "mask_map")
    assert (mapper.warps, mapper.min_blocks, mapper.layout_problem()) == (32, 1, None)
    assert tiles.map_slots(mapper) == 8
    assert launch.grid(mapper, B=16, H=1, Hkv=0, Sq=1024, Sk=1024) == (1, 8, 16)
    assert launch.grid(mapper, B=2, H=16, Hkv=0, Sq=8192, Sk=1025) == (2, 64, 32)
    assert tiles.map_slots(dataclasses.replace(mapper, block_m=64, block_n=64)) == 8
    assert tiles.map_slots(dataclasses.replace(mapper, block_m=16, block_n=128)) == 16
    assert tiles.classifier_spec(ws, "mask_rows").warps == 8


def test_item_chunk_fits_half_the_l2_in_equal_chunks():
    dev = launch.Device(0, "H100", "sm_90a", 132, SMEM_OPTIN[90], 50 * 2**20)
    # 50 (b, h) pairs' K and V fit half of L2: 256 pairs take 6 chunks, 43 each (the last 41), not 5 x 50 + 6
    assert tiles.item_chunk(dev, B=16, Sk=1024, head_dim=128, H=16, Hkv=16) == 43
    # 4 query heads per KV head: at most 200 pairs (50 KV heads), 2 chunks of 128 (whole groups)
    assert tiles.item_chunk(dev, B=16, Sk=1024, head_dim=128, H=16, Hkv=4) == 128
    # Sk=10240: 5 KV heads fit. 84 pairs in groups of 7: at most 35 a chunk, so 3 chunks of 28
    assert tiles.item_chunk(dev, B=3, Sk=10240, head_dim=128, H=28, Hkv=4) == 28
    # 63 pairs in groups of 7: 2 chunks; 32 rounds up to whole groups, 35 (and 28)
    assert tiles.item_chunk(dev, B=1, Sk=10240, head_dim=128, H=63, Hkv=9) == 35
    assert tiles.item_chunk(dev, B=1, Sk=2**20, head_dim=256, H=8, Hkv=8) == 1
    assert tiles.item_chunk(dev, B=2, Sk=8, head_dim=8, H=4, Hkv=4) == 8  # never more than B * H


def test_ordered_key_chunk_lets_its_key_tiles_run_together_in_equal_chunks():
    dev = launch.Device(0, "H100", "sm_90a", 132, SMEM_OPTIN[90], 50 * 2**20)
    assert tiles.ORDERED_KEY_TILES_TOGETHER == 8  # (what these numbers assume)
    # at most 132 // 8 = 16 pairs a chunk, in chunks as equal as whole numbers allow
    assert [tiles.ordered_key_chunk(dev, pairs, 1) for pairs in (1, 16, 17, 84, 96, 128, 129)] == [1, 16, 9, 14, 16,
                                                                                                   16, 15]
    assert tiles.ordered_key_chunk(dev, 8, 2) == 0  # dK/dV splits: one chunk (a row's splits together)


def test_arch_for():
    assert launch.arch_for(9, 0) == "sm_90a"
    assert launch.arch_for(8, 0) == "sm_80"
    assert launch.arch_for(8, 9) == "sm_89"


_C_TYPES = {"u8*": np.uint64, "const u16*": np.uint64, "u16*": np.uint64, "const float*": np.uint64, "float*": np.uint64,
            "int*": np.uint64, "const int*": np.uint64, "const void*": np.uint64, "const u64*": np.uint64,
            "i64": np.int64, "int": np.int32, "float": np.float32, "TmaMap": params._MAP}


def _header_fields(struct: str) -> list[tuple[str, type]]:
    text = (cache.kernels_dir() / "attention" / "params.cuh").read_text()
    body = re.search(r"struct %s \{(.*?)\};" % struct, text, re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if not line:
            continue
        ctype, names = re.match(r"((?:const )?\w+\*?)\s+(.*)", line).groups()
        fields += [(n.strip(), _C_TYPES[ctype]) for n in names.split(",")]
    return fields


@pytest.mark.parametrize("struct,dtype", [("FwdParams", params.FWD), ("BwdParams", params.BWD),
                                          ("CheckParams", params.CHECK)])
def test_param_structs_match_header(struct, dtype):
    fields = _header_fields(struct)
    assert [n for n, _ in fields] == list(dtype.names)
    assert [np.dtype(t) for _, t in fields] == [dtype.fields[n][0] for n in dtype.names]
    assert f"sizeof(frt::{struct}) == {dtype.itemsize}" in params.static_asserts(dtype)


def test_dkdv_splits_fill_the_gpu_within_bounds():
    dkdv = spec(family="bwd_dkdv", block_m=64, block_n=64, warps=8, head_dim=256)
    # FA grid point: 16 key tiles x 8 heads x 16 batch = 2048 blocks: no split, no partials.
    assert tiles.dkdv_splits(dkdv, B=16, H=8, Hkv=8, Sq=1024, Sk=1024, sm_count=132) == 1
    # The seed's MQA shape: 16 key tiles x 1 KV head x 2 batch = 32 blocks -> 4 per key tile (one wave).
    assert tiles.dkdv_splits(dkdv, B=2, H=8, Hkv=1, Sq=1024, Sk=1024, sm_count=132) == 4
    assert launch.grid(dkdv, B=2, H=8, Hkv=1, Sq=1024, Sk=1024, splits=4) == (16, 4, 2)
    # 100 blocks: a second split would not fit in one wave.
    assert tiles.dkdv_splits(dkdv, B=1, H=8, Hkv=1, Sq=6400, Sk=6400, sm_count=132) == 1
    # No more splits than (query head, query tile) pairs to share.
    assert tiles.dkdv_splits(dkdv, B=1, H=1, Hkv=1, Sq=64, Sk=64, sm_count=132) == 1
    assert tiles.dkdv_splits(dkdv, B=1, H=2, Hkv=1, Sq=128, Sk=64, sm_count=132) == 4
    # fp32 partials stay under DKDV_PARTIAL_LIMIT.
    s = tiles.dkdv_splits(dkdv, B=1, H=64, Hkv=1, Sq=65536, Sk=65536, sm_count=132)
    assert 1 <= s and 8 * s * 65536 * 256 <= tiles.DKDV_PARTIAL_LIMIT


def test_reduce_grid_covers_every_chunk():
    red = KernelSpec("bwd_dkdv_reduce", 128, "bf16", 0, 0, 8, False, "sm_90a")
    assert red.name == "flashrt_bwd_dkdv_reduce_hd128_bf16_w8_sm_90a" and red.smem_bytes == 0
    assert launch.grid(red, B=2, H=8, Hkv=1, Sq=9, Sk=1000, sm_count=132) == (125, 1, 1)  # 2 * 1000 rows * 16 chunks / 256 threads


@pytest.mark.parametrize("dtype", [params.FWD, params.BWD, params.CHECK])
def test_pack_lays_fields_out_as_the_struct(dtype):
    values = {}
    for i, name in enumerate(dtype.names):
        kind = dtype.fields[name][0]
        values[name] = (0.5 + i) if kind == np.float32 else (-(i + 1) if kind != np.uint64 else 2**40 + i)
        if kind == params._MAP:
            values[name] = bytes(range(i, i + 128))
    del values[dtype.names[3]]  # a missing field is 0
    packed = params.pack(dtype, values)
    assert packed.dtype.itemsize == dtype.itemsize and packed.dtype.names is None and packed.size == 1
    fields = packed.view(dtype)[0]
    for name in dtype.names:
        want = values.get(name, bytes(128) if dtype.fields[name][0] == params._MAP else 0)
        assert (fields[name].tobytes() == want) if isinstance(want, bytes) else (fields[name] == want), name


def test_driver_older_than_nvrtc_is_refused_with_the_extra_to_install():
    launch.check_driver(13000, (13, 0))
    launch.check_driver(13010, (12, 9))  # a newer driver runs older cubins
    launch.check_driver(12080, (12, 9))  # minor-version compatibility within a major
    with pytest.raises(launch.LaunchError, match=r"NVRTC 13\.0, whose kernels need a CUDA 13 driver, but this "
                                                 r"driver supports CUDA 12\.4: .*flashrt\[cuda12\]"):
        launch.check_driver(12040, (13, 0))


def test_forward_family_takes_wgmma_where_it_exists_and_fits(monkeypatch):
    # warp-specialised at head_dim 64, 128, 192 and 256: dense, causal, lengths, windows and mask_mod; block /
    # segment ids with mask_mod: fwd_sm90
    for d in (64, 128, 192, 256):
        assert tiles.forward_family(d, "sm_90a", SMEM_OPTIN[90]) == "fwd_sm90_ws"
        for bit in MASK_BITS.values():
            assert tiles.forward_family(d, "sm_90a", SMEM_OPTIN[90], bit) == "fwd_sm90_ws"
        no_mod = sum(MASK_BITS.values()) - MASK_BITS["mod"]
        assert tiles.forward_family(d, "sm_90a", SMEM_OPTIN[90], no_mod) == "fwd_sm90_ws"
        for ids in ("block_ids", "segments"):
            mask = MASK_BITS["lengths"] | MASK_BITS["mod"] | MASK_BITS[ids]
            assert tiles.forward_family(d, "sm_90a", SMEM_OPTIN[90], mask) == "fwd_sm90"
    # one Q slot above head_dim 128 (two do not fit beside the K / V stages), 112-key tiles at 192, 80 at 256 (64 with
    # ids at 256)
    assert tiles.tiling("fwd_sm90_ws", 256, "bf16", True, "sm_90a", SMEM_OPTIN[90]).smem_bytes == \
        (128 + 4 * 80) * 256 * 2 + 192 + 1024
    assert tiles.tiling("fwd_sm90_ws", 192, "bf16", True, "sm_90a", SMEM_OPTIN[90]).smem_bytes == \
        (128 + 4 * 112) * 192 * 2 + 192 + 1024
    segs = tiles.tiling("fwd_sm90_ws", 256, "bf16", True, "sm_90a", SMEM_OPTIN[90], MASK_BITS["segments"])
    assert (segs.block_n, segs.smem_bytes) == (64, (128 + 4 * 64) * 256 * 2 + 192 + 128 * 8 + 16 + 1024)
    # head_dim 64: 192-row tiles (three consumer warpgroups) for long query sequences, without masks beyond lengths
    assert tiles.long_rows("fwd_sm90_ws", 64, 4096) and not tiles.long_rows("fwd_sm90_ws", 64, 4095)
    # (not causal from 1.5k rows: no diagonal loop to lose there)
    assert tiles.long_rows("fwd_sm90_ws", 64, 1536, causal=False)
    assert not tiles.long_rows("fwd_sm90_ws", 64, 1535, causal=False)
    assert not tiles.long_rows("fwd_sm90_ws", 64, 2048, causal=True)
    assert not tiles.long_rows("fwd_sm90_ws", 128, 1 << 20) and not tiles.long_rows("fwd_sm90", 64, 1 << 20)
    tall = tiles.tiling("fwd_sm90_ws", 64, "bf16", True, "sm_90a", SMEM_OPTIN[90], MASK_BITS["lengths"], long=True)
    assert (tall.block_m, tall.block_n, tall.warps, tall.smem_bytes) == (192, 128, 16, (2 * 192 + 4 * 128) * 128 + 1216)
    for mask in (MASK_BITS["window"], MASK_BITS["segments"]):
        assert tiles.tiling("fwd_sm90_ws", 64, "bf16", True, "sm_90a", SMEM_OPTIN[90], mask, long=True).block_m == 128
    with pytest.raises(ValueError, match="block_n 64 or 80 above head_dim 128"):
        KernelSpec("fwd_sm90_ws", 192, "bf16", 128, 128, 12, True, "sm_90a")
    with pytest.raises(ValueError, match="block_n 64 or 80 above head_dim 128"):
        KernelSpec("fwd_sm90_ws", 256, "bf16", 128, 96, 12, True, "sm_90a")
    # the Q slots: two where they fit beside the K / V stages (spec.SM90_SMEM_OPTIN), else one
    assert SM90_SMEM_OPTIN == SMEM_OPTIN[90]
    for D, bn, slots in ((192, 80, 2), (192, 96, 1), (192, 112, 1), (256, 64, 1), (256, 80, 1), (128, 128, 2)):
        ws = KernelSpec("fwd_sm90_ws", D, "bf16", 128, bn, 12, False, "sm_90a")
        assert ws.q_slots == slots and ws.smem_bytes == (slots * 128 + 4 * bn) * D * 2 + 192 + 1024
        assert f"-DFRT_Q_SLOTS={slots}" in ws.options()
    # head_dim 128: 176-key tiles (one Q slot) for non-causal calls without masks beyond lengths, score modifications or
    # dropout (tiles._DENSE_PREFERENCES); the rest keep 128 x 128 with two slots
    def bn128(causal, **kw):
        t = tiles.tiling("fwd_sm90_ws", 128, "bf16", causal, "sm_90a", SMEM_OPTIN[90], **kw)
        return t.block_n, t.q_slots
    assert bn128(False) == bn128(False, mask=MASK_BITS["lengths"]) == (176, 1)
    for causal, kw in ((True, {}), (False, dict(mask=MASK_BITS["window"])), (False, dict(softcap=True)),
                       (False, dict(alibi=True)), (False, dict(dropout=8)), (False, dict(score_mod=("s", "", ())))):
        assert bn128(causal, **kw) == (128, 2), (causal, kw)
    with pytest.raises(ValueError, match="176 at head_dim 128, not causal"):
        KernelSpec("fwd_sm90_ws", 128, "bf16", 128, 176, 12, True, "sm_90a")
    # between the instances: the next one up (tiles.sm90_head_dim), from tiles.PADDED_FROM, forward and backward (the
    # fused wgmma backward's instances end at 128); the mma.sync families have every head_dim
    for d, up in ((tiles.PADDED_FROM, 64), (56, 64), (96, 128), (136, 192), (160, 192), (200, 256), (248, 256)):
        assert tiles.forward_family(d, "sm_90a", SMEM_OPTIN[90]) == "fwd_sm90_ws"
        assert tiles.split_families(d, "sm_90a", SMEM_OPTIN[90]) == ("bwd_dq_sm90", "bwd_dkdv_sm90")
        assert tiles.fused_family(d, "sm_90a", SMEM_OPTIN[90]) == ("bwd_fused_sm90" if up <= 128 else "bwd_fused")
        assert {tiles.sm90_head_dim(f, d) for f in tiles.PADDED_FAMILIES if f != "bwd_fused_sm90" or up <= 128} == {up}
        assert tiles.sm90_head_dim("fwd", d) == tiles.sm90_head_dim("bwd_dkdv", d) == d
    assert tiles.PADDED_FROM > 16 and tiles.forward_family(16, "sm_90a", SMEM_OPTIN[90]) == "fwd"
    assert tiles.forward_family(96, "sm_90a", SMEM_OPTIN[90], MASK_BITS["mod"] | MASK_BITS["segments"]) == "fwd_sm90"
    assert tiles.forward_family(128, "sm_80", SMEM_OPTIN[80]) == "fwd"      # not Hopper
    assert tiles.forward_family(128, "sm_90a", 64 * 1024) == "fwd"          # does not fit
    monkeypatch.setenv("FLASHRT_NO_SM90", "1")
    assert tiles.forward_family(128, "sm_90a", SMEM_OPTIN[90]) == "fwd"


def test_warp_specialised_forward_takes_no_id_arrays_with_mask_mod():
    assert KernelSpec("fwd_sm90_ws", 128, "bf16", 128, 128, 12, True, "sm_90a").layout_problem() is None
    for name, bit in MASK_BITS.items():
        assert tiles.applies("fwd_sm90_ws", 128, "sm_90a", bit), name
    ids = MASK_BITS["block_ids"] | MASK_BITS["segments"]
    plain = KernelSpec("fwd_sm90_ws", 128, "bf16", 128, 128, 12, True, "sm_90a", MASK_BITS["lengths"] | MASK_BITS["window"])
    searched = KernelSpec("fwd_sm90_ws", 128, "bf16", 128, 128, 12, True, "sm_90a", ids)
    assert searched.smem_bytes == plain.smem_bytes + 2 * (128 * 8 + 16)  # each Q slot's key intervals
    for name in ("block_ids", "segments"):
        assert not tiles.applies("fwd_sm90_ws", 128, "sm_90a", MASK_BITS[name] | MASK_BITS["mod"])
        with pytest.raises(ValueError, match="no block / segment ids with mask_mod"):
            KernelSpec("fwd_sm90_ws", 128, "bf16", 128, 128, 12, False, "sm_90a", MASK_BITS[name] | MASK_BITS["mod"], "k <= q")
    with pytest.raises(ValueError, match="12 warps"):
        KernelSpec("fwd_sm90_ws", 128, "bf16", 128, 128, 8, False, "sm_90a")


def test_split_backward_takes_the_wgmma_pair_where_it_exists_and_fits(monkeypatch):
    wgmma, mma = ("bwd_dq_sm90", "bwd_dkdv_sm90"), ("bwd_dq", "bwd_dkdv")
    assert tiles.split_families(128, "sm_90a", SMEM_OPTIN[90]) == wgmma
    assert tiles.split_families(64, "sm_90a", SMEM_OPTIN[90]) == wgmma
    assert tiles.split_families(256, "sm_90a", SMEM_OPTIN[90]) == wgmma
    assert tiles.split_families(192, "sm_90a", SMEM_OPTIN[90], MASK_BITS["window"]) == wgmma
    # every mask at every wgmma head_dim (the seed's block ids at 256 included: tests/test_compile.py checks spills)
    for bit in ("block_ids", "segments"):
        assert tiles.split_families(256, "sm_90a", SMEM_OPTIN[90], MASK_BITS[bit]) == wgmma
    masks = MASK_BITS["lengths"] | MASK_BITS["window"] | MASK_BITS["mod"]
    assert tiles.split_families(256, "sm_90a", SMEM_OPTIN[90], masks) == wgmma
    assert tiles.split_families(16, "sm_90a", SMEM_OPTIN[90]) == mma        # not padded (tiles.PADDED_FROM)
    assert tiles.split_families(128, "sm_80", SMEM_OPTIN[80]) == mma       # not Hopper
    assert tiles.split_families(128, "sm_90a", 100 * 1024) == mma          # does not fit
    # auto takes the split pair when it is the wgmma one, deterministic or not, any mask; with the wgmma fused kernel
    # too, fused from FUSED_WGMMA_MIN_SQ's query length on, ordered only where the mask allows, no ids
    for det in (False, True):
        for ordered_ok in (False, True):
            assert tiles.backward_impl(128, det, ordered_ok, wgmma_split=True) == "split"
    for (d, bm, det, causal), sq in tiles.FUSED_WGMMA_MIN_SQ.items():
        assert tiles.backward_impl(d, det, True, True, True, causal, sq, 0, bm) == "fused"
        if sq:
            assert tiles.backward_impl(d, det, True, True, True, causal, sq - 1, 0, bm) == "split"
    # ordered, not causal, in one split (its query tiles rotated): FUSED_WGMMA_MIN_SQ_ROTATED's entries
    for (d, bm, det, causal), sq in tiles.FUSED_WGMMA_MIN_SQ_ROTATED.items():
        assert det and not causal and sq < tiles.FUSED_WGMMA_MIN_SQ[d, bm, det, causal]
        assert tiles.backward_impl(d, det, True, True, True, causal, sq, 0, bm, rotated=True) == "fused"
        assert tiles.backward_impl(d, det, True, True, True, causal, sq, 0, bm, rotated=False) == "split"
    # rotated: not causal, one split, a row's key tiles on half the SMs (132 SMs: 66)
    dev = launch.Device(0, "H100", "sm_90a", 132, SMEM_OPTIN[90], 50 << 20)
    assert tiles.rotate_ordered_dq(dev, 66, 1, False)
    assert not tiles.rotate_ordered_dq(dev, 67, 1, False)
    assert not tiles.rotate_ordered_dq(dev, 8, 2, False) and not tiles.rotate_ordered_dq(dev, 8, 1, True)
    # with a score modification: FUSED_WGMMA_MIN_SQ_MODIFIED's entries first, the plain table's for the rest
    for (d, bm, det, causal), sq in {**tiles.FUSED_WGMMA_MIN_SQ, **tiles.FUSED_WGMMA_MIN_SQ_MODIFIED}.items():
        assert tiles.backward_impl(d, det, True, True, True, causal, sq, 0, bm, modified=True) == "fused"
        if sq:
            assert tiles.backward_impl(d, det, True, True, True, causal, sq - 1, 0, bm, modified=True) == "split"
    assert tiles.backward_impl(64, True, True, True, True, False, 4096, 0, 64, modified=True) == "fused"
    # ordered and causal only with ORDERED_CAUSAL_MIN_WAVES blocks of key tiles per SM; unordered or not causal, any
    few = tiles.ORDERED_CAUSAL_MIN_WAVES - 0.1
    assert tiles.backward_impl(128, True, True, True, True, True, 1 << 14, 0, 64, key_waves=few) == "split"
    assert tiles.backward_impl(128, True, True, True, True, True, 1 << 14, 0, 64, key_waves=few + 0.1) == "fused"
    assert tiles.backward_impl(128, False, True, True, True, True, 1 << 14, 0, 64, key_waves=0.1) == "fused"
    assert tiles.backward_impl(128, True, True, True, True, False, 1 << 14, 0, 64, key_waves=0.1) == "fused"
    assert tiles.backward_impl(64, True, True, True, True, False, 4096, 0, 64) == "split"
    assert tiles.backward_impl(128, True, False, True, True, False, 1 << 14) == "split"  # dQ adds not orderable
    assert tiles.backward_impl(128, False, False, True, True, False, 1 << 14) == "fused"
    assert tiles.backward_impl(128, False, True, True, True, False, 1 << 14, MASK_BITS["segments"]) == "split"
    assert tiles.backward_impl(128, False, True, True, True, False, 1 << 14, MASK_BITS["window"]) == "fused"
    assert tiles.backward_impl(128, True, True) == "fused"  # the mma.sync rule (H100 measurements)
    monkeypatch.setenv("FLASHRT_NO_SM90", "1")
    assert tiles.split_families(128, "sm_90a", SMEM_OPTIN[90]) == mma


def test_wgmma_backward_geometry():
    dq = KernelSpec("bwd_dq_sm90", 128, "bf16", 128, 64, 8, False, "sm_90a")
    assert dq.smem_bytes == (2 * 128 + 4 * 64) * 128 * 2 + 1024
    dkdv = KernelSpec("bwd_dkdv_sm90", 128, "fp16", 64, 128, 8, True, "sm_90a")
    assert dkdv.smem_bytes == (2 * 128 + 4 * 64) * 128 * 2 + 4 * 64 * 4 + 1024
    # head_dim 64: three stages of (Q, dO, lse2, delta), the pipelined kernel
    dkdv = KernelSpec("bwd_dkdv_sm90", 64, "fp16", 64, 128, 8, True, "sm_90a")
    assert dkdv.smem_bytes == (2 * 128 + 6 * 64) * 64 * 2 + 6 * 64 * 4 + 1024
    # above head_dim 128: 64-key tiles, P^T between the warpgroups (dK/dV); one V buffer at 256 (dQ)
    wide = KernelSpec("bwd_dkdv_sm90", 256, "bf16", 64, 64, 8, False, "sm_90a")
    assert wide.smem_bytes == (2 * 64 + 4 * 64) * 256 * 2 + 4 * 64 * 4 + 128 * 32 * 4 + 1024
    assert KernelSpec("bwd_dq_sm90", 256, "bf16", 128, 64, 8, False, "sm_90a").smem_bytes == \
        (2 * 128 + 3 * 64) * 256 * 2 + 1024
    assert KernelSpec("bwd_dq_sm90", 192, "bf16", 128, 64, 8, False, "sm_90a").smem_bytes == \
        (2 * 128 + 4 * 64) * 192 * 2 + 1024
    for bad in (dict(family="bwd_dkdv_sm90", head_dim=192, block_m=64, block_n=128),
                dict(family="bwd_dkdv_sm90", head_dim=256, block_m=64, block_n=128),
                dict(family="bwd_dq_sm90", head_dim=192, block_m=128, block_n=128),
                dict(family="bwd_dkdv_sm90", head_dim=128, block_m=128, block_n=128),
                dict(family="bwd_dq_sm90", head_dim=96, block_m=128, block_n=64),
                dict(family="bwd_dq_sm90", head_dim=128, block_m=128, block_n=64, arch="sm_90")):
        with pytest.raises(ValueError, match="invalid tiling"):
            KernelSpec(**{"dtype": "bf16", "warps": 8, "causal": False, "arch": "sm_90a", **bad})


def test_shared_tables_reach_the_kernels_from_one_definition():
    """params' tables are the kernels' constants (flashrt_tables.cuh, generated), and no kernel file keeps its own."""
    text = params.tables_header()
    assert ("enum : int { MASK_LENGTHS = 1, MASK_WINDOW = 2, MASK_BLOCK_IDS = 4, MASK_SEGMENTS = 8, "
            "MASK_MOD = 16 };") in text
    assert "enum : int { REPORT_CODE, REPORT_ARG, REPORT_SEQ, REPORT_POS, REPORT_VALUE, REPORT_LIMIT, REPORT_CALL, " \
           "REPORT_WORDS };" in text
    assert "BAD_LENGTH = 1" in text and f"BAD_PAGE_ID = {len(params.CHECK_FAILURES)}" in text
    assert len(params.REPORT_WORDS) <= launch.REPORT_LEN
    sources = cache.kernel_sources()
    assert sources[params.TABLES_HEADER] == text
    for name, source in sources.items():
        if name != params.TABLES_HEADER:
            assert not re.search(r"enum[^{]*\{[^}]*\b(MASK_LENGTHS|REPORT_CODE|BAD_LENGTH)\b", source), name
            assert not re.search(r"FRT_MASK\s*&\s*\d", source), name  # the bits by name (FRT_MASK_*), not by value


def test_grid_axes_are_one_table_for_launch_and_kernels():
    """params.GRID_AXES lays out the tiled kernels' grids: launch.grid sizes each axis from it, and the kernels read
    their coordinates through its constants (flashrt_tables.cuh: GRID_*), never blockIdx / gridDim by axis name."""
    text = params.tables_header()
    for layout, coords in params.GRID_AXES.items():
        for axis, coord in enumerate(coords):
            assert f"GRID_{layout.upper()}_{coord.upper()} = {axis}" in text
    assert params.GRID_AXES["query"][0] == params.GRID_AXES["key"][0] == "tile"  # (the chunked orders: x fastest)
    # a layout's axes moved: launch.grid moves its extents with them
    key = spec(family="bwd_dkdv", block_m=64, block_n=32, warps=8)
    saved = dict(params.GRID_AXES)
    try:
        params.GRID_AXES["key"] = ("tile", "batch", "split_kv_head")
        assert launch.grid(key, B=2, H=8, Hkv=3, Sq=5, Sk=100, splits=2) == (4, 2, 6)
    finally:
        params.GRID_AXES.clear()
        params.GRID_AXES.update(saved)
    assert launch.grid(key, B=2, H=8, Hkv=3, Sq=5, Sk=100, splits=2) == (4, 6, 2)
    # the tiled kernels' decoding reads the axes through grid_index / grid_extent only
    sources = cache.kernel_sources()
    for name in ("attention/params.cuh", "sm80/decode.cu", "helpers/mask_classify.cu"):
        body = sources[name].split("static_assert(GRID_QUERY_TILE")[-1]  # (after the helpers that read them)
        assert not re.search(r"blockIdx\.[yz]|gridDim\.[yz]", body), name


def test_check_report_messages_name_the_argument():
    report = dict(zip(params.REPORT_WORDS, (params.CHECK_FAILURES.index("ids_order") + 1, 5, 1, 10, -1, 0, 0)))
    text = masks.report_message(report)
    assert text.startswith("block_ids_k must be non-decreasing") and "batch 1 at position 10 (-1 after 0)" in text
    assert "earlier flashrt forward call" in text and "validate='sync'" in text
    report.update(code=params.CHECK_FAILURES.index("cu_longest") + 1, arg=2, seq=3, value=70, limit=64, call=3)
    assert masks.report_message(report).startswith("max_seqlen_q=64 is below the length of sequence 3 in "
                                                   "cu_seqlens_q (70)")
    assert "earlier flashrt backward call" in masks.report_message(report)


def test_gpus_before_ampere_are_refused_with_a_reason():
    assert launch.arch_for(9, 0) == "sm_90a" and launch.arch_for(8, 6) == "sm_86" and launch.arch_for(12, 0) == "sm_120"
    with pytest.raises(launch.LaunchError, match=r"needs a GPU of compute capability 8\.0 or newer .*Tesla T4 is 7\.5"):
        launch.arch_for(7, 5, "Tesla T4")


def test_decode_tiles_follow_the_packed_rows():
    """tiles.decode_spec: the fewest 16-row multiples (up to 64) that hold the query heads per KV head x new tokens;
    64-key tiles, 32 at 32 / 64 rows above head_dim 128, 16 at 64 rows above 240; every choice a valid layout within
    the shared memory."""
    for rows, bm in ((1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (512, 64)):
        for d in (8, 64, 72, 128, 200, 256):
            for arch, limit in (("sm_80", SMEM_OPTIN[80]), ("sm_90a", SMEM_OPTIN[90]), ("sm_86", SMEM_OPTIN[86])):
                s = tiles.decode_spec(d, "bf16", rows, arch, limit)
                assert s.block_m == bm and s.smem_bytes <= limit, s.name
                if limit > 200 * 1024:  # (smaller tiles over fewer warps where these do not fit)
                    bn = 64 if d <= 128 or bm < 32 else 16 if bm == 64 and d > 240 else 32
                    assert s.block_n == bn and s.warps == tiles.DECODE_WARPS, s.name
                assert not s.causal and not s.mask and s.layout_problem() is None
    with pytest.raises(ValueError, match="mask at run time"):
        KernelSpec("decode", 128, "bf16", 16, 64, 4, True, "sm_90a")
    with pytest.raises(ValueError, match="warps must tile"):
        KernelSpec("decode", 128, "bf16", 16, 32, 4, False, "sm_90a")  # 8 keys per warp


def test_decode_splits_merge_in_a_cluster_where_measured_faster():
    """sm_90a: 2-8 splits merge in a thread block cluster (decode.cu: cluster_combine), except where an SM holds one
    block and the grid is large (head_dim 256: 0.66-0.76x); the model's 9-16 splits over few keys become 8."""
    s = tiles.decode_spec(128, "bf16", 4, "sm_90a", SMEM_OPTIN[90])
    def cluster(spec, B, Hkv, rows, splits, capacity=1024):
        return tiles.decode_cluster(spec, B, Hkv, rows, capacity, splits, 132, SMEM_OPTIN[90])
    assert cluster(s, 16, 1, 8, 8) and cluster(s, 1, 8, 4, 2) and not cluster(s, 1, 8, 4, 1)
    assert not cluster(s, 1, 8, 4, 9)  # (the portable cluster size: 8)
    assert cluster(s, 4, 8, 4, 4, 2048) and not cluster(s, 4, 8, 4, 4, 2049)  # splits of at most 8 key tiles
    s80 = tiles.decode_spec(128, "bf16", 4, "sm_80", SMEM_OPTIN[80])
    assert not cluster(s80, 16, 1, 8, 8)
    s256 = tiles.decode_spec(256, "bf16", 8, "sm_90a", SMEM_OPTIN[90])  # one block an SM
    assert not cluster(s256, 16, 1, 8, 8) and not cluster(s256, 32, 1, 8, 4)  # 128 blocks of one SM each
    assert cluster(s256, 64, 1, 8, 2) and cluster(s256, 1, 8, 4, 8)  # two splits; 64 blocks
    assert tiles.decode_splits(s, 1, 8, 4, 2048, 132, SMEM_OPTIN[90]) == 8  # the model's 16 over 32 key tiles
    assert tiles.decode_splits(s, 1, 8, 4, 4096, 132, SMEM_OPTIN[90]) == 16  # ... not over 64
    assert tiles.decode_splits(s80, 1, 8, 4, 2048, 108, SMEM_OPTIN[80]) > 8  # no cluster before sm_90
    try:
        tiles.DECODE_CLUSTER_SPLITS = 0
        assert not cluster(s, 16, 1, 8, 8) and tiles.decode_splits(s, 1, 8, 4, 2048, 132, SMEM_OPTIN[90]) == 16
    finally:
        tiles.DECODE_CLUSTER_SPLITS = 8


def test_programmatic_families_from_sm_90():
    """The fused wgmma backward (after bwd_preprocess) and decode's combine start under the kernel before them on
    sm_90+ (programmatic dependents); not the kernels ahead of them, nor anything before sm_90."""
    fused = KernelSpec("bwd_fused_sm90", 128, "bf16", 64, 128, 12, False, "sm_90a")
    assert fused.programmatic and not dataclasses.replace(fused, family="bwd_dkdv_sm90", warps=8).programmatic
    assert not KernelSpec("bwd_preprocess", 128, "bf16", 0, 0, 8, False, "sm_90a").programmatic
    decode = tiles.decode_spec(128, "bf16", 4, "sm_90a", SMEM_OPTIN[90])
    assert not decode.programmatic  # (decode.cu itself: its combine is the dependent)
    combine = dataclasses.replace(decode, family="decode_combine", head_dim=256)
    assert combine.programmatic and not dataclasses.replace(combine, arch="sm_80").programmatic


def test_a_programmatic_launch_follows_the_kernel_it_must():
    """launch.Sequence refuses a fused wgmma backward launched after anything but bwd_preprocess (it reads K and V
    before it waits for the kernel ahead of it: spec.PROGRAMMATIC)."""
    fused = KernelSpec("bwd_fused_sm90", 128, "bf16", 64, 128, 12, False, "sm_90a")
    pre = KernelSpec("bwd_preprocess", 128, "bf16", 0, 0, 8, False, "sm_90a")
    convert = dataclasses.replace(pre, family="bwd_dq_convert")
    launch.Sequence(None, [(pre, (1, 1, 1), 0), (fused, (1, 1, 1), 1), (convert, (1, 1, 1), 2)], [b"", b"", b""])
    for launches in ([(fused, (1, 1, 1), 0)], [(convert, (1, 1, 1), 0), (fused, (1, 1, 1), 1)]):
        with pytest.raises(launch.LaunchError, match="must follow bwd_preprocess"):
            launch.Sequence(None, launches, [b""] * len(launches))


def test_cluster_launches_carry_their_attribute():
    """launch._launch_config: the cluster dimension (and the programmatic attribute) as cuLaunchKernelEx reads them;
    a cluster over 8 or not dividing the grid's x is refused."""
    s = tiles.decode_spec(128, "bf16", 4, "sm_90a", SMEM_OPTIN[90])
    assert launch._launch_config(s, (8, 2, 3), False, 1) is None
    c = launch._launch_config(s, (8, 2, 3), True, 4)
    assert c.n_attrs == 2 and [c.attrs[i].id for i in range(2)] == [6, 4] and list(c.attrs[1].value[:3]) == [4, 1, 1]
    assert list(c.grid) == [8, 2, 3] and c.smem == s.smem_bytes and list(c.block) == [s.threads, 1, 1]
    for bad in ((6, 4), (16, 16)):
        with pytest.raises(launch.LaunchError, match="cluster"):
            launch._launch_config(s, (bad[0], 1, 1), False, bad[1])


def test_decode_splits_take_the_fastest_count_measured():
    s = tiles.decode_spec(128, "bf16", 4, "sm_90a", SMEM_OPTIN[90])
    assert tiles.decode_splits(s, 16, 8, 4, 8192, 132, SMEM_OPTIN[90], requested=7) == 7
    assert tiles.decode_splits(s, 16, 8, 4, 100, 132, SMEM_OPTIN[90], requested=50) == 2  # at most a split per tile
    for B, Hkv, cap in ((1, 8, 32768), (16, 8, 8192), (64, 8, 4096), (128, 1, 1024), (1, 1, 131072), (3, 2, 777)):
        n = tiles.decode_splits(s, B, Hkv, 4, cap, 132, SMEM_OPTIN[90])
        assert 1 <= n <= min(tiles.DECODE_MAX_SPLITS, -(-cap // s.block_n))
    # the fastest power of two of scripts/probes/decode_splits_sweep.py (H200; 32 / 8 query / KV heads, Sq = 1):
    # (B, Hkv, capacity) -> splits (one 16-row tile of query heads per KV head: 32 / 8 and 8 / 1), head_dim 128 ...
    for (B, Hkv, cap), want in {(1, 8, 1024): 8, (1, 8, 4096): 16, (1, 8, 32768): 16, (4, 8, 1024): 4,
                                (16, 8, 1024): 1, (16, 8, 8192): 1, (2, 8, 16384): 8, (8, 8, 4096): 2,
                                (64, 8, 4096): 1, (1, 1, 4096): 32, (1, 1, 131072): 128}.items():
        assert tiles.decode_splits(s, B, Hkv, 4, cap, 132, SMEM_OPTIN[90]) == want, (B, Hkv, cap)
    # ... and 64, whose smaller blocks stream less at once: two per SM at 16 x 8k
    s64 = tiles.decode_spec(64, "bf16", 4, "sm_90a", SMEM_OPTIN[90])
    assert tiles.decode_splits(s64, 16, 8, 4, 8192, 132, SMEM_OPTIN[90]) == 2
    assert tiles.decode_splits(s64, 1, 8, 4, 1024, 132, SMEM_OPTIN[90]) == 8  # (16 by the model: 8 in a cluster)
    assert tiles.decode_splits(s, 256, 8, 4, 4096, 132, SMEM_OPTIN[90]) == 1  # many blocks already
    # every SM busy at one split: the last wave's fill (24 x 8k: 4 splits 202.9 us, 2 225.4; 48 x 4k: 2 201.0, 1 220.9)
    assert tiles.decode_splits(s, 24, 8, 4, 8192, 132, SMEM_OPTIN[90]) == 4
    assert tiles.decode_splits(s, 48, 8, 4, 4096, 132, SMEM_OPTIN[90]) == 2
    # one split for short sequences where one gives nearly every SM a block (head_dim 64, 1k-2k keys, 128-256 blocks:
    # 1.02-1.20x two splits' speed), not for longer ones or fewer blocks
    s8 = tiles.decode_spec(64, "bf16", 8, "sm_90a", SMEM_OPTIN[90])
    for B, Hkv, cap in ((128, 1, 1024), (64, 2, 1024), (128, 2, 2048), (16, 8, 1024)):
        assert tiles.decode_splits(s8, B, Hkv, 8, cap, 132, SMEM_OPTIN[90]) == 1, (B, Hkv, cap)
    assert tiles.decode_splits(s8, 128, 1, 8, 2049, 132, SMEM_OPTIN[90]) > 1  # (past 2k keys)
    assert tiles.decode_splits(s8, 118, 1, 8, 1024, 132, SMEM_OPTIN[90]) > 1  # (under 0.9 x the SMs)
    assert tiles.decode_splits(s8, 64, 1, 8, 1024, 132, SMEM_OPTIN[90]) == 4
    # ... only where measured: sm_90a at head_dim 64 (head_dim 32 on sm_90a, 64 on sm_80 keep the models' picks)
    s32 = tiles.decode_spec(32, "bf16", 8, "sm_90a", SMEM_OPTIN[90])
    assert tiles.decode_splits(s32, 128, 1, 8, 1024, 132, SMEM_OPTIN[90]) > 1
    s80 = tiles.decode_spec(64, "bf16", 8, "sm_80", SMEM_OPTIN[80])
    assert tiles.decode_splits(s80, 128, 1, 8, 1024, 108, SMEM_OPTIN[80]) > 1


def test_combine_row_warps():
    assert tiles.combine_row_warps(128, 8, 132, 8) == 8     # one sequence's splits: a block per row
    assert tiles.combine_row_warps(2, 4096, 132, 8) == 1    # two parts: a warp per row
    assert tiles.combine_row_warps(16, 128, 132, 8) == 4
    assert tiles.combine_row_warps(64, 100000, 132, 8) == 1  # rows enough for every warp


def test_combine_takes_a_thread_per_8_columns_for_few_parts_over_many_rows():
    assert tiles.combine_rows(2, 16384 * 16, 132)          # context parallelism's merge: two parts, 262k rows
    assert tiles.combine_rows(2, 64, 132)                  # few parts
    assert tiles.combine_rows(32, 1056, 132)
    assert not tiles.combine_rows(8, 64, 132)              # many parts over few rows: warps share a row's
    assert not tiles.combine_rows(64, 16384 * 16, 132)     # more parts than measured


def test_decode_params_carry_one_stride_set_for_both_caches():
    names = params.DECODE.names
    assert "kc_sb" in names and "vc_sb" not in names and "kn_sb" in names and "vn_sb" not in names
    assert {"seqlen", "page_shift", "splits"} <= set(names)


def test_combines_are_one_variant_per_dtype():
    """combine.cu takes head_dim at run time: every head_dim maps to one variant (compiled at 256), named without it."""
    names = {tiles.tiling("decode_combine", d, "bf16", False, "sm_90a", SMEM_OPTIN[90]).name for d in HEAD_DIMS}
    assert names == {"flashrt_decode_combine_bf16_w8_sm_90a"}
    with pytest.raises(ValueError, match="run time"):
        KernelSpec("combine", 128, "bf16", 0, 0, 8, False, "sm_90a")


CAP = ("30.f * tanhf(s / 30.f)", "", ())
REL = ("s + bias[h * 8191 + k - q + 4095] * on[b]", "", (("bias", "float"), ("on", "int")))


def test_score_mod_is_compiled_in_and_named_by_what_each_kernel_compiles():
    """A score_mod variant's name holds a hash of the expression and its tensors' types, and of its derivative in
    the families that compile it (spec.SCORE_GRAD_FAMILIES): one forward kernel serves every derivative."""
    from flashrt.spec import KEY_PARALLEL, QUERY_PARALLEL, SCORE_GRAD_FAMILIES, SCORE_MOD_FAMILIES
    assert set(SCORE_MOD_FAMILIES) == set(QUERY_PARALLEL + KEY_PARALLEL)
    assert set(SCORE_GRAD_FAMILIES) == set(SCORE_MOD_FAMILIES) - {"fwd", "fwd_sm90", "fwd_sm90_ws"}
    named = re.compile(r"flashrt_fwd_hd128_bf16_causal_smod[0-9a-f]{12}_m128n64w8_sm_90a")
    assert named.fullmatch(spec(score_mod=CAP).name), spec(score_mod=CAP).name
    assert "-DFRT_SCORE_MOD=1" in spec(score_mod=CAP).options() and "FRT_SCORE_MOD" not in " ".join(spec().options())
    explicit = ("30.f * tanhf(s / 30.f)", "1.f - tanhf(s / 30.f) * tanhf(s / 30.f)", ())
    as_int = (REL[0], "", (("bias", "float"), ("on", "float")))
    for family in SCORE_MOD_FAMILIES:
        arch = "sm_90a" if "sm90" in family else "sm_80"
        d = 64 if tiles.applies(family, 64, arch, score_mod=CAP) else 128

        def make(score):
            return tiles.tiling(family, d, "bf16", True, arch, SMEM_OPTIN[int(arch[3:5])], score_mod=score)
        names = {make(s).name for s in (CAP, explicit, REL, as_int)}
        assert len(names) == (4 if family in SCORE_GRAD_FAMILIES else 3), (family, names)
        assert make(CAP).score_mod == CAP and "_smod" in make(CAP).name
    # the helpers and the decode kernels take none: ignored by tiling, refused by KernelSpec
    for family in ("bwd_preprocess", "bwd_dq_convert", "bwd_dkdv_reduce", "decode_combine"):
        assert tiles.tiling(family, 128, "bf16", True, "sm_80", SMEM_OPTIN[80], score_mod=CAP).score_mod == ()
    with pytest.raises(ValueError, match="decode has no score_mod variant"):
        KernelSpec("decode", 128, "bf16", 16, 64, 4, False, "sm_90a", score_mod=CAP)
    for kw in (dict(softcap=True), dict(alibi=True)):
        with pytest.raises(ValueError, match="score_mod with softcap or alibi: write them into the expression"):
            spec(score_mod=CAP, **kw)
    # a mask_mod's classifiers never compile the score_mod (one map serves every score_mod)
    fwd = tiles.tiling("fwd", 64, "bf16", True, "sm_80", SMEM_OPTIN[80], MASK_BITS["mod"], "k <= q", score_mod=CAP)
    assert fwd.score_mod == CAP
    assert all(tiles.classifier_spec(fwd, f).score_mod == () for f in ("mask_map", "mask_rows"))


@pytest.mark.parametrize("bad", [("", "", ()), ("s", None, ()), ("s", "", ("bias",)), ("s", "", (("bias", "double"),)),
                                 ("s", "", tuple((f"t{i}x", "int") for i in range(5)))])
def test_malformed_score_mod_fields_are_rejected(bad):
    with pytest.raises(ValueError, match="score_mod must be"):
        spec(score_mod=bad)


def test_score_mod_source_defines_what_each_kernel_calls():
    """score_mod_source: the expression between #line markers (NVRTC's messages name the user's text), its tensors as
    typed pointers, in the expression's namespace (dual.cuh: flashrt_expr), and in the backward's kernels its
    derivative: the user's, or the expression over dual numbers."""
    from flashrt.spec import score_mod_source
    fwd = score_mod_source(*REL, False)
    value = fwd[fwd.index("FRT_DEVICE float flashrt_score_mod("):fwd.index("\n}\n") + 3]  # its definition
    assert value.startswith("FRT_DEVICE float flashrt_score_mod(float s, int b, int h, int q, int k, int Lq, int Lk, "
                            "float qf, float kf, const void* t0")
    assert "const float* const bias = static_cast<const float*>(t0);" in value
    assert "const int* const on = static_cast<const int*>(t1);" in value
    assert f'#line 1 "score_mod"\n{REL[0]}\n#line 1 "flashrt_score_mod_end"\n' in value
    assert fwd == "namespace flashrt_expr {\n" + value + "}\n"
    auto = score_mod_source(*REL, True)
    assert auto.startswith("namespace flashrt_expr {\n" + value) and auto.endswith("}\n}\n")
    assert "const flashrt_dual::Dual s(flashrt_s, 1.f);" in auto
    assert f'#line 1 "score_mod (its automatic derivative)"\n{REL[0]}\n' in auto
    assert "*flashrt_value = flashrt_r.v;" in auto and "return flashrt_r.d;" in auto
    given = score_mod_source(REL[0], "1.f", REL[2], True)
    assert given.startswith("namespace flashrt_expr {\n" + value) and given.endswith("}\n}\n")
    assert '#line 1 "score_mod_grad"\n1.f\n' in given and "Dual" not in given
    assert "*flashrt_value = flashrt_score_mod(s, b, h, q, k, Lq, Lk, qf, kf, t0, t1, t2, t3);" in given
    # each kernel's translation unit: the forward without a derivative, the backward's with one
    for family, with_grad in (("fwd", False), ("bwd_dq", True), ("bwd_dkdv", True)):
        unit = tiles.tiling(family, 64, "bf16", False, "sm_80", SMEM_OPTIN[80], score_mod=REL).translation_unit()
        assert unit.endswith(score_mod_source(*REL, with_grad))


def test_score_tensor_gradient_variant():
    """A "float_grad" tensor makes bwd_dq the tensor-gradient pass (its own name, FRT_SCORE_TGRAD, the generated
    flashrt_score_mod_tgrad that seeds each read); every other family reads the tensor as "float"."""
    learned = ("s + bias[h * 7 + k - q + 3]", "", (("bias", "float_grad"), ("ids", "int")))
    plain = (learned[0], "", (("bias", "float"), ("ids", "int")))
    grads = tiles.tiling("bwd_dq", 64, "bf16", True, "sm_90a", SMEM_OPTIN[90], score_mod=learned)
    dq = tiles.tiling("bwd_dq", 64, "bf16", True, "sm_90a", SMEM_OPTIN[90], score_mod=plain)
    assert grads.score_grads and not dq.score_grads and grads.name != dq.name
    assert "-DFRT_SCORE_TGRAD=1" in grads.options() and "-DFRT_SCORE_TGRAD=1" not in " ".join(dq.options())
    tu = grads.translation_unit()
    assert "flashrt_score_mod_tgrad" in tu and "flashrt_dual::Seeded bias{static_cast<const float*>(t0), flashrt_g0, flashrt_n0," in tu
    assert "const int* const ids = static_cast<const int*>(t1);" in tu
    assert "flashrt_score_mod_tgrad" not in dq.translation_unit()
    for family in ("bwd_dkdv", "fwd", "bwd_fused"):
        a = tiles.tiling(family, 64, "bf16", True, "sm_80", SMEM_OPTIN[80], score_mod=learned)
        b = tiles.tiling(family, 64, "bf16", True, "sm_80", SMEM_OPTIN[80], score_mod=plain)
        assert a == b and a.name == b.name and not a.score_grads, family


def test_a_v_head_dim_of_its_own_is_compiled_into_the_mma_sync_kernels():
    """spec.V_DIM_FAMILIES take q's / k's and v's head_dims at compile time (kernels_cu/attention/params.cuh:
    FRT_QK_DIM, FRT_V_DIM) where they differ, the larger being head_dim; the name says so, the cache round-trips it."""
    from flashrt import cache
    base = tiles.tiling("fwd", 192, "bf16", True, "sm_80", SMEM_OPTIN[80])
    spec = dataclasses.replace(base, head_dims=(192, 128))
    assert spec.name == base.name.replace("_causal_", "_causal_qk192v128_")
    assert {"-DFRT_QK_DIM=192", "-DFRT_V_DIM=128"} <= set(spec.options())
    assert not any("FRT_QK_DIM" in o for o in base.options())
    assert cache.spec_from_fields(json.loads(json.dumps(cache.spec_fields(spec)))) == spec
    for bad in ((128, 128), (64, 128), (192,), (192, 100)):
        with pytest.raises(ValueError, match="head_dims"):
            dataclasses.replace(base, head_dims=bad)
    wgmma = tiles.tiling("fwd_sm90", 192, "bf16", True, "sm_90a", SMEM_OPTIN[90])
    with pytest.raises(ValueError, match="head_dims"):  # the wgmma kernels take them at run time
        dataclasses.replace(wgmma, head_dims=(192, 128))


def test_prewarm_matrix_holds_the_kernels_of_padded_head_dims():
    """`flashrt prewarm --head-dims 72` on Hopper: the wgmma kernels at the instance (128) and the backward's helper
    kernels there too (api._backward_plan: the main kernel's head_dim), beside the mma.sync ones at 72."""
    from flashrt import cli
    names = {s.name for s in cli.matrix("sm_90a", SMEM_OPTIN[90], [72], ["bf16"])}
    for family in ("bwd_preprocess", "bwd_dq_convert", "bwd_dkdv_reduce"):
        assert {f"flashrt_{family}_hd128_bf16_w8_sm_90a", f"flashrt_{family}_hd72_bf16_w8_sm_90a"} <= names
    assert any(n.startswith("flashrt_fwd_sm90_ws_hd128_") for n in names)
    assert any(n.startswith("flashrt_bwd_fused_sm90_hd128_") for n in names)
    assert not any("_hd128_" in n for n in (s.name for s in cli.matrix("sm_80", SMEM_OPTIN[80], [72], ["bf16"])))
    spec = dataclasses.replace(tiles.tiling("fwd", 192, "bf16", True, "sm_80", SMEM_OPTIN[80]), head_dims=(192, 128))
    assert "only a manifest prewarms it" in cache.miss_message(spec)


def test_padded_forward_covers_only_its_own_columns():
    """fwd_sm90_ws at a head_dim its instance pads: S = Q K^T over q's head_dim rounded up to 16 (tiles.qk_width) and
    O = P V over the narrowest of V_WIDTHS that holds v's (tiles.v_width): variants of their own (name, defines),
    refused elsewhere or out of range; the prewarm matrix holds what api._kernel_for picks, the classification kernels
    drop them, and a cache miss names the prewarm that makes them."""
    from flashrt import cli
    from flashrt.spec import V_WIDTHS
    assert [tiles.qk_width("fwd_sm90_ws", 128, d) for d in (72, 80, 96, 120, 128)] == [80, 80, 96, 0, 0]
    assert [tiles.v_width("fwd_sm90_ws", 128, d) for d in (40, 72, 96, 112, 128)] == [64, 96, 96, 0, 0]
    assert tiles.v_width("fwd_sm90_ws", 256, 200) == 224 and tiles.v_width("fwd_sm90_ws", 192, 128) == 128
    assert tiles.qk_width("fwd_sm90", 128, 96) == tiles.v_width("bwd_dq_sm90", 128, 96) == 0  # (fwd_sm90_ws only)
    assert all(w % 32 == 0 for w in V_WIDTHS)  # (acc_to_global: whole quads of 8-column groups)
    base = tiles.tiling("fwd_sm90_ws", 128, "bf16", True, "sm_90a", SMEM_OPTIN[90])
    spec = dataclasses.replace(base, qk_width=80, v_width=96)
    assert "_s80_o96_" in spec.name and spec.name != base.name
    assert {"-DFRT_QK_WIDTH=80", "-DFRT_V_WIDTH=96"} <= set(spec.options())
    assert not any("WIDTH" in o for o in base.options())
    for bad in ({"qk_width": 72}, {"qk_width": 128}, {"v_width": 80}, {"v_width": 128}):
        with pytest.raises(ValueError, match="width"):
            dataclasses.replace(base, **bad)
    with pytest.raises(ValueError, match="fwd_sm90_ws's"):
        dataclasses.replace(tiles.tiling("fwd_sm90", 128, "bf16", True, "sm_90a", SMEM_OPTIN[90]), qk_width=96)
    rows = tiles.classifier_spec(spec, "mask_rows")
    assert rows.qk_width == rows.v_width == 0
    names = {s.name for s in cli.matrix("sm_90a", SMEM_OPTIN[90], [72, 128], ["bf16"])}
    assert any(n.startswith("flashrt_fwd_sm90_ws_hd128_bf16_full_s80_o96_") for n in names)
    assert any(n.startswith("flashrt_fwd_sm90_ws_hd128_bf16_full_m") for n in names)  # (128 itself: all columns)
    assert "--head-dims 80 " in cache.miss_message(spec)  # (72 and 80 make it: v_width 96 from either)
    assert "only a manifest" in cache.miss_message(dataclasses.replace(base, qk_width=96, v_width=64))  # (v's own)
