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
// (docs/perf-notes.md, session 9).
#include "params.cuh"
#include "wgmma.cuh"

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
    const QueryTile<BM, BN, T::CAUSAL, T::MASK> tile(p, wi.m, wi.h, wi.b, tid, NT);
    if (tile.rows <= 0) return;
    const int n_blocks = block_uniform(tile.n_blocks);  // (with id masks it comes from shared memory)

    load_tile_sw128<BM, D, NT>(sQ, p.q + tile.b * p.q_sb + tile.row0 * p.q_ss + tile.h * p.q_sh, p.q_ss, tile.rows,
                               tid);
    const u16* gk = p.k + tile.b * p.k_sb + tile.vis.k_row0 * p.k_ss + tile.hk * p.k_sh;
    const u16* gv = p.v + tile.b * p.v_sb + tile.vis.k_row0 * p.v_ss + tile.hk * p.v_sh;
    // Stage s holds a K tile and, KV_BYTES after it, a V tile. Key tile it's K is loaded one
    // iteration ahead of its S wgmma and its V one iteration ahead of its P V wgmma (which runs in
    // iteration it + 1, under that iteration's softmax), so both tiles of tile it live in stage it & 1.
    auto load = [&](u32 s_tile, const u16* g, i64 stride, int j) {  // key tile j of K or V
        load_tile_sw128<BN, D, NT>(s_tile, g + (i64)j * BN * stride, stride, tile.vis.Ek - j * BN, tid);
    };
    if (n_blocks > 0) load(sKV, gk, p.k_ss, tile.key_tile(0));
    cp_async_commit();

    // This warpgroup's 64 query rows: rows 64 wg.. of every column block of the Q tile. A thread
    // holds rows 16 w + g (hh = 0) and 16 w + g + 8 (hh = 1) of them; its accumulator element
    // [4 j + 2 hh + e] is column 8 j + 2 t + e (wgmma.cuh: the accumulator layout).
    const u32 sQw = sQ + wg * 64 * kSwizzleBytes;
    const int row_base = tile.m0 + 64 * wg + 16 * w + g;

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float row_max[2] = {-FRT_INF, -FRT_INF}, row_sum[2] = {0.f, 0.f};
    // Across iterations: s holds the last tile's P (fp32) and alpha its rescale of O, until both are
    // applied at the top of the next iteration; pa is P packed as the A operand of its P V wgmma.
    float s[BN / 2], alpha[2] = {1.f, 1.f};
    u32 pa[BN / 16][4];
    // O += P V of the previous tile and its O rescale, once its P V wgmma (issued last iteration) is done.
    auto retire_pv = [&] {
        wgmma_wait<0>();
        fence_operand(o);
#pragma unroll
        for (int jj = 0; jj < D / 8; ++jj)
#pragma unroll
            for (int c = 0; c < 4; ++c) o[4 * jj + c] *= alpha[c >> 1];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) acc_to_a_frag<BN / 2, T::BF16>(s, kk, pa[kk]);
    };

    // Key tiles last to first (as fwd.cu): the ones needing the element mask come first.
    // Iteration it issues S = Q K^T of tile it and O += P V of tile it - 1, and runs tile it's softmax
    // while that P V wgmma is in flight (FlashAttention-3's intra-warpgroup overlap); the wait for it
    // and O's rescale open the next iteration. (Written at the end of an iteration, the wait was
    // hoisted by ptxas above the softmax, whatever kept P's registers live: SASS, session 9.)
    // Warpgroup 1 issues its wgmmas once warpgroup 0 has issued its own, so that warpgroup 0's S
    // completes first and its softmax runs under the other wgmmas: without that order, or with the
    // order alone, the overlap measured slower than no overlap (docs/perf-notes.md, session 9).
    for (int it = 0; it < n_blocks; ++it) {
        const int j = tile.key_tile(it), stage = it & 1, n0 = j * BN;
        retire_pv();  // (nothing in flight at it = 0: alpha = 1, pa unused)
        cp_async_wait<0>();   // K of tile it, V of tile it - 1
        fence_proxy_async();  // this thread's cp.async writes -> visible to wgmma (async proxy)
        __syncthreads();      // every thread's writes landed; iteration it - 1's wgmmas are complete
        if (it + 1 < n_blocks) load(sKV + (stage ^ 1) * T::STAGE_BYTES, gk, p.k_ss, tile.next_key_tile(it, j));
        load(sKV + stage * T::STAGE_BYTES + T::KV_BYTES, gv, p.v_ss, j);
        cp_async_commit();

        if (wg == 1) bar_wait<3, 256>();  // after warpgroup 0's wgmmas (its arrive below)
        wgmma_fence();  // orders the o rescale and pa packing before the wgmmas below
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_ss<BN, 0, T::BF16>(s, desc_k_major<BM>(sQw, kk),
                                     desc_k_major<BN>(sKV + stage * T::STAGE_BYTES, kk), kk > 0);
        wgmma_commit();
        if (it > 0) {
            wgmma_rs_mn<D, BN, T::BF16>(o, pa, sKV + (stage ^ 1) * T::STAGE_BYTES + T::KV_BYTES);
            wgmma_commit();
            if (wg == 0) bar_arrive<3, 256>();
            wgmma_wait<1>();  // S is complete; P V may still run
        } else {
            if (wg == 0) bar_arrive<3, 256>();
            wgmma_wait<0>();
        }
        fence_operand(s);

        if (tile.needs_mask(it, j)) {
#pragma unroll
            for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    if (!tile.visible(row_base + 8 * (c >> 1), n0 + 8 * jj + 2 * t + (c & 1), tile.h))
                        s[4 * jj + c] = -FRT_INF;
        }

#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float mx = -FRT_INF;
#pragma unroll
            for (int jj = 0; jj < BN / 8; ++jj) mx = fmaxf(mx, fmaxf(s[4 * jj + 2 * hh], s[4 * jj + 2 * hh + 1]));
            const float m_new = fmaxf(row_max[hh], warp_max4(mx) * p.scale_log2);
            // A row that has seen only masked keys keeps m = -inf; subtract 0 then.
            const float base = m_new == -FRT_INF ? 0.f : m_new;
            alpha[hh] = fast_exp2(row_max[hh] - base);
            row_max[hh] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[4 * jj + 2 * hh + e];
                    x = fast_exp2(fmaf(x, p.scale_log2, -base));
                    sum += x;
                }
            row_sum[hh] = row_sum[hh] * alpha[hh] + sum;
        }
    }
    retire_pv();
    cp_async_wait<0>();   // V of the last key tile
    fence_proxy_async();
    // Every thread's copies have landed (the last V; with no key tile to visit, Q, before a warpgroup
    // overwrites its rows with O: compute-sanitizer's racecheck saw that one).
    __syncthreads();
    if (n_blocks > 0) wgmma_rs_wait<D, BN, T::BF16>(o, pa, sKV + ((n_blocks - 1) & 1) * T::STAGE_BYTES + T::KV_BYTES);

    // Epilogue: normalise, LSE, stage O into this warpgroup's own 64 rows of the Q tile (only it
    // read them, and its wgmmas are complete), then 16-byte stores of the rows that exist.
    const int rows_wg = tile.rows - 64 * wg;
    float* glse = p.lse + tile.stat0 + 64 * wg;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const float sum = warp_sum4(row_sum[hh]);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
        for (int jj = 0; jj < D / 8; ++jj) o[4 * jj + 2 * hh] *= inv, o[4 * jj + 2 * hh + 1] *= inv;
        const int r = 16 * w + g + 8 * hh;
        if (t == 0 && r < rows_wg) glse[r] = sum > 0.f ? (row_max[hh] + __log2f(sum)) * kLn2 : -FRT_INF;
    }
    acc_to_sw128<BM, D, T::BF16>(sQw, o, 1.f, w, g, t);
    if (wg == 0)
        warpgroup_bar<1>();
    else
        warpgroup_bar<2>();
    sw128_rows_to_global<BM, D>(p.o + tile.b * p.o_sb + (tile.row0 + 64 * wg) * p.o_ss + tile.h * p.o_sh, p.o_ss, sQw,
                                rows_wg, tid & 127);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(FwdSm90Traits, fwd_sm90, FwdParams)
#endif
