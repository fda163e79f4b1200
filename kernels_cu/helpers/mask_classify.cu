// Tile lists for a mask_mod expression (MASK_MOD; ModLists in mask.cuh).
//
// mask_map (FRT_CLASSIFY=0): SPLIT warps per (query tile, key tile) of the consuming kernel's BM x BN
// tiling, each a share of its rows, evaluate the pairs with the predicate the attention kernels apply
// (Visibility::visible, built-in masks included) and the block writes one byte per tile: 0 no pair
// visible, 1 some, 2 all (FlexAttention's block mask). A warp stops at the first round that shows
// "some". Grid (ceil(key tiles / SLOTS), query tiles, mod_batches * mod_heads): a block has SLOTS of
// one query tile's key tiles. When that is the whole row and the launcher asks for it (p.mod_rows
// set), the block also writes the row's list (the forward's only list: no second launch).
//
// mask_rows (FRT_CLASSIFY=1) / mask_cols (2): a warp per query (key) tile turns its row
// (column) of the map into the list of tiles to visit, last to first: entry j when every
// pair of the two tiles is visible, ~j when the element mask must run. Grid
// (ceil(lists / NW)). These read only the map, so they carry no expression and one
// compiled pair serves every mask_mod.
#include "attention/params.cuh"

#ifndef FRT_CLASSIFY
#define FRT_CLASSIFY 0
#endif

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct ClassifyTraits {
    static constexpr int BM = BM_, BN = BN_, NW = NW_, NTHREADS = NW * 32;
    static constexpr bool CAUSAL = CAUSAL_;
    static constexpr int PASS = FRT_CLASSIFY, MASK = FRT_MASK;
    static constexpr int SMEM = 0;
    static_assert(PASS != 0 || (MASK & MASK_MOD), "the map is only for mask_mod variants");
    static_assert(BM % 16 == 0 && BN % 16 == 0, "block sizes must be multiples of 16");
};

enum : unsigned char { TILE_EMPTY = 0, TILE_PARTIAL = 1, TILE_FULL = 2 };

// The list of an outer tile (mask.cuh: ModLists) from the classes of its inner tiles j < inner_tiles
// (class_of(j)), last to first; by one warp.
template <class ClassOf>
FRT_DEVICE void write_list(int* list, int* count, int inner_tiles, ClassOf class_of, int lane) {
    int listed = 0;
    for (int top = inner_tiles - 1; top >= 0; top -= 32) {
        const int j = top - lane;
        const int c = j < 0 ? TILE_EMPTY : class_of(j);
        const u32 listed_here = __ballot_sync(~0u, c != TILE_EMPTY);
        if (c != TILE_EMPTY) list[listed + __popc(listed_here & ((1u << lane) - 1))] = c == TILE_FULL ? j : ~j;
        listed += __popc(listed_here);
    }
    if (lane == 0) *count = listed;
}

template <class T>
FRT_DEVICE void mask_map(const FwdParams& p) {
    constexpr int BM = T::BM, BN = T::BN;
    // A lane owns columns lane, lane + 32, ... of the tile and walks its warp's rows, R rows between
    // votes: the expression's key-side reads stay the same from row to row (the compiler can keep
    // them), the query-side ones are the same across the warp, and a round's 32 pairs per lane are in
    // flight together (voting after every pair made each pair wait for the previous vote). SPLIT warps
    // share a tile's rounds (one warp per tile: 8 warps per SM at S=1k, latency-bound:
    // docs/perf-notes.md: mask_mod tile map and lists). SPLIT comes from the host (spec.KernelSpec.map_split), which
    // also launches ceil(key tiles / SLOTS) blocks per row of the grid (tiles.map_slots).
    constexpr int COLS = (BN + 31) / 32, R = COLS >= 32 ? 1 : 32 / COLS;
    constexpr int SPLIT = FRT_MAP_SPLIT, SLOTS = T::NW / SPLIT, ROWS = BM / SPLIT;
    static_assert(BM % (R * SPLIT) == 0 && T::NW % SPLIT == 0, "whole rounds, whole tiles per block");
    __shared__ int seen[SLOTS];  // per key tile of the block: 1 a visible pair, 2 a hidden one
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, slot = warp / SPLIT, part = warp % SPLIT;
    const int z = grid_index<GRID_MASK_MAP_BATCH_HEAD>(), h = z % p.mod_heads, b = z / p.mod_heads;
    const int m = grid_index<GRID_MASK_MAP_QUERY_TILE>();
    const int m_tiles = ceil_div(p.Sq, BM), n_tiles = ceil_div(p.Sk, BN);
    const int n_begin = grid_index<GRID_MASK_MAP_SLOT_BLOCK>() * SLOTS, count = min(SLOTS, n_tiles - n_begin);
    if (tid < SLOTS) seen[tid] = 0;
    // One list stands for every head (batch entry) when mod_heads (mod_batches) is 1: the mask does
    // not depend on it, so head 0 (batch entry 0) is as good as any. (A copy in registers: its fields
    // are the expression's inputs. block_visibility's __syncthreads orders the zeroing above.)
    const Visibility<T::CAUSAL, T::MASK> vis = block_visibility<T::CAUSAL, T::MASK>(p, b);
    const int r_begin = m * BM + part * ROWS;
    const int n0 = (n_begin + slot) * BN;
    if (slot < count && m * BM < vis.Lq && n0 < vis.Lk) {  // else no pair exists
        bool any = false, all = true;
        for (int r0 = r_begin; r0 < r_begin + ROWS; r0 += R) {
#pragma unroll
            for (int r = r0; r < r0 + R; ++r)
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    const int col = lane + 32 * c;
                    if (BN % 32 == 0 || col < BN) {
                        const bool v = vis.visible(r, n0 + col, h);
                        any |= v, all &= v;
                    }
                }
            if (__any_sync(~0u, any) && !__all_sync(~0u, all)) break;  // partial: nothing more to learn
        }
        any = __any_sync(~0u, any), all = __all_sync(~0u, all);
        if (lane == 0) atomicOr(&seen[slot], (any ? 1 : 0) | (all ? 0 : 2));
    }
    __syncthreads();
    auto tile_class = [&](int i) { return seen[i] == 1 ? TILE_FULL : seen[i] == 3 ? TILE_PARTIAL : TILE_EMPTY; };
    const i64 row = (i64)z * m_tiles + m;  // the ModLists index of this query tile's list
    if (tid < count) p.mod_map[row * n_tiles + n_begin + tid] = tile_class(tid);
    if (p.mod_rows && grid_extent<GRID_MASK_MAP_SLOT_BLOCK>() == 1 && warp == 0)
        write_list(p.mod_rows + row * n_tiles, p.mod_rows_count + row, n_tiles, tile_class, lane);
}

// The list of one query tile's key tiles (ROWS) or one key tile's query tiles, from the map.
template <class T, bool ROWS>
FRT_DEVICE void mask_list(const FwdParams& p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m_tiles = ceil_div(p.Sq, T::BM), n_tiles = ceil_div(p.Sk, T::BN);
    const int outer_tiles = ROWS ? m_tiles : n_tiles, inner_tiles = ROWS ? n_tiles : m_tiles;
    const i64 at = (i64)blockIdx.x * T::NW + warp;  // (z, outer tile): the ModLists index
    if (at >= (i64)p.mod_batches * p.mod_heads * outer_tiles) return;
    const i64 z = at / outer_tiles;
    const int outer = (int)(at % outer_tiles);
    const u8* map = p.mod_map + z * m_tiles * n_tiles;
    write_list((ROWS ? p.mod_rows : p.mod_cols) + at * inner_tiles, (ROWS ? p.mod_rows_count : p.mod_cols_count) + at,
               inner_tiles, [&](int j) { return ROWS ? map[(i64)outer * n_tiles + j] : map[(i64)j * n_tiles + outer]; },
               lane);
}

template <class T>
__device__ void mask_classify(const FwdParams& p) {
    if constexpr (T::PASS == 0)
        mask_map<T>(p);
    else
        mask_list<T, T::PASS == 1>(p);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(ClassifyTraits, mask_classify, FwdParams)
#endif
