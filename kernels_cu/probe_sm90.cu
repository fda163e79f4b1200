// Hopper wgmma unit probes (sm_90a only; not used by the library), compiled with -D defines by
// scripts/probe_sm90.py:
//
//   probe_gemm  (-DPROBE_N=64|128 -DPROBE_K=<multiple of 64> -DPROBE_TRANS_B=0|1 -DPROBE_A_REGS=0|1)
//     One warpgroup, one tile: C[64 x N] (fp32, row-major) =
//       TRANS_B = 0: A[64 x K] * B[N x K]^T   (B K-major, like K in S = Q K^T)
//       TRANS_B = 1: A[64 x K] * B2[K x N]    (B MN-major, like V in O = P V)
//     A from shared memory by descriptor (A_REGS = 0) or from registers (A_REGS = 1, the
//     fragments read straight from global memory in the documented register layout).
//     The unit test of the descriptors, the swizzle and the fragment layouts.
//
//   dkdv_sm90   (-DDKDV_D=64|128 -DDKDV_BM=64 -DDKDV_SMEM_BYTES=<Sm90DkdvTraits::SMEM>)
//     PROTOTYPE of the attention backward's dK / dV with wgmma (the library's kernel it became is
//     kernels_cu/bwd_dkdv_sm90.cu, with GQA, masks, ragged tiles and splits):
//       P^T = exp2(scale_log2 * K Q^T - lse2),  dS^T = P^T o (V dO^T - delta),
//       dV = P^T dO,  dK = scale * dS^T Q
//     bf16, non-causal, no masks, MHA, Sq = Sk = S a multiple of 128, (B, S, H, D) tensors with
//     element strides, lse2 / delta fp32 (B, H, S) as bwd_preprocess.cu writes them. Key-major:
//     grid (S/128, H, B), 256 threads = two warpgroups of 64 keys each; K and V (128 x D) loaded
//     once, Q / dO tiles of BM = 64 query rows (+ their lse2 / delta) double-buffered by cp.async.
//     Per query tile and warpgroup: S^T, dP^T = wgmma SS (64 x BM, A = K / V rows K-major,
//     B = Q / dO K-major); P^T, dS^T on the fp32 fragments (accumulator column = query row);
//     dV += P^T dO, dK += dS^T Q = wgmma RS (A = P^T / dS^T as bf16 register fragments, B = dO / Q
//     MN-major, N = D). No shared-memory round trip for P or dS.
//
//   The attention forward that the first prototype of this file became is kernels_cu/fwd_sm90.cu
//   (timed by scripts/dense_ab.py and scripts/bench.py; its history in docs/perf-notes.md).
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
// dK / dV backward prototype
// ---------------------------------------------------------------------------------------
// Strides in elements; lse2 / delta of (b, h, row) at b * st_sb + h * st_sh + row (fp32).
struct Sm90DkdvParams {
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* dout;
    const float* lse2;   // lse * log2(e)
    const float* delta;  // rowsum(dO o O)
    u16* dk;
    u16* dv;
    i64 q_sb, q_ss, q_sh;
    i64 k_sb, k_ss, k_sh;
    i64 v_sb, v_ss, v_sh;
    i64 do_sb, do_ss, do_sh;
    i64 dk_sb, dk_ss, dk_sh;
    i64 dv_sb, dv_ss, dv_sh;
    i64 st_sb, st_sh;
    int B, H, S;
    float scale;       // softmax scale: dK's factor
    float scale_log2;  // softmax scale * log2(e)
};
static_assert(sizeof(Sm90DkdvParams) == 248, "scripts/probe_sm90.py packs 248 bytes");

template <int D, int BM>
struct Sm90DkdvTraits {
    static_assert(D == 64 || D == 128, "dkdv_sm90: head_dim 64 or 128");
    static_assert(BM == 64, "dkdv_sm90: query tiles of 64 rows (S^T is one m64n64 accumulator per warpgroup)");
    static constexpr int BN = 128, NTHREADS = 256;      // keys per CTA: two warpgroups x 64
    static constexpr int KV_BYTES = BN * D * 2;          // the K tile, or the V tile
    static constexpr int QT_BYTES = BM * D * 2;          // one Q or dO tile
    static constexpr int STAGE_BYTES = 2 * QT_BYTES;     // Q, then dO (both stay 1024-byte aligned)
    static constexpr int STAT_STAGE_BYTES = 2 * BM * 4;  // lse2[BM], then delta[BM]
    static constexpr int SMEM = 2 * KV_BYTES + 2 * STAGE_BYTES + 2 * STAT_STAGE_BYTES + kAtomBytes;  // + align slack
};

#ifdef DKDV_D
template <int D, int BM>
__device__ void dkdv_sm90_body(const Sm90DkdvParams& p) {
    using T = Sm90DkdvTraits<D, BM>;
    constexpr int BN = T::BN, NT = T::NTHREADS;
    extern __shared__ unsigned char smem_raw[];
    const u32 smem_base = smem_u32(smem_raw);
    const u32 sK = align_atom(smem_base), sV = sK + T::KV_BYTES;
    const u32 sQdO = sV + T::KV_BYTES;              // stage s: Q at sQdO + s * STAGE_BYTES, dO QT_BYTES after
    const u32 sStat = sQdO + 2 * T::STAGE_BYTES;    // stage s: lse2[BM], delta[BM] at sStat + s * STAT_STAGE_BYTES
    const float* stat_base = reinterpret_cast<const float*>(smem_raw + (sStat - smem_base));

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, w = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * BN, h = blockIdx.y, b = blockIdx.z;
    const int n_tiles = p.S / BM;

    load_tile_sw128<BN, D, NT>(sK, p.k + b * p.k_sb + (i64)n0 * p.k_ss + h * p.k_sh, p.k_ss, tid);
    load_tile_sw128<BN, D, NT>(sV, p.v + b * p.v_sb + (i64)n0 * p.v_ss + h * p.v_sh, p.v_ss, tid);
    const u16* gq = p.q + b * p.q_sb + h * p.q_sh;
    const u16* gdo = p.dout + b * p.do_sb + h * p.do_sh;
    const i64 st0 = b * p.st_sb + h * p.st_sh;
    auto load_q = [&](int stage, int m) {
        const u32 sQ = sQdO + stage * T::STAGE_BYTES;
        load_tile_sw128<BM, D, NT>(sQ, gq + (i64)m * BM * p.q_ss, p.q_ss, tid);
        load_tile_sw128<BM, D, NT>(sQ + T::QT_BYTES, gdo + (i64)m * BM * p.do_ss, p.do_ss, tid);
        // lse2 and delta of the tile's rows: BM / 4 16-byte chunks each (S % 128 == 0 keeps them aligned).
        if (tid < BM / 2) {
            constexpr int CH = BM / 4;
            const int which = tid / CH, c = tid % CH;
            cp_async16_full(sStat + stage * T::STAT_STAGE_BYTES + which * BM * 4 + 16 * c,
                            (which ? p.delta : p.lse2) + st0 + (i64)m * BM + 4 * c);
        }
    };
    load_q(0, 0);
    cp_async_commit();  // one group: K, V and the first query tile

    // This warpgroup's 64 keys: rows 64 wg.. of every column block of the K and V tiles. Its
    // accumulators (wgmma.cuh layout): S^T / dP^T element [4 j + 2 hh + e] is key 16 w + g + 8 hh,
    // query 8 j + 2 t + e of the tile; dK / dV element [4 j + 2 hh + e] is key 16 w + g + 8 hh,
    // head_dim column 8 j + 2 t + e.
    const u32 sKw = sK + wg * 64 * kSwizzleBytes, sVw = sV + wg * 64 * kSwizzleBytes;
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = 0.f, dv[i] = 0.f;

    for (int it = 0; it < n_tiles; ++it) {
        const int stage = it & 1;
        cp_async_wait<0>();
        fence_proxy_async();  // this thread's cp.async writes -> visible to wgmma (async proxy)
        // Every thread's writes landed; both warpgroups finished iteration it - 1 (its wgmmas were
        // waited for), so the other stage, Q / dO / lse2 / delta alike, may be refilled.
        __syncthreads();
        if (it + 1 < n_tiles) load_q(stage ^ 1, it + 1);
        cp_async_commit();
        const u32 sQ = sQdO + stage * T::STAGE_BYTES, sdO = sQ + T::QT_BYTES;
        const float* s_lse2 = stat_base + stage * (T::STAT_STAGE_BYTES / 4);
        const float* s_delta = s_lse2 + BM;

        // S^T = K_w Q^T and dP^T = V_w dO^T (64 x BM each, k = head_dim): two groups, so the
        // exponentials of P^T run while dP^T is still in flight.
        float s[BM / 2], dp[BM / 2];
        wgmma_fence();  // orders the dK / dV accumulator writes (zeroing, last iteration) before the wgmmas
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_ss<BM, 0>(s, desc_k_major<BN>(sKw, kk), desc_k_major<BM>(sQ, kk), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_ss<BM, 0>(dp, desc_k_major<BN>(sVw, kk), desc_k_major<BM>(sdO, kk), kk > 0);
        wgmma_commit();

        wgmma_wait<1>();  // S^T is complete (dP^T may not be: its registers are not touched yet)
        fence_operand(s);
        // P^T = exp2(S^T * scale_log2 - lse2[query]); the column of the fragment is the query.
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
            const float2 l = *reinterpret_cast<const float2*>(s_lse2 + 8 * j + 2 * t);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                s[4 * j + 2 * hh] = fast_exp2(fmaf(s[4 * j + 2 * hh], p.scale_log2, -l.x));
                s[4 * j + 2 * hh + 1] = fast_exp2(fmaf(s[4 * j + 2 * hh + 1], p.scale_log2, -l.y));
            }
        }
        u32 pa[BM / 16][4];
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2>(s, kk, pa[kk]);

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
        for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2>(dp, kk, dsa[kk]);

        // dV_w += P^T dO and dK_w += dS^T Q (64 x D, k = the BM queries): A from registers, B
        // MN-major (the [query][head_dim] tiles read as K x N).
        wgmma_fence();  // orders the pa / dsa writes before the wgmmas that read them
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<D, 1>(dv, pa[kk], desc_mn_major<BM>(sdO, kk), 1);
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<D, 1>(dk, dsa[kk], desc_mn_major<BM>(sQ, kk), 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operand(dv);
        fence_operand(dk);
    }
    cp_async_wait<0>();  // the last (empty) group
    __syncthreads();     // all copies landed and every wgmma is complete before K / V are overwritten

    // Epilogue: stage scale * dK (bf16) into this warpgroup's own 64 rows of the K tile and dV into
    // its rows of the V tile (only it read them), then 16-byte coalesced stores.
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const u32 at = sw128_offset<BN>(64 * wg + 16 * w + g + 8 * hh, j) + 4 * t;
            const u32 vk = pack_bf16(dk[4 * j + 2 * hh] * p.scale, dk[4 * j + 2 * hh + 1] * p.scale);
            const u32 vv = pack_bf16(dv[4 * j + 2 * hh], dv[4 * j + 2 * hh + 1]);
            asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(sK + at), "r"(vk) : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(sV + at), "r"(vv) : "memory");
        }
    if (wg == 0)
        warpgroup_bar<1>();
    else
        warpgroup_bar<2>();
    u16* gdk = p.dk + b * p.dk_sb + (i64)(n0 + 64 * wg) * p.dk_ss + h * p.dk_sh;
    u16* gdv = p.dv + b * p.dv_sb + (i64)(n0 + 64 * wg) * p.dv_ss + h * p.dv_sh;
    constexpr int CPR = D / 8;
    const int wtid = tid & 127;
#pragma unroll
    for (int i = 0; i < 64 * CPR / 128; ++i) {
        const int idx = wtid + i * 128, r = idx / CPR, c = idx % CPR;
        const u32 at = sw128_offset<BN>(64 * wg + r, c);
        uint4 a, bv;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w) : "r"(sK + at) : "memory");
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(bv.x), "=r"(bv.y), "=r"(bv.z), "=r"(bv.w) : "r"(sV + at) : "memory");
        *reinterpret_cast<uint4*>(gdk + (i64)r * p.dk_ss + c * 8) = a;
        *reinterpret_cast<uint4*>(gdv + (i64)r * p.dv_ss + c * 8) = bv;
    }
}
#endif  // DKDV_D

}  // namespace sm90
}  // namespace frt

#ifdef PROBE_N
extern "C" __global__ void __launch_bounds__(128, 1) probe_gemm(const u16* A, const u16* B, float* C) {
    frt::sm90::probe_gemm_body<PROBE_N, PROBE_K, PROBE_TRANS_B, PROBE_A_REGS != 0>(A, B, C);
}
#endif

#ifdef DKDV_D
static_assert(frt::sm90::Sm90DkdvTraits<DKDV_D, DKDV_BM>::SMEM == DKDV_SMEM_BYTES,
              "scripts/probe_sm90.py and the kernel disagree on dynamic shared memory");
extern "C" __global__ void __launch_bounds__(256, 1) dkdv_sm90(const frt::sm90::Sm90DkdvParams p) {
    frt::sm90::dkdv_sm90_body<DKDV_D, DKDV_BM>(p);
}
#endif
