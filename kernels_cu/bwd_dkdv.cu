// Attention backward, dK and dV:
//   dV = sum_h P_h^T dO_h,   dK = scale * sum_h dS_h^T Q_h,   dS = P o (dP - delta)
// summed over the query heads h of one KV head's group (GQA/MQA).
//
// Grid (ceil(Sk / BN), Hkv * splits, B): a key tile's (query head of the group,
// query tile) pairs are visited in a fixed order, split into `splits` contiguous
// chunks. With one split, a block owns its key tile outright and writes dK/dV;
// with more (chosen by the launcher when the grid would not fill the GPU, e.g.
// MQA at small batch) each block writes fp32 partials that bwd_dkdv_reduce.cu
// sums in split order. No atomics either way: the result is bitwise deterministic.
//
// Per visited pair: S^T = K Q^T and dP^T = V dO^T are computed with the warps
// laid out WN x WM over (keys, queries); P^T and dS^T go to shared memory in
// 16-bit; then dV += P^T dO and dK += dS^T Q run with the warps laid out
// WN x WD over (keys, head_dim), which bounds the accumulator registers for
// large head_dim. Q/dO/lse2/delta stream through a two-stage cp.async pipeline.
#include "params.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct DkdvTraits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int DP = round_up(D, 16);
    static constexpr int NTHREADS = NW * 32;
    static_assert(D % 8 == 0 && D <= 256, "head_dim must be a multiple of 8, at most 256");
    static_assert(BN % 16 == 0 && BM % 16 == 0, "block sizes must be multiples of 16");
    static constexpr int WN = cmin(NW, BN / 16);  // warps along keys (both phases)
    static constexpr int WM = NW / WN;            // warps along queries (S^T, dP^T)
    static constexpr int WD = NW / WN;            // warps along head_dim (dK, dV)
    static_assert(WN * WM == NW, "warps must split evenly over the key tile");
    static_assert(BM % (8 * WM) == 0, "block_m must split evenly over the query warps");
    static_assert(DP % (8 * WD) == 0, "head_dim must split evenly over the head_dim warps");
    static constexpr int MT = BN / (16 * WN);  // m-tiles (keys) per warp
    static constexpr int NT1 = BM / (8 * WM);  // n-tiles (queries) per warp, phase 1
    static constexpr int NT2 = DP / (8 * WD);  // n-tiles (head_dim) per warp, phase 2
    static constexpr int LD = Pitch<DP>::bytes;
    static constexpr int LDP = Pitch<BM>::bytes;
    static constexpr int SMEM_KV = 2 * BN * LD;     // K, V
    static constexpr int SMEM_QDO_STAGE = 2 * BM * LD;  // Q, dO
    static constexpr int SMEM_P = 2 * BN * LDP;     // P^T, dS^T
    static constexpr int SMEM_STAT_STAGE = 2 * BM * 4;  // lse2, delta
    static constexpr int SMEM = SMEM_KV + 2 * SMEM_QDO_STAGE + SMEM_P + 2 * SMEM_STAT_STAGE;
};

template <class T>
__device__ void bwd_dkdv(const BwdParams& p) {
    constexpr int BM = T::BM, BN = T::BN, DP = T::DP, MT = T::MT, NT1 = T::NT1, NT2 = T::NT2;
    constexpr int LD = T::LD, LDP = T::LDP;
    extern __shared__ __align__(16) unsigned char smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wn = warp % T::WN, wq = warp / T::WN;  // wq indexes WM in phase 1 and WD in phase 2
    const int n_block = blockIdx.x, hk = blockIdx.y % p.Hkv, split = blockIdx.y / p.Hkv, b = blockIdx.z;
    const int group = p.H / p.Hkv;
    const int n0 = n_block * BN;
    const int rows_k = min(BN, p.Sk - n0);
    const int shift = causal_offset(p.Sq, p.Sk);

    // Query tiles that can see this key tile: query i sees key j iff j <= i + shift.
    const int m_first = T::CAUSAL ? max(0, n0 - shift) / BM : 0;
    const int m_count = ceil_div(p.Sq, BM) - m_first;
    const int n_pairs = m_count > 0 ? group * m_count : 0;
    const int chunk = ceil_div(n_pairs, p.splits);
    const int it_begin = min(n_pairs, split * chunk), it_end = min(n_pairs, it_begin + chunk);

    const u32 sK = smem_u32(smem), sV = sK + BN * LD;
    const u32 sQdO = sK + T::SMEM_KV;  // stage s: Q at + s*STAGE, dO right after Q
    const u32 sP = sQdO + 2 * T::SMEM_QDO_STAGE, sdS = sP + BN * LDP;
    float* s_stat = reinterpret_cast<float*>(smem + T::SMEM_KV + 2 * T::SMEM_QDO_STAGE + T::SMEM_P);

    auto load_q = [&](int it, int stage) {
        const int h = hk * group + it / m_count;
        const int m0 = (m_first + it % m_count) * BM;
        const int rows = min(BM, p.Sq - m0);
        const u32 sQ = sQdO + stage * T::SMEM_QDO_STAGE;
        load_tile<BM, T::D, T::NTHREADS>(sQ, p.q + b * p.q_sb + (i64)m0 * p.q_ss + h * p.q_sh, p.q_ss, rows, tid);
        load_tile<BM, T::D, T::NTHREADS>(sQ + BM * LD, p.dout + b * p.do_sb + (i64)m0 * p.do_ss + h * p.do_sh,
                                         p.do_ss, rows, tid);
        const i64 stat0 = ((i64)b * p.H + h) * p.Sq + m0;
        const u32 st = smem_u32(s_stat + stage * 2 * BM);
        for (int r = tid; r < BM; r += T::NTHREADS) {
            cp_async4(st + r * 4, p.lse2 + stat0 + (r < rows ? r : 0), r < rows);
            cp_async4(st + (BM + r) * 4, p.delta + stat0 + (r < rows ? r : 0), r < rows);
        }
    };

    load_tile<BN, T::D, T::NTHREADS>(sK, p.k + b * p.k_sb + (i64)n0 * p.k_ss + hk * p.k_sh, p.k_ss, rows_k, tid);
    load_tile<BN, T::D, T::NTHREADS>(sV, p.v + b * p.v_sb + (i64)n0 * p.v_ss + hk * p.v_sh, p.v_ss, rows_k, tid);
    if (it_begin < it_end) load_q(it_begin, 0);
    cp_async_commit();

    float dk[MT][NT2][4], dv[MT][NT2][4];
    zero(dk);
    zero(dv);
    const int krow1 = wn * MT * 16;  // this warp's first key row (both phases)
    const int qcol1 = wq * NT1 * 8;  // this warp's first query column (phase 1)
    const int dcol2 = wq * NT2 * 8;  // this warp's first head_dim column (phase 2)

    for (int it = it_begin; it < it_end; ++it) {
        const int stage = (it - it_begin) & 1;
        const int m0 = (m_first + it % m_count) * BM;
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < it_end) load_q(it + 1, stage ^ 1);
        cp_async_commit();
        const u32 sQ = sQdO + stage * T::SMEM_QDO_STAGE, sdO = sQ + BM * LD;
        const float* s_lse2 = s_stat + stage * 2 * BM;
        const float* s_delta = s_lse2 + BM;

        float s[MT][NT1][4], dp[MT][NT1][4];
        zero(s);
        zero(dp);
        gemm_ss<T::BF16, MT, NT1, DP / 16, B_NK>(s, sK + krow1 * LD, LD, sQ + qcol1 * LD, LD, lane);
        gemm_ss<T::BF16, MT, NT1, DP / 16, B_NK>(dp, sV + krow1 * LD, LD, sdO + qcol1 * LD, LD, lane);

        const bool need_mask = m0 + BM > p.Sq || n0 + BN > p.Sk || (T::CAUSAL && n0 + BN - 1 > m0 + shift);
        u16* p_tile = reinterpret_cast<u16*>(smem + (sP - sK));
        u16* ds_tile = reinterpret_cast<u16*>(smem + (sdS - sK));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT1; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int kr = krow1 + mt * 16 + g + 8 * (c >> 1);  // key row within the tile
                    const int qc = qcol1 + nt * 8 + 2 * t + (c & 1);     // query column within the tile
                    float pr = fast_exp2(fmaf(s[mt][nt][c], p.scale_log2, -s_lse2[qc]));
                    if (need_mask) {
                        const int key = n0 + kr, query = m0 + qc;
                        if (query >= p.Sq || hidden<T::CAUSAL>(query, key, p.Sk, shift)) pr = 0.f;
                    }
                    s[mt][nt][c] = pr;
                    dp[mt][nt][c] = pr * (dp[mt][nt][c] - s_delta[qc]);
                }
        acc_to_smem<T::BF16, MT, NT1>(p_tile + krow1 * (LDP / 2) + qcol1, LDP / 2, s, 1.f, lane);
        acc_to_smem<T::BF16, MT, NT1>(ds_tile + krow1 * (LDP / 2) + qcol1, LDP / 2, dp, 1.f, lane);
        __syncthreads();

        gemm_ss<T::BF16, MT, NT2, BM / 16, B_KN>(dv, sP + krow1 * LDP, LDP, sdO + dcol2 * 2, LD, lane);
        gemm_ss<T::BF16, MT, NT2, BM / 16, B_KN>(dk, sdS + krow1 * LDP, LDP, sQ + dcol2 * 2, LD, lane);
    }
    cp_async_wait<0>();
    if (p.splits > 1) {
        // Unscaled fp32 partials of this split; every element of the key tile is written
        // (zeros when the chunk was empty) so the reduction reads no uninitialised memory.
        const i64 per_split = (i64)p.B * p.Hkv * p.Sk * T::D;
        float* part = p.dkv_partial + split * per_split + (((i64)b * p.Hkv + hk) * p.Sk + n0) * T::D;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT2; ++nt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int kr = krow1 + mt * 16 + g + 8 * hh, col = dcol2 + nt * 8 + 2 * t;
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
    acc_to_smem<T::BF16, MT, NT2>(sdk + krow1 * Pitch<DP>::elems + dcol2, Pitch<DP>::elems, dk, p.scale, lane);
    acc_to_smem<T::BF16, MT, NT2>(sdv + krow1 * Pitch<DP>::elems + dcol2, Pitch<DP>::elems, dv, 1.f, lane);
    __syncthreads();
    store_tile<BN, T::D, T::NTHREADS>(p.dk + b * p.dk_sb + (i64)n0 * p.dk_ss + hk * p.dk_sh, p.dk_ss, sdk, rows_k,
                                      tid);
    store_tile<BN, T::D, T::NTHREADS>(p.dv + b * p.dv_sb + (i64)n0 * p.dv_ss + hk * p.dv_sh, p.dv_ss, sdv, rows_k,
                                      tid);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(DkdvTraits, bwd_dkdv, BwdParams)
#endif
