// Attention backward, dQ = scale * dS K with dS = P o (dO V^T - delta).
//
// Grid (ceil(Sq / BM), H, B): one block owns a query tile and loops over the
// key tiles it can see, so every dQ element is written by exactly one thread
// (no atomics: bitwise deterministic). P is recomputed from lse2 (see
// bwd_preprocess.cu). K/V tiles use a two-stage cp.async pipeline.
//
// FRT_SCORE_TGRAD (spec.KernelSpec.score_grads): the same pass computes no dQ; each visible pair's dz = P (dP -
// delta) instead goes, times the score_mod expression's derivative in each tensor element it reads, into the
// gradients of the tensors marked "float_grad" (score_mod.cuh: ScoreMod::tensor_grads, tensor_grad_add: fp32 atomics,
// or exact fixed-point sums).
#include "attention/dropout.cuh"
#include "attention/params.cuh"
#include "attention/score_mod.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct DqTraits : RowTraits<D_, BM_, BN_, NW_, BF16_, CAUSAL_> {
    using Base = RowTraits<D_, BM_, BN_, NW_, BF16_, CAUSAL_>;
    static constexpr int SMEM = 2 * Base::SMEM_Q + 2 * Base::SMEM_KV_STAGE;  // Q, dO + 2 stages of (K, V)
};

template <class T>
__device__ void bwd_dq(const BwdParams& p) {
    constexpr int BM = T::BM, BN = T::BN, DP = T::DP, MT = T::MT, LD = T::LD;
    constexpr int NT_S = BN / 8, NT_D = DP / 8, KS_D = DP / 16, KS_N = BN / 16;
    constexpr bool SWZ = T::SWZ;
    extern __shared__ __align__(FRT_SWIZZLE ? 128 : 16) unsigned char smem[];  // (swizzled: rows on 128-byte lines)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const QueryTile<BM, BN, T::CAUSAL, T::MASK> tile(p, query_block<T::CAUSAL, true>(p), tid, T::NTHREADS);
    if (tile.rows <= 0) return;
    const int m0 = tile.m0, h = tile.h, b = tile.b;

    const u32 sQ = smem_u32(smem), sdO = sQ + T::SMEM_Q;
    const u32 sKV = sdO + T::SMEM_Q;
    const int wrow = warp * MT * 16;

    load_tile<BM, T::D, T::NTHREADS, FRT_QK_DIM, SWZ>(sQ, p.q + b * p.q_sb + tile.row0 * p.q_ss + h * p.q_sh, p.q_ss,
                                                      tile.live, tid);
    load_tile<BM, T::D, T::NTHREADS, FRT_V_DIM, SWZ>(sdO, p.dout + b * p.do_sb + tile.row0 * p.do_ss + h * p.do_sh,
                                                     p.do_ss, tile.live, tid);
    auto load_kv = [&](u32 stage, int j) {
        load_kv_tile<BN, T::D, T::NTHREADS, SWZ>(stage, p, b, tile.hk, tile.vis.k_row0, tile.vis.Lk, j, tid);
    };
    // Key tiles first to last: visit number it is tile.key_tile(n_blocks - 1 - it).
    const int n_blocks = tile.n_blocks;
    if (n_blocks > 0) load_kv(sKV, tile.key_tile(n_blocks - 1));
    cp_async_commit();

    // Per-row statistics of the two rows each thread holds per m-tile.
    const i64 stat0 = tile.stat0;
    float lse2[MT][2], delta[MT][2];
    const Softcap cap = FRT_SOFTCAP ? Softcap(p.softcap, p.scale_log2) : Softcap();
    const Alibi alibi = FRT_ALIBI ? Alibi(p, b, h, tile.vis.shift) : Alibi();
    const ScoreMod smod = FRT_SCORE_MOD ? ScoreMod(p, b, h, tile.vis) : ScoreMod();
    const Dropout drop = FRT_DROPOUT ? Dropout(p, b, h) : Dropout();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = wrow + mt * 16 + g + 8 * hh;
            lse2[mt][hh] = r < tile.live ? p.lse2[stat0 + r] : FRT_INF;
            delta[mt][hh] = r < tile.live ? p.delta[stat0 + r] : 0.f;
        }

    float dq[MT][NT_D][4];
    zero(dq);
    for (int it = 0; it < n_blocks; ++it) {
        const int j = tile.key_tile(n_blocks - 1 - it);
        const int n0 = j * BN, stage = it & 1;
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_blocks) load_kv(sKV + (stage ^ 1) * T::SMEM_KV_STAGE, tile.prev_key_tile(n_blocks - 1 - it, j));
        cp_async_commit();
        const u32 sK = sKV + stage * T::SMEM_KV_STAGE, sV = sK + BN * LD;

        float s[MT][NT_S][4];
        zero(s);
        gemm_ss<T::BF16, MT, NT_S, KS_D, B_NK, A_MK, SWZ>(s, sQ + wrow * LD, LD, sK, LD, lane);
        float raw[FRT_SCORE_TGRAD ? MT : 1][NT_S][4];  // (the expression's input, for the tensor gradients)
        if constexpr (FRT_SCORE_TGRAD) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) raw[mt][nt][c] = s[mt][nt][c];
        }
        float dp[MT][NT_S][4];
        zero(dp);
        gemm_ss<T::BF16, MT, NT_S, KS_D, B_NK, A_MK, SWZ>(dp, sdO + wrow * LD, LD, sV, LD, lane);
        if constexpr (FRT_DROPOUT) {  // dP of the probabilities before dropout: dO V^T where kept, times the scale
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                drop.each<NT_S>(m0 + wrow + 16 * mt + g, n0 + 2 * t, [&](int i, u32 dropped) {
                    float& x = dp[mt][i >> 2][i & 3];
                    x = dropped ? 0.f : x * drop.scale;
                });
            }
        }

        const bool need_mask = tile.needs_mask(n_blocks - 1 - it, j);
        // dS = P o (dP - delta), P = 0 where the mask hides the pair: the element mask inside this
        // loop, or with mask_mod in a pass of its own between P and dS (at head_dim 256 on sm_90a
        // each form spills 4 bytes in the other's variants, NVRTC 12.9).
        constexpr bool MOD_PASS = T::MASK & MASK_MOD;
        const Fragments at{m0 + wrow + g, n0 + 2 * t};
        auto test = [&](int q, int k) {  // (no mask: a row past the sequence has lse2 = +inf, its P is 0 already;
            // testing rows too cost 4 registers and a block an SM at head_dim 64: docs/perf-notes.md, Open gaps, 7)
            if constexpr (T::MASK == 0 && !T::CAUSAL && !FRT_SCORE_MOD) return k < tile.vis.Lk;
            else return tile.visible(q, k, h);
        };
        if constexpr (FRT_ALIBI) alibi.add<MT, NT_S>(at, [&](int mt, int nt, int c) -> float& { return s[mt][nt][c]; });
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int hh = c >> 1;
                    float x = s[mt][nt][c], grad = 1.f;  // grad: the modification's derivative (score_mod.cuh)
                    if constexpr (FRT_SOFTCAP) {
                        const float th = cap.tanh_of(x);
                        x = cap.cap * th, grad = 1.f - th * th;
                    }
                    if constexpr (FRT_SCORE_TGRAD)
                        x = smod.value(x, at, mt, nt, c);  // (dz = P (dP - delta): no f')
                    else if constexpr (FRT_SCORE_MOD)
                        x = smod.value_grad(x, at, mt, nt, c, grad);
                    float pr = fast_exp2(fmaf(x, ScoreMod::exp_scale(p.scale_log2), -lse2[mt][hh]));
                    if constexpr (FRT_SCORE_MOD && !FRT_SCORE_TGRAD)
                        pr = pr > 0.f ? pr * grad : 0.f;  // (any f' where P is 0)
                    if (!MOD_PASS && need_mask) {
                        if (!at.visible<false>(mt, nt, c, test)) pr = 0.f;
                    }
                    if constexpr (FRT_SOFTCAP) pr *= grad;
                    s[mt][nt][c] = MOD_PASS ? pr : pr * (dp[mt][nt][c] - delta[mt][hh]);
                }
        if constexpr (MOD_PASS) {
            if (need_mask)
                mask_fragments<MT, NT_S>(at, 0.f, [&](int mt, int nt, int c) -> float& { return s[mt][nt][c]; }, test);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) s[mt][nt][c] *= dp[mt][nt][c] - delta[mt][c >> 1];
        }
        if constexpr (FRT_SCORE_TGRAD) {  // the tensors' gradients, and no dQ; only pairs inside the sequence (a
            // tile the lists or ids call visible takes no element mask, and a row past the end has P = 0 only while
            // the expression is finite there)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const bool inside = at.row(mt, c) < tile.vis.Lq && at.col(nt, c) < tile.vis.Lk;
                        if (inside && s[mt][nt][c] != 0.f)
                            smod.tensor_grads(p, raw[mt][nt][c], at, mt, nt, c, s[mt][nt][c]);
                    }
            continue;
        }
        u32 dsf[KS_N][MT][4];
        acc_to_a<T::BF16, MT, KS_N>(s, dsf);
        gemm_rs<T::BF16, MT, NT_D, KS_N, B_KN, SWZ>(dq, dsf, sK, LD, lane);
    }
    cp_async_wait<0>();
    if constexpr (FRT_SCORE_TGRAD) return;
    __syncthreads();

    u16* sO = reinterpret_cast<u16*>(smem);
    acc_to_smem<T::BF16, MT, NT_D>(sO + wrow * Pitch<DP>::elems, Pitch<DP>::elems, dq, p.scale, lane);
    __syncthreads();
    store_tile<BM, T::D, T::NTHREADS, FRT_QK_DIM>(p.dq + b * p.dq_sb + tile.row0 * p.dq_ss + h * p.dq_sh, p.dq_ss, sO,
                                                  tile.rows, tid);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(DqTraits, bwd_dq, BwdParams)
#endif
