// Attention forward: O = softmax(scale * Q K^T) V and LSE, FlashAttention-2 style.
//
// Grid (ceil(Sq / BM), H, B); each of NW warps owns MT*16 query rows and keeps
// its O accumulator and softmax statistics in registers. K/V tiles stream
// through a two-stage cp.async pipeline (the next tile loads while the current
// one is used). Softmax runs in base 2 with the scale folded into the exponent.
#include "params.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct FwdTraits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int DP = round_up(D, 16);
    static constexpr int NTHREADS = NW * 32;
    static constexpr int MT = BM / (16 * NW);
    static_assert(D % 8 == 0 && D <= 256, "head_dim must be a multiple of 8, at most 256");
    static_assert(BM % (16 * NW) == 0, "block_m must be a multiple of 16 * warps");
    static_assert(BN % 16 == 0, "block_n must be a multiple of 16");
    // Q fragments stay in registers when they are small enough not to crowd out
    // the O accumulator; otherwise they are re-read from shared memory.
    static constexpr bool Q_IN_REGS = MT * DP <= 128;
    static constexpr int LD = Pitch<DP>::bytes;
    static constexpr int SMEM_Q = BM * LD;
    static constexpr int SMEM_KV_STAGE = 2 * BN * LD;
    static constexpr int SMEM = SMEM_Q + 2 * SMEM_KV_STAGE;
};

template <class T>
__device__ void fwd(const FwdParams& p) {
    constexpr int BM = T::BM, BN = T::BN, DP = T::DP, MT = T::MT, LD = T::LD;
    constexpr int NT_S = BN / 8, NT_O = DP / 8, KS_D = DP / 16, KS_N = BN / 16;
    extern __shared__ __align__(16) unsigned char smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    // Causal: the last query blocks see the most keys; launch them first.
    const int m_block = T::CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.H / p.Hkv);
    const int m0 = m_block * BM;
    const int rows_q = min(BM, p.Sq - m0);
    const int shift = causal_offset(p.Sq, p.Sk);

    const u16* gq = p.q + b * p.q_sb + (i64)m0 * p.q_ss + h * p.q_sh;
    const u16* gk = p.k + b * p.k_sb + hk * p.k_sh;
    const u16* gv = p.v + b * p.v_sb + hk * p.v_sh;

    const int key_end = T::CAUSAL ? min(p.Sk, m0 + BM + shift) : p.Sk;
    const int n_blocks = key_end > 0 ? ceil_div(key_end, BN) : 0;

    const u32 sQ = smem_u32(smem);
    const u32 sKV = sQ + T::SMEM_Q;  // stage s: K at sKV + s*STAGE, V right after K
    const int wrow = warp * MT * 16;

    auto load_kv = [&](int j, int stage) {
        const int n0 = j * BN;
        const u32 sK = sKV + stage * T::SMEM_KV_STAGE;
        load_tile<BN, T::D, T::NTHREADS>(sK, gk + (i64)n0 * p.k_ss, p.k_ss, p.Sk - n0, tid);
        load_tile<BN, T::D, T::NTHREADS>(sK + BN * LD, gv + (i64)n0 * p.v_ss, p.v_ss, p.Sk - n0, tid);
    };

    load_tile<BM, T::D, T::NTHREADS>(sQ, gq, p.q_ss, rows_q, tid);
    if (n_blocks > 0) load_kv(n_blocks - 1, 0);
    cp_async_commit();

    float o[MT][NT_O][4];
    zero(o);
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) row_max[mt][hh] = -FRT_INF, row_sum[mt][hh] = 0.f;
    u32 qf[T::Q_IN_REGS ? KS_D : 1][MT][4];

    // Key blocks are visited last to first so that the blocks needing a mask
    // (the ragged tail and the causal diagonal) come first.
    for (int it = 0; it < n_blocks; ++it) {
        const int j = n_blocks - 1 - it, stage = it & 1;
        const int n0 = j * BN;
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_blocks) load_kv(j - 1, stage ^ 1);
        cp_async_commit();

        const u32 sK = sKV + stage * T::SMEM_KV_STAGE, sV = sK + BN * LD;
        float s[MT][NT_S][4];
        zero(s);
        if constexpr (T::Q_IN_REGS) {
            if (it == 0) {
#pragma unroll
                for (int kk = 0; kk < KS_D; ++kk)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) load_a(sQ + wrow * LD, LD, mt, kk, lane, qf[kk][mt]);
            }
            gemm_rs<T::BF16, MT, NT_S, KS_D, B_NK>(s, qf, sK, LD, lane);
        } else {
            gemm_ss<T::BF16, MT, NT_S, KS_D, B_NK>(s, sQ + wrow * LD, LD, sK, LD, lane);
        }

        if (n0 + BN > p.Sk || (T::CAUSAL && n0 + BN - 1 > m0 + shift)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int row = m0 + wrow + mt * 16 + g + 8 * (c >> 1);
                        const int col = n0 + nt * 8 + 2 * t + (c & 1);
                        if (col >= p.Sk || (T::CAUSAL && col > row + shift)) s[mt][nt][c] = -FRT_INF;
                    }
        }

#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float mx = -FRT_INF;
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]));
                const float m_new = fmaxf(row_max[mt][hh], warp_max4(mx) * p.scale_log2);
                // A row that has seen only masked keys keeps m = -inf; subtract 0 then.
                const float base = m_new == -FRT_INF ? 0.f : m_new;
                const float alpha = fast_exp2(row_max[mt][hh] - base);
                row_max[mt][hh] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                    for (int c = 2 * hh; c < 2 * hh + 2; ++c) {
                        s[mt][nt][c] = fast_exp2(fmaf(s[mt][nt][c], p.scale_log2, -base));
                        sum += s[mt][nt][c];
                    }
                row_sum[mt][hh] = row_sum[mt][hh] * alpha + sum;
#pragma unroll
                for (int dt = 0; dt < NT_O; ++dt) o[mt][dt][2 * hh] *= alpha, o[mt][dt][2 * hh + 1] *= alpha;
            }

        u32 pf[KS_N][MT][4];
        acc_to_a<T::BF16, MT, KS_N>(s, pf);
        gemm_rs<T::BF16, MT, NT_O, KS_N, B_KN>(o, pf, sV, LD, lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with sQ; it now stages the output

    float* glse = p.lse + ((i64)b * p.H + h) * p.Sq + m0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float sum = warp_sum4(row_sum[mt][hh]);
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
            for (int dt = 0; dt < NT_O; ++dt) o[mt][dt][2 * hh] *= inv, o[mt][dt][2 * hh + 1] *= inv;
            const int r = wrow + mt * 16 + g + 8 * hh;
            if (t == 0 && r < rows_q) glse[r] = sum > 0.f ? (row_max[mt][hh] + __log2f(sum)) * kLn2 : -FRT_INF;
        }
    u16* sO = reinterpret_cast<u16*>(smem);
    acc_to_smem<T::BF16, MT, NT_O>(sO + wrow * Pitch<DP>::elems, Pitch<DP>::elems, o, 1.f, lane);
    __syncthreads();
    store_tile<BM, T::D, T::NTHREADS>(p.o + b * p.o_sb + (i64)m0 * p.o_ss + h * p.o_sh, p.o_ss, sO, rows_q, tid);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
typedef frt::FwdTraits<FRT_HEAD_DIM, FRT_BLOCK_M, FRT_BLOCK_N, FRT_WARPS, FRT_BF16, FRT_CAUSAL> FrtTraits;
static_assert(FrtTraits::SMEM == FRT_SMEM_BYTES, "launcher and kernel disagree on dynamic shared memory");
// min 1 block/SM: without it ptxas may cap registers to raise occupancy, and spill.
extern "C" __global__ void __launch_bounds__(FRT_WARPS * 32, 1) FRT_KERNEL_NAME(const frt::FwdParams p) {
    frt::fwd<FrtTraits>(p);
}
#endif
