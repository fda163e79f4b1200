// Hopper wgmma prototype (sm_90a only; not wired into flashrt's API). Two kernels, each
// compiled when its -D defines are given (scripts/probe_sm90.py):
//
//   probe_gemm  (-DPROBE_N=64|128 -DPROBE_K=<multiple of 64> -DPROBE_TRANS_B=0|1 -DPROBE_A_REGS=0|1)
//     One warpgroup, one tile: C[64 x N] (fp32, row-major) =
//       TRANS_B = 0: A[64 x K] * B[N x K]^T   (B K-major, like K in S = Q K^T)
//       TRANS_B = 1: A[64 x K] * B2[K x N]    (B MN-major, like V in O = P V)
//     A from shared memory by descriptor (A_REGS = 0) or from registers (A_REGS = 1, the
//     fragments read straight from global memory in the documented register layout).
//     The unit test of the descriptors, the swizzle and the fragment layouts.
//
//   fwd_sm90    (-DFWD_D=64|128 -DFWD_BN=64|128)
//     O = softmax(scale * Q K^T) V and the natural-log LSE; bf16, non-causal, no masks,
//     Sq = Sk = S a multiple of 128 and of BN. Grid (S/128, H, B), 256 threads = two
//     consumer warpgroups of 64 query rows each, no producer warp (v1). Q (128 x D) once, K/V
//     tiles (BN x D) double-buffered, all in sw128 tiles filled by cp.async.
//     S = Q K^T: wgmma SS (Q, K both K-major); softmax in base 2 on the accumulator
//     fragments; O += P V: wgmma RS (P from registers as bf16, V MN-major, imm-trans-b = 1).
#include "wgmma.cuh"

namespace frt {
namespace sm90 {

#ifdef PROBE_N
template <int N, int K, int TRANS_B, bool A_REGS>
__device__ void probe_gemm_body(const u16* A, const u16* B, float* C) {
    static_assert(K % 64 == 0 && N % 64 == 0, "probe: K and N are multiples of 64");
    constexpr int KSTEPS = K / 16;
    extern __shared__ unsigned char smem_raw[];
    const u32 sA = align_atom(smem_u32(smem_raw));  // 64 x K, K-major
    const u32 sB = sA + 64 * K * 2;                  // N x K (TRANS_B = 0) or K x N (TRANS_B = 1)
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;

    load_tile_sw128<64, K, 128>(sA, A, K, tid);
    if constexpr (TRANS_B) load_tile_sw128<K, N, 128>(sB, B, N, tid);
    else load_tile_sw128<N, K, 128>(sB, B, K, tid);
    cp_async_commit();

    // A fragments (A_REGS) are loaded before the wgmma.fence that orders them.
    u32 a[A_REGS ? KSTEPS : 1][4];
    if constexpr (A_REGS) {
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const u16* row0 = A + (16 * w + g) * K + 16 * kk + 2 * t;
            a[kk][0] = *reinterpret_cast<const u32*>(row0);
            a[kk][1] = *reinterpret_cast<const u32*>(row0 + 8 * K);
            a[kk][2] = *reinterpret_cast<const u32*>(row0 + 8);
            a[kk][3] = *reinterpret_cast<const u32*>(row0 + 8 * K + 8);
        }
    }
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();

    float d[N / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        const u64 db = TRANS_B ? desc_mn_major<K>(sB, kk) : desc_k_major<N>(sB, kk);
        if constexpr (A_REGS) wgmma_rs<N, TRANS_B>(d, a[kk], db, kk > 0);
        else wgmma_ss<N, TRANS_B>(d, desc_k_major<64>(sA, kk), db, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(d);

#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * w + g + 8 * h, col = 8 * j + 2 * t;
            C[row * N + col] = d[4 * j + 2 * h];
            C[row * N + col + 1] = d[4 * j + 2 * h + 1];
        }
}
#endif  // PROBE_N

// ---------------------------------------------------------------------------------------
// Attention forward prototype
// ---------------------------------------------------------------------------------------
// Strides in elements; lse of (b, h, row) at b * st_sb + h * st_sh + row (fp32, natural log).
struct Sm90FwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;
    i64 q_sb, q_ss, q_sh;
    i64 k_sb, k_ss, k_sh;
    i64 v_sb, v_ss, v_sh;
    i64 o_sb, o_ss, o_sh;
    i64 st_sb, st_sh;
    int B, H, S;
    float scale_log2;  // softmax_scale * log2(e)
};
static_assert(sizeof(Sm90FwdParams) == 168, "scripts/probe_sm90.py packs 168 bytes");

template <int D, int BN>
struct Sm90FwdTraits {
    static_assert(D == 64 || D == 128, "fwd_sm90: head_dim 64 or 128");
    static_assert(BN == 64 || BN == 128, "fwd_sm90: key tile 64 or 128");
    static constexpr int BM = 128, NTHREADS = 256;
    static constexpr int Q_BYTES = BM * D * 2;
    static constexpr int KV_BYTES = BN * D * 2;           // one K or one V tile
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;      // K, then V
    static constexpr int SMEM = Q_BYTES + 2 * STAGE_BYTES + kAtomBytes;  // + alignment slack
};

#ifdef FWD_D
template <int D, int BN>
__device__ void fwd_sm90_body(const Sm90FwdParams& p) {
    using T = Sm90FwdTraits<D, BN>;
    constexpr int BM = T::BM, NT = T::NTHREADS;
    extern __shared__ unsigned char smem_raw[];
    const u32 sQ = align_atom(smem_u32(smem_raw));
    const u32 sKV = sQ + T::Q_BYTES;  // stage s: K at sKV + s * STAGE_BYTES, V KV_BYTES after it

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, w = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
    const int n_blocks = p.S / BN;

    const u16* gk = p.k + b * p.k_sb + h * p.k_sh;
    const u16* gv = p.v + b * p.v_sb + h * p.v_sh;
    load_tile_sw128<BM, D, NT>(sQ, p.q + b * p.q_sb + (i64)m0 * p.q_ss + h * p.q_sh, p.q_ss, tid);
    auto load_kv = [&](int stage, int j) {
        const u32 sK = sKV + stage * T::STAGE_BYTES;
        load_tile_sw128<BN, D, NT>(sK, gk + (i64)j * BN * p.k_ss, p.k_ss, tid);
        load_tile_sw128<BN, D, NT>(sK + T::KV_BYTES, gv + (i64)j * BN * p.v_ss, p.v_ss, tid);
    };
    load_kv(0, 0);
    cp_async_commit();

    // This warpgroup's 64 query rows: rows 64*wg.. of every column block of the Q tile.
    const u32 sQw = sQ + wg * 64 * kSwizzleBytes;

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float row_max[2] = {-FRT_INF, -FRT_INF}, row_sum[2] = {0.f, 0.f};

    for (int it = 0; it < n_blocks; ++it) {
        const int stage = it & 1;
        cp_async_wait<0>();
        fence_proxy_async();  // this thread's cp.async writes -> visible to wgmma (async proxy)
        __syncthreads();      // everyone's writes landed; everyone is done with the other stage
        if (it + 1 < n_blocks) load_kv(stage ^ 1, it + 1);
        cp_async_commit();

        const u32 sK = sKV + stage * T::STAGE_BYTES, sV = sK + T::KV_BYTES;

        // S = Q K^T (64 x BN per warpgroup)
        float s[BN / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_ss<BN, 0>(s, desc_k_major<BM>(sQw, kk), desc_k_major<BN>(sK, kk), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operand(s);

        // Online softmax, base 2. Thread rows: 16w + g (hh = 0) and 16w + g + 8 (hh = 1);
        // s[4j + 2hh + e] is column 8j + 2t + e; the 4 lanes t of a row share it.
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float mx = -FRT_INF;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hh], s[4 * j + 2 * hh + 1]));
            const float m_new = fmaxf(row_max[hh], warp_max4(mx) * p.scale_log2);  // finite: no masks
            const float alpha = fast_exp2(row_max[hh] - m_new);
            row_max[hh] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[4 * j + 2 * hh + e];
                    x = fast_exp2(fmaf(x, p.scale_log2, -m_new));
                    sum += x;
                }
            row_sum[hh] = row_sum[hh] * alpha + sum;
#pragma unroll
            for (int j = 0; j < D / 8; ++j) o[4 * j + 2 * hh] *= alpha, o[4 * j + 2 * hh + 1] *= alpha;
        }

        // O += P V: P (bf16) from registers, V MN-major.
        u32 pa[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) acc_to_a_frag(s, kk, pa[kk]);
        wgmma_fence();  // orders the o rescale and the pa writes before the wgmmas that read them
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs<D, 1>(o, pa[kk], desc_mn_major<BN>(sV, kk), 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operand(o);
    }
    cp_async_wait<0>();  // the last (empty) group

    // Epilogue: normalise, LSE, stage O (bf16) into this warpgroup's own 64 Q rows (sw128
    // layout: conflict-free), then 16-byte coalesced stores. Only this warpgroup read those
    // rows and its wgmmas are complete, so no CTA-wide barrier is needed.
    float* glse = p.lse + b * p.st_sb + h * p.st_sh + m0 + wg * 64;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const float sum = warp_sum4(row_sum[hh]);
        const float inv = 1.f / sum;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) o[4 * j + 2 * hh] *= inv, o[4 * j + 2 * hh + 1] *= inv;
        if (t == 0) glse[16 * w + g + 8 * hh] = (row_max[hh] + __log2f(sum)) * kLn2;
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = 16 * w + g + 8 * hh;  // row within the warpgroup's 64
            const u32 at = sQw + sw128_offset<BM>(r, j) + 4 * t;
            const u32 val = pack_bf16(o[4 * j + 2 * hh], o[4 * j + 2 * hh + 1]);
            asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at), "r"(val));
        }
    if (wg == 0) warpgroup_bar<1>();
    else warpgroup_bar<2>();
    u16* go = p.o + b * p.o_sb + (i64)(m0 + wg * 64) * p.o_ss + h * p.o_sh;
    constexpr int CPR = D / 8;
    const int wtid = tid & 127;
#pragma unroll
    for (int i = 0; i < 64 * CPR / 128; ++i) {
        const int idx = wtid + i * 128, r = idx / CPR, c = idx % CPR;
        uint4 val;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w) : "r"(sQw + sw128_offset<BM>(r, c)));
        *reinterpret_cast<uint4*>(go + (i64)r * p.o_ss + c * 8) = val;
    }
}
#endif  // FWD_D

}  // namespace sm90
}  // namespace frt

#ifdef PROBE_N
extern "C" __global__ void __launch_bounds__(128, 1) probe_gemm(const u16* A, const u16* B, float* C) {
    frt::sm90::probe_gemm_body<PROBE_N, PROBE_K, PROBE_TRANS_B, PROBE_A_REGS != 0>(A, B, C);
}
#endif

#ifdef FWD_D
static_assert(frt::sm90::Sm90FwdTraits<FWD_D, FWD_BN>::SMEM == FWD_SMEM_BYTES,
              "scripts/probe_sm90.py and the kernel disagree on dynamic shared memory");
extern "C" __global__ void __launch_bounds__(256, 1) fwd_sm90(const frt::sm90::Sm90FwdParams p) {
    frt::sm90::fwd_sm90_body<FWD_D, FWD_BN>(p);
}
#endif
