// Attention backward, dK and dV (and, in the fused variant, dQ):
//   dV = sum_h P_h^T dO_h,   dK = scale * sum_h dS_h^T Q_h,   dS = P o (dP - delta)
// summed over the query heads h of one KV head's group (GQA/MQA).
//
// Grid (ceil(Sk / BN), Hkv * splits, B): a key tile's (query head of the group,
// query tile) pairs are visited in a fixed order, split into `splits` contiguous
// chunks. With one split, a block owns its key tile outright and writes dK/dV;
// with more (chosen by the launcher when the grid would not fill the GPU, e.g.
// MQA at small batch) each block writes fp32 partials that bwd_dkdv_reduce.cu
// sums in split order. No atomics either way: dK/dV are bitwise deterministic.
//
// Per visited pair: S^T = K Q^T and dP^T = V dO^T (phase 1); P^T and dS^T go to
// shared memory in 16-bit; dV += P^T dO and dK += dS^T Q (phase 2). Each phase
// has its own warp layout (DkdvTraits), so the head_dim-wide dK/dV accumulators
// stay bounded and shared-memory fragment reads are as few as the tile allows.
// Q/dO/lse2/delta stream through a two-stage cp.async pipeline.
//
// Fused variant (FRT_FUSED_DQ=1, family bwd_fused): phase 3 computes this pair's
// dQ contribution dS K and adds it into an fp32 buffer with atomics;
// bwd_dq_convert.cu scales and casts the buffer. Unordered (dq_sem == nullptr),
// the summation order, and so dQ's bits, depend on scheduling. Ordered
// (deterministic=True), the key tiles that see a query tile add in key-tile
// order: key tile n waits until the tile's counter in dq_sem reads n, adds, and
// sets it to n + 1. The tiles that see a query tile are always 0..n_last (a
// prefix, also when causal), and every block visits its query tiles last to
// first, so blocks of one (head, batch) meet each query tile in key-tile order
// and wait only about one phase 3 per key tile before them. A block only ever
// waits on a lower key tile of its (KV head, batch): with one split, a block of
// lower linear index, dispatched earlier (as FlashAttention-3's deterministic
// mode also relies on); with splits > 1 the grid fits in one wave
// (tiles.dkdv_splits), so every block it waits on is resident.
#include "attention/dropout.cuh"
#include "attention/params.cuh"
#include "attention/score_mod.cuh"

#ifndef FRT_FUSED_DQ
#define FRT_FUSED_DQ 0
#endif

namespace frt {

// Largest divisor of nt that is at most cap (n-tiles per pass of a chunked GEMM).
__host__ __device__ constexpr int chunk_of(int nt, int cap) {
    int best = 1;
    for (int c = 1; c <= nt && c <= cap; ++c)
        if (nt % c == 0) best = c;
    return best;
}

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct DkdvTraits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_, FUSED = FRT_FUSED_DQ;
    static constexpr int MASK = FRT_MASK;
    static constexpr int DP = round_up(D, 16);
    static constexpr int NTHREADS = NW * 32;
    static_assert(D % 8 == 0 && D <= 256, "head_dim must be a multiple of 8, at most 256");
    static_assert(BN % 16 == 0 && BM % 16 == 0, "block sizes must be multiples of 16");
    // The warps of each phase's GEMM, along M from the host (flashrt/spec.py: KernelSpec.gemm_warps), the rest
    // along N. Phase 1: S^T, dP^T (keys x queries, k = head_dim): WN1 x WM1 warps. Phase 2: dK, dV (keys x
    // head_dim, k = queries): WN2 x WD2. Phase 3 (fused): dQ (queries x head_dim, k = keys): WM3 x WD3.
    static constexpr int WN1 = FRT_GEMM_WM1, WM1 = NW / WN1;
    static constexpr int WN2 = FRT_GEMM_WM2, WD2 = NW / WN2;
    static constexpr int WM3 = FRT_GEMM_WM3, WD3 = NW / WM3;
    static_assert(WN1 * WM1 == NW && WN2 * WD2 == NW && WM3 * WD3 == NW, "a GEMM's warps are not all the block's");
    static_assert(BN % (16 * WN1) == 0 && BM % (8 * WM1) == 0 && BN % (16 * WN2) == 0 && DP % (8 * WD2) == 0 &&
                  (!FUSED || (BM % (16 * WM3) == 0 && DP % (8 * WD3) == 0)), "a warp layout does not tile its GEMM");
    static constexpr int MT1 = BN / (16 * WN1), NT1 = BM / (8 * WM1);
    static constexpr int MT2 = BN / (16 * WN2), NT2 = DP / (8 * WD2);
    static constexpr int MT3 = BM / (16 * WM3), NT3 = DP / (8 * WD3);
    // dQ is not carried across pairs: a warp computes its columns in passes of NQ n-tiles
    // (at most 32 accumulator floats per thread) and adds each pass to global memory.
    static constexpr int NQ = chunk_of(NT3, 8 / MT3 > 0 ? 8 / MT3 : 1);
    // K / V / Q / dO unpadded and swizzled (common.cuh: chunk_at) where spec.KernelSpec.swizzled says, else padded;
    // P^T and dS^T, written from registers, stay padded. Phase 2 reads dO and Q, phase 3 K, from a warp's column on
    // (lane_chunk_at's sw rule: swz_disjoint).
    static constexpr bool SWZ = FRT_SWIZZLE;
    static_assert(!SWZ || (DP % 64 == 0 && swz_disjoint(NT2) && (!FUSED || swz_disjoint(NQ))),
                  "swizzled rows are a multiple of 128 bytes, read from whole chunk groups");
    static constexpr int LD = SWZ ? DP * 2 : Pitch<DP>::bytes;
    static constexpr int LDP = Pitch<BM>::bytes;
    static constexpr int SMEM_KV = 2 * BN * LD;     // K, V
    static constexpr int SMEM_QDO_STAGE = 2 * BM * LD;  // Q, dO
    static constexpr int SMEM_P = 2 * BN * LDP;     // P^T, dS^T
    static constexpr int SMEM_STAT_STAGE = 2 * BM * 4;  // lse2, delta
    static constexpr int SMEM = SMEM_KV + 2 * SMEM_QDO_STAGE + SMEM_P + 2 * SMEM_STAT_STAGE;
};

template <class T>
__device__ void bwd_dkdv(const BwdParams& p) {
    constexpr int BM = T::BM, BN = T::BN, DP = T::DP;
    constexpr int MT1 = T::MT1, NT1 = T::NT1, MT2 = T::MT2, NT2 = T::NT2;
    constexpr int LD = T::LD, LDP = T::LDP;
    constexpr bool SWZ = T::SWZ;
    extern __shared__ __align__(FRT_SWIZZLE ? 128 : 16) unsigned char smem[];  // (swizzled: rows on 128-byte lines)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const KeyTile<BM, BN, T::CAUSAL, T::MASK> tile(p, tid, T::NTHREADS);
    const int rows_k = tile.rows;
    if (rows_k <= 0) return;
    const int hk = tile.hk, split = tile.split, b = tile.b, n0 = tile.n0;
    const auto& vis = tile.vis;
    const int it_begin = tile.it_begin, it_end = tile.it_end;
    const Softcap cap = FRT_SOFTCAP ? Softcap(p.softcap, p.scale_log2) : Softcap();
    const ScoreMod smod = FRT_SCORE_MOD ? ScoreMod(p, b, 0, vis) : ScoreMod();  // (the head: each pair's)
    const Dropout drop0 = FRT_DROPOUT ? Dropout(p, b, 0) : Dropout();     // (the head: each pair's)

    const u32 sK = smem_u32(smem), sV = sK + BN * LD;
    const u32 sQdO = sK + T::SMEM_KV;  // stage s: Q at + s*STAGE, dO right after Q
    const u32 sP = sQdO + 2 * T::SMEM_QDO_STAGE, sdS = sP + BN * LDP;
    float* s_stat = reinterpret_cast<float*>(smem + T::SMEM_KV + 2 * T::SMEM_QDO_STAGE + T::SMEM_P);
    auto pair = [&](int it) { return tile.pair(p, it); };

    auto load_q = [&](int it, int stage) {
        const auto pr = pair(it);
        const int h = pr.h;
        const int m0 = pr.m * BM;
        const int rows = min(BM, vis.Lq - m0);  // rows past the sequence's length: zeros
        const i64 row0 = vis.q_row0 + m0;
        const u32 sQ = sQdO + stage * T::SMEM_QDO_STAGE;
        load_tile<BM, T::D, T::NTHREADS, FRT_QK_DIM, SWZ>(sQ, p.q + b * p.q_sb + row0 * p.q_ss + h * p.q_sh, p.q_ss,
                                                          rows, tid);
        load_tile<BM, T::D, T::NTHREADS, FRT_V_DIM, SWZ>(sQ + BM * LD,
                                                         p.dout + b * p.do_sb + row0 * p.do_ss + h * p.do_sh, p.do_ss,
                                                         rows, tid);
        const i64 stat0 = (i64)b * p.st_sb + (i64)h * p.st_sh + row0;
        const u32 st = smem_u32(s_stat + stage * 2 * BM);
        for (int r = tid; r < BM; r += T::NTHREADS) {
            cp_async4(st + r * 4, p.lse2 + stat0 + (r < rows ? r : 0), r < rows);
            cp_async4(st + (BM + r) * 4, p.delta + stat0 + (r < rows ? r : 0), r < rows);
        }
    };

    const i64 krow0 = vis.k_row0 + n0;
    load_tile<BN, T::D, T::NTHREADS, FRT_QK_DIM, SWZ>(sK, p.k + b * p.k_sb + krow0 * p.k_ss + hk * p.k_sh, p.k_ss,
                                                      tile.live, tid);
    load_tile<BN, T::D, T::NTHREADS, FRT_V_DIM, SWZ>(sV, p.v + b * p.v_sb + krow0 * p.v_ss + hk * p.v_sh, p.v_ss,
                                                     tile.live, tid);
    if (it_begin < it_end) load_q(it_begin, 0);
    cp_async_commit();

    float dk[MT2][NT2][4], dv[MT2][NT2][4];
    zero(dk);
    zero(dv);
    // This warp's first row and column in each phase's output tile.
    const int krow1 = (warp % T::WN1) * MT1 * 16, qcol1 = (warp / T::WN1) * NT1 * 8;
    const int krow2 = (warp % T::WN2) * MT2 * 16, dcol2 = (warp / T::WN2) * NT2 * 8;
    const int qrow3 = (warp % T::WM3) * T::MT3 * 16, dcol3 = (warp / T::WM3) * T::NT3 * 8;

    for (int it = it_begin; it < it_end; ++it) {
        const int stage = (it - it_begin) & 1;
        const auto pa = pair(it);
        const int m0 = pa.m * BM;
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < it_end) load_q(it + 1, stage ^ 1);
        cp_async_commit();
        const u32 sQ = sQdO + stage * T::SMEM_QDO_STAGE, sdO = sQ + BM * LD;
        const float* s_lse2 = s_stat + stage * 2 * BM;
        const float* s_delta = s_lse2 + BM;

        float s[MT1][NT1][4], dp[MT1][NT1][4];
        zero(s);
        zero(dp);
        gemm_ss<T::BF16, MT1, NT1, DP / 16, B_NK, A_MK, SWZ>(s, sK + krow1 * LD, LD, sQ + qcol1 * LD, LD, lane);
        gemm_ss<T::BF16, MT1, NT1, DP / 16, B_NK, A_MK, SWZ>(dp, sV + krow1 * LD, LD, sdO + qcol1 * LD, LD, lane);

        const bool need_mask = pa.partial;
        u16* p_tile = reinterpret_cast<u16*>(smem + (sP - sK));
        u16* ds_tile = reinterpret_cast<u16*>(smem + (sdS - sK));
        const Fragments at{krow1 + g, qcol1 + 2 * t};  // S^T: rows are keys, columns queries (within the tiles)
        // FRT_DROPOUT: P^T for dV is the kept probabilities times the scale, dP^T that of P before dropout
        typename BitsOf<4 * NT1>::type dropped[FRT_DROPOUT ? MT1 : 1];
        if constexpr (FRT_DROPOUT) {
            const Dropout drop = drop0.head(b, pa.h, p.H);
#pragma unroll
            for (int mt = 0; mt < MT1; ++mt)
                dropped[mt] = drop.bits<NT1, true, false>(n0 + krow1 + 16 * mt + g, m0 + qcol1 + 2 * t);  // (eight)
        }
        if constexpr (FRT_ALIBI)  // (the pair's query head's slope; positions in the sequence)
            Alibi(p, b, pa.h, vis.shift).add<MT1, NT1, true>(Fragments{n0 + krow1 + g, m0 + qcol1 + 2 * t},
                                                             [&](int mt, int nt, int c) -> float& { return s[mt][nt][c]; });
#pragma unroll
        for (int mt = 0; mt < MT1; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT1; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int qc = at.col(nt, c);  // the query column within the tile
                    float x = s[mt][nt][c], grad = 1.f;  // grad: the modification's derivative (score_mod.cuh)
                    if constexpr (FRT_SOFTCAP) {
                        const float th = cap.tanh_of(x);
                        x = cap.cap * th, grad = 1.f - th * th;
                    }
                    if constexpr (FRT_SCORE_MOD) {  // (positions in the sequence: S^T's rows are keys)
                        const Fragments in_seq{n0 + krow1 + g, m0 + qcol1 + 2 * t};
                        x = smod.head(pa.h).value_grad<true>(x, in_seq, mt, nt, c, grad);
                    }
                    float pr = fast_exp2(fmaf(x, ScoreMod::exp_scale(p.scale_log2), -s_lse2[qc]));
                    if (need_mask) {
                        if (!at.visible<true>(mt, nt, c, [&](int q, int k) { return tile.visible(m0 + q, n0 + k, pa.h); }))
                            pr = 0.f;
                    }
                    s[mt][nt][c] = pr;
                    if constexpr (FRT_SCORE_MOD) grad = pr > 0.f ? grad : 0.f;  // (any f' where P is 0)
                    float dpv = dp[mt][nt][c];
                    if constexpr (FRT_DROPOUT) {
                        const bool gone = dropped[mt] >> (4 * nt + c) & 1;
                        dpv = gone ? 0.f : dpv * drop0.scale;
                        s[mt][nt][c] = gone ? 0.f : pr * drop0.scale;
                    }
                    dp[mt][nt][c] = (FRT_SOFTCAP || FRT_SCORE_MOD ? pr * grad : pr) * (dpv - s_delta[qc]);
                }
        acc_to_smem<T::BF16, MT1, NT1>(p_tile + krow1 * (LDP / 2) + qcol1, LDP / 2, s, 1.f, lane);
        acc_to_smem<T::BF16, MT1, NT1>(ds_tile + krow1 * (LDP / 2) + qcol1, LDP / 2, dp, 1.f, lane);
        __syncthreads();

        const u32 col2 = swz_col<SWZ>(dcol2);  // (P^T and dS^T padded: SWZ_A false)
        gemm_ss<T::BF16, MT2, NT2, BM / 16, B_KN, A_MK, SWZ, false>(dv, sP + krow2 * LDP, LDP, sdO + col2, LD, lane,
                                                                  swz_sw<SWZ>(dcol2));
        gemm_ss<T::BF16, MT2, NT2, BM / 16, B_KN, A_MK, SWZ, false>(dk, sdS + krow2 * LDP, LDP, sQ + col2, LD, lane,
                                                                  swz_sw<SWZ>(dcol2));
        if constexpr (T::FUSED) {
            // dQ_pair = dS K: A = dS^T read transposed from shared memory, B = K.
            const int h = pa.h;
            float* dq_rows = p.dq_accum + ((i64)b * p.st_sb + (i64)h * p.st_sh + vis.q_row0 + m0) * T::D;
            int* sem = p.dq_sem ? dq_counter<BM>(p, tile, h, pa.m) : nullptr;
            // Key tiles add into a query tile in order, counted from the first that visits it (params.cuh:
            // dq_turn; not rotated here: docs/perf-notes.md, Ordered grid; never with mask_mod: flashrt/masks.py
            // sends those to split or unordered fused).
            const int turn = sem ? dq_turn<BM, BN>(tile, pa.m, it) : 0;
#pragma unroll 1
            for (int pass = 0; pass < T::NT3 / T::NQ; ++pass) {
                const int col0 = dcol3 + pass * T::NQ * 8;
                float dq[T::MT3][T::NQ][4];
                zero(dq);
                gemm_ss<T::BF16, T::MT3, T::NQ, BN / 16, B_KN, A_KM, SWZ, false>(
                    dq, sdS + qrow3 * 2, LDP, sK + swz_col<SWZ>(col0), LD, lane, swz_sw<SWZ>(col0));
                if (sem && pass == 0) {  // wait for the key tiles before this one (after the first GEMM)
                    if (tid == 0)
                        while (ld_acquire(sem) != turn) {
                        }
                    __syncthreads();
                }
                acc_red_add<T::MT3, T::NQ>(dq_rows + (i64)qrow3 * T::D + col0, T::D, dq, vis.Eq - m0 - qrow3,
                                           T::D - col0, lane);
            }
            if (sem) {
                // The barrier orders every thread's adds before thread 0's release (release is
                // cumulative), so only thread 0 waits for them to be performed.
                __syncthreads();
                if (tid == 0) st_release(sem, turn + 1);
            }
        }
    }
    cp_async_wait<0>();
    if (p.splits > 1) {
        // Unscaled fp32 partials of this split; every element of the key tile is written
        // (zeros when the chunk was empty) so the reduction reads no uninitialised memory.
        const i64 per_split = (i64)p.B * p.Hkv * p.Sk * T::D;
        float* part = p.dkv_partial + split * per_split + (((i64)b * p.Hkv + hk) * p.Sk + n0) * T::D;
#pragma unroll
        for (int mt = 0; mt < MT2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT2; ++nt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int kr = krow2 + mt * 16 + g + 8 * hh, col = dcol2 + nt * 8 + 2 * t;
                    if (kr < rows_k && col < T::D) {
                        float* at = part + (i64)kr * T::D + col;
                        *reinterpret_cast<float2*>(at) = make_float2(dk[mt][nt][2 * hh], dk[mt][nt][2 * hh + 1]);
                        *reinterpret_cast<float2*>(at + (i64)p.splits * per_split) =
                            make_float2(dv[mt][nt][2 * hh], dv[mt][nt][2 * hh + 1]);
                    }
                }
        return;
    }
    __syncthreads();  // K and V are no longer read; they now stage dK and dV

    u16* sdk = reinterpret_cast<u16*>(smem);
    u16* sdv = sdk + BN * Pitch<DP>::elems;
    acc_to_smem<T::BF16, MT2, NT2>(sdk + krow2 * Pitch<DP>::elems + dcol2, Pitch<DP>::elems, dk, p.scale, lane);
    acc_to_smem<T::BF16, MT2, NT2>(sdv + krow2 * Pitch<DP>::elems + dcol2, Pitch<DP>::elems, dv, 1.f, lane);
    __syncthreads();
    store_tile<BN, T::D, T::NTHREADS, FRT_QK_DIM>(p.dk + b * p.dk_sb + krow0 * p.dk_ss + hk * p.dk_sh, p.dk_ss, sdk,
                                                  rows_k, tid);
    store_tile<BN, T::D, T::NTHREADS, FRT_V_DIM>(p.dv + b * p.dv_sb + krow0 * p.dv_ss + hk * p.dv_sh, p.dv_ss, sdv,
                                                 rows_k, tid);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(DkdvTraits, bwd_dkdv, BwdParams)
#endif
