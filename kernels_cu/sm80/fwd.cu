// Attention forward: O = softmax(scale * Q K^T) V and LSE, FlashAttention-2 style.
//
// Grid (ceil(Sq / BM), H, B); each of NW warps owns MT*16 query rows and keeps
// its O accumulator and softmax statistics in registers. K/V tiles stream
// through a two-stage cp.async pipeline (the next tile loads while the current
// one is used). Softmax runs in base 2 with the scale folded into the exponent.
#include "attention/dropout.cuh"
#include "attention/params.cuh"
#include "attention/softmax.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct FwdTraits : RowTraits<D_, BM_, BN_, NW_, BF16_, CAUSAL_> {
    using Base = RowTraits<D_, BM_, BN_, NW_, BF16_, CAUSAL_>;
    // Q fragments stay in registers when they are small enough not to crowd out
    // the O accumulator; otherwise they are re-read from shared memory.
    static constexpr bool Q_IN_REGS = Base::MT * Base::DP <= 128;
    static constexpr int SMEM = Base::SMEM_Q + 2 * Base::SMEM_KV_STAGE;  // Q + 2 stages of (K, V)
};

template <class T>
__device__ void fwd(const FwdParams& p) {
    constexpr int BM = T::BM, BN = T::BN, DP = T::DP, MT = T::MT, LD = T::LD;
    constexpr int NT_S = BN / 8, NT_O = DP / 8, KS_D = DP / 16, KS_N = BN / 16;
    constexpr bool SWZ = T::SWZ;
    extern __shared__ __align__(128) unsigned char smem[];  // (128: swizzled rows start on 128-byte lines)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const QueryTile<BM, BN, T::CAUSAL, T::MASK> tile(p, tid, T::NTHREADS);
    if (tile.rows <= 0) return;
    const int n_blocks = tile.n_blocks;

    const u32 sQ = smem_u32(smem);
    const u32 sKV = sQ + T::SMEM_Q;  // stage s: K at sKV + s*STAGE, V right after K
    const int wrow = warp * MT * 16;

    load_tile<BM, T::D, T::NTHREADS, FRT_QK_DIM, SWZ>(sQ, p.q + tile.b * p.q_sb + tile.row0 * p.q_ss + tile.h * p.q_sh,
                                                      p.q_ss, tile.rows, tid);
    auto load_kv = [&](u32 stage, int j) {
        load_kv_tile<BN, T::D, T::NTHREADS, SWZ>(stage, p, tile.b, tile.hk, tile.vis.k_row0, tile.vis.Lk, j, tid);
    };
    if (n_blocks > 0) load_kv(sKV, tile.key_tile(0));
    cp_async_commit();

    float o[MT][NT_O][4];
    zero(o);
    float row_max[MT][2], row_sum[MT][2];
    const Softcap cap = FRT_SOFTCAP ? Softcap(p.softcap, p.scale_log2) : Softcap();
    const Alibi alibi = FRT_ALIBI ? Alibi(p, tile.b, tile.h, tile.vis.shift) : Alibi();
    const ScoreMod smod = FRT_SCORE_MOD ? ScoreMod(p, tile.b, tile.h, tile.vis) : ScoreMod();
    const Dropout drop = FRT_DROPOUT ? Dropout(p, tile.b, tile.h) : Dropout();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) row_max[mt][hh] = -FRT_INF, row_sum[mt][hh] = 0.f;
    u32 qf[T::Q_IN_REGS ? KS_D : 1][MT][4];

    // Key blocks are visited last to first so that the blocks needing a mask
    // (the ragged tail and the causal diagonal) come first.
    for (int it = 0; it < n_blocks; ++it) {
        const int j = tile.key_tile(it), stage = it & 1;
        const int n0 = j * BN;
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_blocks)
            load_kv(sKV + (stage ^ 1) * T::SMEM_KV_STAGE, tile.next_key_tile(it, j));
        cp_async_commit();

        const u32 sK = sKV + stage * T::SMEM_KV_STAGE, sV = sK + BN * LD;
        float s[MT][NT_S][4];
        zero(s);
        if constexpr (T::Q_IN_REGS) {
            if (it == 0) {
#pragma unroll
                for (int kk = 0; kk < KS_D; ++kk)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) load_a<A_MK, SWZ>(sQ + wrow * LD, LD, mt, kk, lane, qf[kk][mt]);
            }
            gemm_rs<T::BF16, MT, NT_S, KS_D, B_NK, SWZ>(s, qf, sK, LD, lane);
        } else {
            gemm_ss<T::BF16, MT, NT_S, KS_D, B_NK, A_MK, SWZ>(s, sQ + wrow * LD, LD, sK, LD, lane);
        }

        if constexpr (FRT_SOFTCAP) {  // (before the mask: score_mod.cuh, Softcap::scale_of)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) s[mt][nt][c] = cap.tanh_of(s[mt][nt][c]);
        }
        if constexpr (FRT_ALIBI)
            alibi.add<MT, NT_S>(Fragments{tile.m0 + wrow + g, n0 + 2 * t},
                                [&](int mt, int nt, int c) -> float& { return s[mt][nt][c]; });
        if constexpr (FRT_SCORE_MOD)
            smod.apply<MT, NT_S>(Fragments{tile.m0 + wrow + g, n0 + 2 * t},
                                 [&](int mt, int nt, int c) -> float& { return s[mt][nt][c]; });
        if (tile.needs_mask(it, j))
            mask_fragments<MT, NT_S>(Fragments{tile.m0 + wrow + g, n0 + 2 * t}, -FRT_INF,
                                     [&](int mt, int nt, int c) -> float& { return s[mt][nt][c]; },
                                     [&](int q, int k) { return tile.visible(q, k, tile.h); });

#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float alpha = online_row<NT_S>(row_max[mt][hh], row_sum[mt][hh],
                                                     ScoreMod::exp_scale(cap.scale_of(p.scale_log2)),
                                                     [&](int nt, int e) -> float& { return s[mt][nt][2 * hh + e]; });
#pragma unroll
                for (int dt = 0; dt < NT_O; ++dt) o[mt][dt][2 * hh] *= alpha, o[mt][dt][2 * hh + 1] *= alpha;
            }
        if constexpr (FRT_DROPOUT) {  // (after the row sums: the softmax's denominator takes every probability)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                drop.each<NT_S>(tile.m0 + wrow + 16 * mt + g, n0 + 2 * t, [&](int i, u32 dropped) {
                    if (dropped) s[mt][i >> 2][i & 3] = 0.f;
                });
            }
        }

        u32 pf[KS_N][MT][4];
        acc_to_a<T::BF16, MT, KS_N>(s, pf);
        gemm_rs<T::BF16, MT, NT_O, KS_N, B_KN, SWZ>(o, pf, sV, LD, lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with sQ; it now stages the output

    float* glse = p.lse + tile.stat0;
    const float sink = p.sinks ? p.sinks[tile.h] : -FRT_INF;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float sum = warp_sum4(row_sum[mt][hh]), mx = row_max[mt][hh];
            const float keep = add_sink(mx, sum, sink);
            const float inv = sum > 0.f ? keep / sum * drop.scale : 0.f;
#pragma unroll
            for (int dt = 0; dt < NT_O; ++dt) o[mt][dt][2 * hh] *= inv, o[mt][dt][2 * hh + 1] *= inv;
            const int r = wrow + mt * 16 + g + 8 * hh;
            if (t == 0 && r < tile.rows) glse[r] = sum > 0.f ? (mx + __log2f(sum)) * kLn2 : -FRT_INF;
        }
    u16* sO = reinterpret_cast<u16*>(smem);
    acc_to_smem<T::BF16, MT, NT_O>(sO + wrow * Pitch<DP>::elems, Pitch<DP>::elems, o, 1.f, lane);
    __syncthreads();
    store_tile<BM, T::D, T::NTHREADS, FRT_V_DIM>(p.o + tile.b * p.o_sb + tile.row0 * p.o_ss + tile.h * p.o_sh, p.o_ss,
                                                 sO, tile.rows, tid);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(FwdTraits, fwd, FwdParams)
#endif
