// Attention backward, preprocess: per query row,
//   delta = rowsum(dO o O)                          (fp32)
//   lse2  = lse * log2(e), or +inf where lse = -inf (the row saw no key, so P = 0)
//   dq_accum row = 0 (fused backward only: bwd_dkdv.cu adds into it)
// One warp per (b, h, i) row; each lane reads 16 bytes of O and dO. O and dO have p.head_dim_v columns (v's), dq_accum
// rows T::D (the backward kernels' head_dim: at least q's, more where they pad it, tiles.sm90_head_dim).
#include "attention/params.cuh"

namespace frt {

template <class T>
__device__ void bwd_preprocess(const BwdParams& p) {
    const int lane = threadIdx.x & 31;
    const i64 rows = (i64)p.B * p.H * p.Sq;
    const i64 stride = (i64)gridDim.x * T::NW;
    for (i64 r = (i64)blockIdx.x * T::NW + (threadIdx.x >> 5); r < rows; r += stride) {
        const int i = (int)(r % p.Sq);
        const i64 bh = r / p.Sq;
        const int h = (int)(bh % p.H), b = (int)(bh / p.H);
        float acc = 0.f;
        for (int c = lane * 8; c < p.head_dim_v; c += 32 * 8) {
            const uint4 ov = *reinterpret_cast<const uint4*>(p.o + b * p.o_sb + (i64)i * p.o_ss + h * p.o_sh + c);
            const uint4 dv =
                *reinterpret_cast<const uint4*>(p.dout + b * p.do_sb + (i64)i * p.do_ss + h * p.do_sh + c);
            acc = dot8<T::BF16>(ov, dv, acc);
        }
        if (p.dq_accum && !p.dq_first_store)  // (dq_first_store: the fused kernel's first turns store)
            for (int c = lane * 4; c < T::D; c += 32 * 4)
                *reinterpret_cast<float4*>(p.dq_accum + r * T::D + c) = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) {
            p.delta[r] = acc;
            p.lse2[r] = lse2_of(p.lse[r]);
        }
    }
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(ElementwiseTraits, bwd_preprocess, BwdParams)
#endif
