// Attention backward on Hopper (sm_90a), dK and dV with wgmma:
//   P^T = exp2(scale_log2 * K Q^T - lse2),  dS^T = P^T o (V dO^T - delta),
//   dV = sum_h P_h^T dO_h,  dK = scale * sum_h dS_h^T Q_h
// summed over the query heads h of one KV head's group (GQA/MQA), as bwd_dkdv.cu computes them
// and with the same grid, pairs, splits and fp32 partials (KeyTile): no atomics, bitwise
// deterministic.
//
// Key-major: 256 threads = two warpgroups of 64 keys each own the block's 128 keys; K and V
// (128 x D) are loaded once, Q / dO tiles of BM = 64 query rows and their lse2 / delta stream
// through a two-stage cp.async pipeline into 128-byte-swizzled tiles (wgmma.cuh). Per pair and
// warpgroup: S^T and dP^T (64 x BM, k = head_dim) are wgmmas with both operands in shared
// memory, issued as two groups so that P^T's exponentials run while dP^T is in flight; P^T and
// dS^T are formed on the fp32 accumulator fragments (accumulator column = query row) and feed
// dV += P^T dO and dK += dS^T Q as register A operands (dO and Q are the MN-major B operand):
// no shared-memory round trip for P or dS. head_dim 64 or 128 (dK and dV, 64 x D fp32 each,
// stay in registers: 254 registers at 128).
#include "params.cuh"
#include "wgmma.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct DkdvSm90Traits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int MASK = FRT_MASK, NTHREADS = NW * 32;
    static_assert(D == 64 || D == 128, "bwd_dkdv_sm90: head_dim 64 or 128 (dK, dV accumulators in registers)");
    static_assert(BM == 64, "bwd_dkdv_sm90: query tiles of 64 rows (S^T is one m64n64 accumulator)");
    static_assert(BN == 128 && NW == 8, "bwd_dkdv_sm90: 128 keys, two warpgroups of 64");
    static constexpr int KV_BYTES = BN * D * 2;           // the K tile, or the V tile
    static constexpr int QT_BYTES = BM * D * 2;           // one Q or dO tile
    static constexpr int STAGE_BYTES = 2 * QT_BYTES;      // Q, then dO (both stay 1024-byte aligned)
    static constexpr int STAT_STAGE_BYTES = 2 * BM * 4;   // lse2[BM], then delta[BM]
    static constexpr int SMEM = 2 * KV_BYTES + 2 * STAGE_BYTES + 2 * STAT_STAGE_BYTES + sm90::kAtomBytes;
};

template <class T>
__device__ void bwd_dkdv_sm90(const BwdParams& p) {
    using namespace sm90;
    constexpr int BM = T::BM, BN = T::BN, D = T::D, NT = T::NTHREADS;
    extern __shared__ __align__(16) unsigned char smem[];
    const u32 smem_base = smem_u32(smem);
    const u32 sK = align_atom(smem_base), sV = sK + T::KV_BYTES;
    const u32 sQdO = sV + T::KV_BYTES;            // stage s: Q at sQdO + s * STAGE_BYTES, dO QT_BYTES after
    const u32 sStat = sQdO + 2 * T::STAGE_BYTES;  // stage s: lse2[BM], delta[BM] at sStat + s * STAT_STAGE_BYTES
    const float* stat_base = reinterpret_cast<const float*>(smem + (sStat - smem_base));

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, w = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const KeyTile<BM, BN, T::CAUSAL, T::MASK> tile(p, tid, NT);
    if (tile.rows <= 0) return;
    const int b = tile.b, hk = tile.hk, n0 = tile.n0, it_begin = tile.it_begin, it_end = tile.it_end;

    const i64 krow0 = tile.vis.k_row0 + n0;
    load_tile_sw128<BN, D, NT>(sK, p.k + b * p.k_sb + krow0 * p.k_ss + hk * p.k_sh, p.k_ss, tile.rows, tid);
    load_tile_sw128<BN, D, NT>(sV, p.v + b * p.v_sb + krow0 * p.v_ss + hk * p.v_sh, p.v_ss, tile.rows, tid);
    auto load_q = [&](int stage, int it) {
        const auto pr = tile.pair(p, it);
        const int m0 = pr.m * BM, rows = min(BM, tile.vis.Eq - m0);
        const i64 row0 = tile.vis.q_row0 + m0;
        const u32 sQ = sQdO + stage * T::STAGE_BYTES;
        load_tile_sw128<BM, D, NT>(sQ, p.q + b * p.q_sb + row0 * p.q_ss + pr.h * p.q_sh, p.q_ss, rows, tid);
        load_tile_sw128<BM, D, NT>(sQ + T::QT_BYTES, p.dout + b * p.do_sb + row0 * p.do_ss + pr.h * p.do_sh,
                                   p.do_ss, rows, tid);
        // lse2 and delta of the tile's rows (zeros past the sequence: with Q and dO rows of zeros
        // they add nothing).
        if (tid < 2 * BM) {
            const int which = tid / BM, r = tid % BM;
            const i64 at = (i64)b * p.st_sb + (i64)pr.h * p.st_sh + row0 + (r < rows ? r : 0);
            cp_async4(sStat + stage * T::STAT_STAGE_BYTES + tid * 4, (which ? p.delta : p.lse2) + at, r < rows);
        }
    };
    if (it_begin < it_end) load_q(0, it_begin);
    cp_async_commit();  // one group: K, V and the first query tile

    // This warpgroup's 64 keys: rows 64 wg.. of every column block of the K and V tiles. Its
    // accumulators (wgmma.cuh layout): S^T / dP^T element [4 j + 2 hh + e] is key 16 w + g + 8 hh,
    // query 8 j + 2 t + e of the tile; dK / dV element [4 j + 2 hh + e] is key 16 w + g + 8 hh,
    // head_dim column 8 j + 2 t + e.
    const u32 sKw = sK + wg * 64 * kSwizzleBytes, sVw = sV + wg * 64 * kSwizzleBytes;
    const int key_base = n0 + 64 * wg + 16 * w + g;
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = 0.f, dv[i] = 0.f;

    for (int it = it_begin; it < it_end; ++it) {
        const int stage = (it - it_begin) & 1;
        const auto pr = tile.pair(p, it);
        cp_async_wait<0>();
        fence_proxy_async();  // this thread's cp.async writes -> visible to wgmma (async proxy)
        // Every thread's writes landed; both warpgroups finished the previous pair (its wgmmas were
        // waited for), so the other stage, Q / dO / lse2 / delta alike, may be refilled.
        __syncthreads();
        if (it + 1 < it_end) load_q(stage ^ 1, it + 1);
        cp_async_commit();
        const u32 sQ = sQdO + stage * T::STAGE_BYTES, sdO = sQ + T::QT_BYTES;
        const float* s_lse2 = stat_base + stage * (T::STAT_STAGE_BYTES / 4);
        const float* s_delta = s_lse2 + BM;

        // Partial pairs: which of this thread's BM / 2 = 32 elements the mask hides, one bit each,
        // evaluated before the wgmmas hold their accumulators, one element at a time (inside the
        // exponential loop, or unrolled, the predicate's loads made the head_dim 128 variants with
        // block / segment ids spill 16-56 bytes, NVRTC 12.9).
        static_assert(BM / 2 == 32, "one bit per S^T element of a thread");
        u32 hidden = 0;
        if (pr.partial) {
            const int q0 = pr.m * BM + 2 * t;
#pragma unroll 1
            for (int i = 0; i < BM / 2; ++i)
                if (!tile.vis.visible(q0 + 8 * (i >> 2) + (i & 1), key_base + 8 * ((i >> 1) & 1), pr.h)) hidden |= 1u << i;
        }

        float s[BM / 2], dp[BM / 2];
        wgmma_fence();  // orders the dK / dV accumulator writes (zeroing, last pair) before the wgmmas
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_ss<BM, 0, T::BF16>(s, desc_k_major<BN>(sKw, kk), desc_k_major<BM>(sQ, kk), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_ss<BM, 0, T::BF16>(dp, desc_k_major<BN>(sVw, kk), desc_k_major<BM>(sdO, kk), kk > 0);
        wgmma_commit();

        wgmma_wait<1>();  // S^T is complete (dP^T may not be: its registers are not touched yet)
        fence_operand(s);
        // P^T = exp2(S^T * scale_log2 - lse2[query]), 0 where the mask hides the pair.
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
            const float2 l = *reinterpret_cast<const float2*>(s_lse2 + 8 * j + 2 * t);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                s[4 * j + 2 * hh] = fast_exp2(fmaf(s[4 * j + 2 * hh], p.scale_log2, -l.x));
                s[4 * j + 2 * hh + 1] = fast_exp2(fmaf(s[4 * j + 2 * hh + 1], p.scale_log2, -l.y));
            }
        }
#pragma unroll
        for (int i = 0; i < BM / 2; ++i)
            if (hidden >> i & 1) s[i] = 0.f;
        u32 pa[BM / 16][4];
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2, T::BF16>(s, kk, pa[kk]);

        wgmma_wait<0>();
        fence_operand(dp);
        // dS^T = P^T o (dP^T - delta[query]), with P^T in fp32.
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
            const float2 dl = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * t);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                dp[4 * j + 2 * hh] = s[4 * j + 2 * hh] * (dp[4 * j + 2 * hh] - dl.x);
                dp[4 * j + 2 * hh + 1] = s[4 * j + 2 * hh + 1] * (dp[4 * j + 2 * hh + 1] - dl.y);
            }
        }
        u32 dsa[BM / 16][4];
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2, T::BF16>(dp, kk, dsa[kk]);

        // dV_w += P^T dO and dK_w += dS^T Q (64 x D, k = the BM queries): A from registers, B
        // MN-major (the [query][head_dim] tiles read as K x N).
        wgmma_fence();  // orders the pa / dsa writes before the wgmmas that read them
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<D, 1, T::BF16>(dv, pa[kk], desc_mn_major<BM>(sdO, kk), 1);
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<D, 1, T::BF16>(dk, dsa[kk], desc_mn_major<BM>(sQ, kk), 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operand(dv);
        fence_operand(dk);
    }
    cp_async_wait<0>();  // the last (empty) group
    const int rows_wg = tile.rows - 64 * wg;

    if (p.splits > 1) {
        // Unscaled fp32 partials of this split (bwd_dkdv_reduce.cu sums them in split order); every
        // key of the tile is written, zeros when the chunk was empty.
        const i64 per_split = (i64)p.B * p.Hkv * p.Sk * D;
        float* part = p.dkv_partial + tile.split * per_split + (((i64)b * p.Hkv + hk) * p.Sk + n0 + 64 * wg) * D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = 16 * w + g + 8 * hh;
                if (r < rows_wg) {
                    float* at = part + (i64)r * D + 8 * j + 2 * t;
                    *reinterpret_cast<float2*>(at) = make_float2(dk[4 * j + 2 * hh], dk[4 * j + 2 * hh + 1]);
                    *reinterpret_cast<float2*>(at + (i64)p.splits * per_split) =
                        make_float2(dv[4 * j + 2 * hh], dv[4 * j + 2 * hh + 1]);
                }
            }
        return;
    }
    __syncthreads();  // all copies landed and every wgmma is complete before K / V are overwritten

    // Epilogue: stage scale * dK into this warpgroup's own 64 rows of the K tile and dV into its
    // rows of the V tile (only it read them), then 16-byte stores of the keys that exist.
    acc_to_sw128<BN, D, T::BF16>(sKw, dk, p.scale, w, g, t);
    acc_to_sw128<BN, D, T::BF16>(sVw, dv, 1.f, w, g, t);
    if (wg == 0)
        warpgroup_bar<1>();
    else
        warpgroup_bar<2>();
    const i64 row0 = krow0 + 64 * wg;
    sw128_rows_to_global<BN, D>(p.dk + b * p.dk_sb + row0 * p.dk_ss + hk * p.dk_sh, p.dk_ss, sKw, rows_wg, tid & 127);
    sw128_rows_to_global<BN, D>(p.dv + b * p.dv_sb + row0 * p.dv_ss + hk * p.dv_sh, p.dv_ss, sVw, rows_wg, tid & 127);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(DkdvSm90Traits, bwd_dkdv_sm90, BwdParams)
#endif
