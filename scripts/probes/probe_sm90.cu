// Hopper wgmma unit probes (sm_90a only; not used by the library), compiled with -D defines by
// scripts/probes/probe_sm90.py:
//
//   probe_gemm  (-DPROBE_N=64|128 -DPROBE_K=<multiple of 64> -DPROBE_TRANS_B=0|1 -DPROBE_A_REGS=0|1)
//     One warpgroup, one tile: C[64 x N] (fp32, row-major) =
//       TRANS_B = 0: A[64 x K] * B[N x K]^T   (B K-major, like K in S = Q K^T)
//       TRANS_B = 1: A[64 x K] * B2[K x N]    (B MN-major, like V in O = P V)
//     A from shared memory by descriptor (A_REGS = 0) or from registers (A_REGS = 1, the
//     fragments read straight from global memory in the documented register layout).
//     The unit test of the descriptors, the swizzle and the fragment layouts.
//
//   The kernels these probes led to: kernels_cu/sm90/fwd_sm90.cu (the forward) and bwd_dq_sm90.cu /
//   bwd_dkdv_sm90.cu (the split backward), timed by scripts/dense_ab.py, scripts/kernel_times.py
//   and scripts/bench.py; their measurements in docs/perf-notes.md ("Forward: wgmma (fwd_sm90)", "The dK/dV kernel") (the dK/dV prototype that preceded
//   bwd_dkdv_sm90.cu lived here: git history).
#include "common/wgmma.cuh"

namespace frt {
namespace sm90 {

// A whole tile (the probes have no ragged edges).
template <int ROWS, int COLS, int NTHREADS>
FRT_DEVICE void load_whole_tile(u32 s_tile, const u16* g, i64 g_stride, int tid) {
    load_tile_sw128<ROWS, COLS, NTHREADS>(s_tile, g, g_stride, ROWS, tid);
}

#ifdef PROBE_N
template <int N, int K, int TRANS_B, bool A_REGS>
__device__ void probe_gemm_body(const u16* A, const u16* B, float* C) {
    static_assert(K % 64 == 0 && N % 64 == 0, "probe: K and N are multiples of 64");
    constexpr int KSTEPS = K / 16;
    extern __shared__ unsigned char smem_raw[];
    const u32 sA = align_atom(smem_u32(smem_raw));  // 64 x K, K-major
    const u32 sB = sA + 64 * K * 2;                  // N x K (TRANS_B = 0) or K x N (TRANS_B = 1)
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;

    load_whole_tile<64, K, 128>(sA, A, K, tid);
    if constexpr (TRANS_B) load_whole_tile<K, N, 128>(sB, B, N, tid);
    else load_whole_tile<N, K, 128>(sB, B, K, tid);
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

}  // namespace sm90
}  // namespace frt

#ifdef PROBE_N
extern "C" __global__ void __launch_bounds__(128, 1) probe_gemm(const u16* A, const u16* B, float* C) {
    frt::sm90::probe_gemm_body<PROBE_N, PROBE_K, PROBE_TRANS_B, PROBE_A_REGS != 0>(A, B, C);
}
#endif
