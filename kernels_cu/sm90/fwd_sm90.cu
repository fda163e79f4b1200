// Attention forward on Hopper (sm_90a): O = softmax(scale * Q K^T) V and LSE with wgmma.
//
// The same problem and masks as fwd.cu (QueryTile: GQA, spans / mask_mod lists, ragged tiles), for
// head_dim 64, 128, 192, 256, on a 1-D grid of 128-row query tiles ordered for L2 and causal
// balance (params.cuh: work_item).
// 256 threads = two warpgroups of 64 query rows each. Q (128 x D) is loaded once and K/V tiles
// (BN x D) double-buffered by cp.async into 128-byte-swizzled shared tiles (wgmma.cuh);
// S = Q K^T is a wgmma with both operands in shared memory, the online softmax (base 2, scale
// folded in) runs on the fp32 accumulator fragments, and O += P V is a wgmma with P from
// registers and V as the transposed (MN-major) B operand. A key tile's softmax runs while the
// previous tile's P V wgmma is in flight, and warpgroup 0 issues its wgmmas before warpgroup 1
// (docs/perf-notes.md: Forward: wgmma (fwd_sm90)).
#include "sm90/fwd_sm90.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct FwdSm90Traits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int MASK = FRT_MASK, NTHREADS = NW * 32;
    static_assert(D % 64 == 0 && D <= 256, "fwd_sm90: head_dim 64, 128, 192 or 256 (whole swizzle blocks)");
    static_assert(BM == 128 && NW == 8, "fwd_sm90: 128 query rows, two warpgroups");
    static_assert(BN == 64 || BN == 128, "fwd_sm90: key tiles of 64 or 128");
    static constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;  // one K or one V tile
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;                     // K, then V
    static constexpr int SMEM = Q_BYTES + 2 * STAGE_BYTES + sm90::kAtomBytes;  // + alignment slack
};

template <class T>
__device__ void fwd_sm90(const FwdParams& p) {
    using namespace sm90;
    constexpr int BM = T::BM, BN = T::BN, D = T::D, NT = T::NTHREADS;
    extern __shared__ __align__(16) unsigned char smem[];
    const u32 sQ = align_atom(smem_u32(smem));
    const u32 sKV = sQ + T::Q_BYTES;  // stage s: K at sKV + s * STAGE_BYTES, V KV_BYTES after it

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, w = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const WorkItem wi = work_item<T::CAUSAL>(p, blockIdx.x, ceil_div(p.Sq, BM));
    const QueryTile<BM, BN, T::CAUSAL, T::MASK> tile(p, wi, tid, NT);
    if (tile.rows <= 0) return;
    const int n_blocks = block_uniform(tile.n_blocks);  // (with id masks it comes from shared memory)

    load_tile_sw128<BM, D, NT>(sQ, p.q + tile.b * p.q_sb + tile.row0 * p.q_ss + tile.h * p.q_sh, p.q_ss, tile.rows,
                               p.head_dim, tid);
    const u16* gk = p.k + tile.b * p.k_sb + tile.vis.k_row0 * p.k_ss + tile.hk * p.k_sh;
    const u16* gv = p.v + tile.b * p.v_sb + tile.vis.k_row0 * p.v_ss + tile.hk * p.v_sh;
    // Stage s holds a K tile and, KV_BYTES after it, a V tile. Key tile it's K is loaded one
    // iteration ahead of its S wgmma and its V one iteration ahead of its P V wgmma (which runs in
    // iteration it + 1, under that iteration's softmax), so both tiles of tile it live in stage it & 1.
    auto load = [&](u32 s_tile, const u16* g, i64 stride, int cols, int j) {  // key tile j of K or V
        load_tile_sw128<BN, D, NT>(s_tile, g + (i64)j * BN * stride, stride, tile.vis.Lk - j * BN, cols, tid);
    };
    if (n_blocks > 0) load(sKV, gk, p.k_ss, p.head_dim, tile.key_tile(0));
    cp_async_commit();

    // This warpgroup's 64 query rows: rows 64 wg.. of every column block of the Q tile (fwd_sm90.cuh:
    // which of them a thread holds).
    const u32 sQw = sQ + wg * 64 * kSwizzleBytes;
    const int row_base = tile.m0 + 64 * wg + 16 * w + g;
    FwdRows<D, BN, T::BF16> r;
    if constexpr (FRT_SOFTCAP) r.cap = Softcap(p.softcap, p.scale_log2);
    if constexpr (FRT_ALIBI) r.alibi = Alibi(p, tile.b, tile.h, tile.vis.shift);
    if constexpr (FRT_SCORE_MOD) r.smod = ScoreMod(p, tile.b, tile.h, tile.vis);
    if constexpr (FRT_DROPOUT) r.drop = Dropout(p, tile.b, tile.h);

    // Key tiles last to first (as fwd.cu): the ones needing the element mask come first.
    // Iteration it issues S = Q K^T of tile it and O += P V of tile it - 1, and runs tile it's softmax
    // while that P V wgmma is in flight (FlashAttention-3's intra-warpgroup overlap); the wait for it
    // and O's rescale open the next iteration (FwdRows::retire_pv).
    // Warpgroup 1 issues its wgmmas once warpgroup 0 has issued its own, so that warpgroup 0's S
    // completes first and its softmax runs under the other wgmmas: without that order, or with the
    // order alone, the overlap measured slower than no overlap (docs/perf-notes.md: Forward: wgmma (fwd_sm90)).
    for (int it = 0; it < n_blocks; ++it) {
        const int j = tile.key_tile(it), stage = it & 1;
        r.retire_pv();  // (nothing in flight at it = 0: alpha = 1, pa unused)
        cp_async_wait<0>();   // K of tile it, V of tile it - 1
        fence_proxy_async();  // this thread's cp.async writes -> visible to wgmma (async proxy)
        __syncthreads();      // every thread's writes landed; iteration it - 1's wgmmas are complete
        if (it + 1 < n_blocks)
            load(sKV + (stage ^ 1) * T::STAGE_BYTES, gk, p.k_ss, p.head_dim, tile.next_key_tile(it, j));
        load(sKV + stage * T::STAGE_BYTES + T::KV_BYTES, gv, p.v_ss, p.head_dim_v, j);
        cp_async_commit();

        if (wg == 1) bar_wait<3, 256>();  // after warpgroup 0's wgmmas (its arrive below)
        wgmma_fence();  // orders the o rescale and pa packing before the wgmmas below
        wgmma_abt<BN, BM, D / 16, T::BF16>(r.s, sQw, sKV + stage * T::STAGE_BYTES);
        wgmma_commit();
        if (it > 0) {
            wgmma_rs_mn<D, BN, T::BF16>(r.o, r.pa, sKV + (stage ^ 1) * T::STAGE_BYTES + T::KV_BYTES);
            wgmma_commit();
            if (wg == 0) bar_arrive<3, 256>();
            wgmma_wait<1>();  // S is complete; P V may still run
        } else {
            if (wg == 0) bar_arrive<3, 256>();
            wgmma_wait<0>();
        }
        fence_operand(r.s);
        r.softmax(tile, it, j, row_base, t, p.scale_log2);
    }
    r.retire_pv();
    cp_async_wait<0>();   // V of the last key tile
    fence_proxy_async();
    // Every thread's copies have landed (the last V; with no key tile to visit, Q, before a warpgroup
    // overwrites its rows with O: compute-sanitizer's racecheck saw that one).
    __syncthreads();
    if (n_blocks > 0) wgmma_rs_wait<D, BN, T::BF16>(r.o, r.pa, sKV + ((n_blocks - 1) & 1) * T::STAGE_BYTES + T::KV_BYTES);

    r.template store<BM>(p, tile, sQw, wg, w, g, t);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(FwdSm90Traits, fwd_sm90, FwdParams)
#endif
