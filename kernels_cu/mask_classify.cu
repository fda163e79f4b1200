// Tile lists for a mask_mod expression (MASK_MOD; ModLists in mask.cuh), in two passes.
//
// mask_map (FRT_CLASSIFY=0): a warp per (query tile, key tile) of the consuming kernel's BM x BN
// tiling evaluates the pairs with the predicate the attention kernels apply
// (Visibility::visible, built-in masks included) and writes one byte: 0 no pair visible,
// 1 some, 2 all (FlexAttention's block mask). It stops at the first tile evidence of
// "some". Grid (ceil(key tiles / NW), query tiles, mod_batches * mod_heads): every tile
// of every list in flight at once.
//
// mask_rows (FRT_CLASSIFY=1) / mask_cols (2): a warp per query (key) tile turns its row
// (column) of the map into the list of tiles to visit, last to first: entry j when every
// pair of the two tiles is visible, ~j when the element mask must run. Grid
// (ceil(lists / NW)). These read only the map, so they carry no expression and one
// compiled pair serves every mask_mod.
#include "params.cuh"

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

template <class T>
FRT_DEVICE void mask_map(const FwdParams& p) {
    constexpr int BM = T::BM, BN = T::BN;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int z = blockIdx.z, h = z % p.mod_heads, b = z / p.mod_heads;
    // One list stands for every head (batch entry) when mod_heads (mod_batches) is 1: the
    // mask does not depend on it, so head 0 (batch entry 0) is as good as any.
    const auto& vis = block_visibility<T::CAUSAL, T::MASK>(p, b);
    const int m = blockIdx.y, n = blockIdx.x * T::NW + warp;
    const int m_tiles = ceil_div(p.Sq, BM), n_tiles = ceil_div(p.Sk, BN);
    if (n >= n_tiles) return;
    bool any = false, all = true;
    if (m * BM < vis.Lq && n * BN < vis.Lk) {  // else no pair exists
        // A lane owns columns lane, lane + 32, ... of the tile and walks the rows, R rows between
        // votes: the expression's key-side reads stay the same from row to row (the compiler can keep
        // them), the query-side ones are the same across the warp, and a round's 32 pairs per lane are
        // in flight together (voting after every pair made each pair wait for the previous vote; with 8
        // pairs per round the map at S=1k took 13 us, with 32 9 us: docs/perf-notes.md, session 14).
        constexpr int COLS = (BN + 31) / 32, R = COLS >= 32 ? 1 : 32 / COLS;
        static_assert(BM % R == 0, "whole rounds");
        for (int r0 = 0; r0 < BM; r0 += R) {
#pragma unroll
            for (int r = r0; r < r0 + R; ++r)
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    const int col = lane + 32 * c;
                    if (BN % 32 == 0 || col < BN) {
                        const bool v = vis.visible(m * BM + r, n * BN + col, h);
                        any |= v, all &= v;
                    }
                }
            if (__any_sync(~0u, any) && !__all_sync(~0u, all)) break;  // partial: nothing more to learn
        }
    }
    any = __any_sync(~0u, any), all = __all_sync(~0u, all) && any;
    if (lane == 0)
        p.mod_map[((i64)z * m_tiles + m) * n_tiles + n] = all ? TILE_FULL : any ? TILE_PARTIAL : TILE_EMPTY;
}

// The list of one query tile's key tiles (ROWS) or one key tile's query tiles.
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
    int* list = (ROWS ? p.mod_rows : p.mod_cols) + at * inner_tiles;
    int listed = 0;
    for (int top = inner_tiles - 1; top >= 0; top -= 32) {
        const int j = top - lane;
        const int c = j < 0 ? TILE_EMPTY : ROWS ? map[(i64)outer * n_tiles + j] : map[(i64)j * n_tiles + outer];
        const u32 listed_here = __ballot_sync(~0u, c != TILE_EMPTY);
        if (c != TILE_EMPTY) list[listed + __popc(listed_here & ((1u << lane) - 1))] = c == TILE_FULL ? j : ~j;
        listed += __popc(listed_here);
    }
    if (lane == 0) (ROWS ? p.mod_rows_count : p.mod_cols_count)[at] = listed;
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
