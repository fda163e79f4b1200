// Tile lists for a mask_mod expression (MASK_MOD; ModLists in mask.cuh): for each tile of
// one axis, the tiles of the other axis that hold a visible (query, key) pair, found by
// evaluating every pair with the predicate the attention kernels apply (Visibility::visible,
// the built-in masks included), as FlexAttention's block masks do.
//
// Family mask_rows: grid (ceil(Sq / BM), mod_heads, mod_batches), a block per query tile,
// listing its key tiles (of BN) last to first (fwd, bwd_dq). Family mask_cols
// (FRT_CLASSIFY_COLS=1): grid (ceil(Sk / BN), mod_heads, mod_batches), a block per key
// tile, listing its query tiles (of BM) last to first (bwd_dkdv, bwd_fused). BM and BN are
// the consuming kernel's. Tiles outside the built-in masks' span (Visibility::key_span /
// query_span) are empty without evaluation. Each tile's pairs are spread over the block;
// a thread stops early once it has seen both a visible and a hidden pair.
#include "params.cuh"

#ifndef FRT_CLASSIFY_COLS
#define FRT_CLASSIFY_COLS 0
#endif

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct ClassifyTraits {
    static constexpr int BM = BM_, BN = BN_, NW = NW_, NTHREADS = NW * 32;
    static constexpr bool CAUSAL = CAUSAL_, COLS = FRT_CLASSIFY_COLS;
    static constexpr int MASK = FRT_MASK;
    static constexpr int SMEM = 0;
    static_assert(MASK & MASK_MOD, "tile lists are only for mask_mod variants");
    static_assert(BM % 16 == 0 && BN % 16 == 0, "block sizes must be multiples of 16");
};

template <class T>
__device__ void mask_classify(const FwdParams& p) {
    constexpr int BM = T::BM, BN = T::BN;
    const int tid = threadIdx.x, outer = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    // One list stands for every head (batch entry) when mod_heads (mod_batches) is 1:
    // the mask does not depend on it, so head 0 (batch entry 0) is as good as any.
    const auto& vis = block_visibility<T::CAUSAL, T::MASK>(p, b);
    const ModLists lists = T::COLS ? ModLists::cols(p, BM, BN) : ModLists::rows(p, BM, BN);
    const i64 at = lists.index(p, b, h, outer);
    int* list = (T::COLS ? p.mod_cols : p.mod_rows) + at * lists.n_inner;
    int* count = (T::COLS ? p.mod_cols_count : p.mod_rows_count) + at;

    // The inner tiles that the built-in masks leave: [first, end).
    int lo, hi;
    if constexpr (T::COLS)
        vis.query_span(outer * BN, BN, lo, hi, tid, T::NTHREADS);
    else
        vis.key_span(outer * BM, BM, lo, hi, tid, T::NTHREADS);
    constexpr int INNER = T::COLS ? BM : BN;
    const int first = lo / INNER, end = hi > lo ? ceil_div(hi, INNER) : first;

    int listed = 0;  // thread 0's
    for (int j = end - 1; j >= first; --j) {
        const int m0 = T::COLS ? j * BM : outer * BM, n0 = T::COLS ? outer * BN : j * BN;
        bool any = false, all = true;
        for (int e = tid; e < BM * BN && (all || !any); e += T::NTHREADS) {
            const bool v = vis.visible(m0 + e / BN, n0 + e % BN, h);
            any |= v, all &= v;
        }
        any = __syncthreads_or(any);
        all = __syncthreads_and(all);
        if (tid == 0 && any) list[listed++] = all ? j : ~j;
    }
    if (tid == 0) *count = listed;
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(ClassifyTraits, mask_classify, FwdParams)
#endif
