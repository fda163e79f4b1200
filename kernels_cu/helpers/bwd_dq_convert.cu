// Attention backward, last step of the fused variants (bwd_dkdv.cu, bwd_dkdv_sm90.cu):
//   dQ = scale * dq_accum, cast to 16-bit and written through dq's strides.
// One thread per 8 consecutive head_dim elements of one (b, h, query) row: T::D in dq_accum, of which dq holds the
// first p.head_dim (q's; fewer where the kernel's D is v's or a padded instance, tiles.sm90_head_dim).
#include "attention/params.cuh"

namespace frt {

template <class T>
__device__ void bwd_dq_convert(const BwdParams& p) {
    constexpr int CHUNKS = T::D / 8;
    const i64 total = (i64)p.B * p.H * p.Sq * CHUNKS;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < total; c += stride) {
        const int col = (int)(c % CHUNKS) * 8;
        const i64 row = c / CHUNKS;  // (b, h, query) row of dq_accum
        const int i = (int)(row % p.Sq);
        const i64 bh = row / p.Sq;
        const int h = (int)(bh % p.H), b = (int)(bh / p.H);
        if (col >= p.head_dim) continue;
        // bwd_fused_sm90: the row's 16-byte chunks are permuted (params.cuh: dq_slot)
        const int chunk = col >> 2;
        const float4* src = reinterpret_cast<const float4*>(p.dq_accum + row * T::D);
        const float4 lo = src[p.dq_swizzle ? dq_slot(chunk, row) : chunk];
        const float4 hi = src[p.dq_swizzle ? dq_slot(chunk + 1, row) : chunk + 1];
        uint4 out;
        out.x = Elem<T::BF16>::pack(lo.x * p.scale, lo.y * p.scale);
        out.y = Elem<T::BF16>::pack(lo.z * p.scale, lo.w * p.scale);
        out.z = Elem<T::BF16>::pack(hi.x * p.scale, hi.y * p.scale);
        out.w = Elem<T::BF16>::pack(hi.z * p.scale, hi.w * p.scale);
        *reinterpret_cast<uint4*>(p.dq + b * p.dq_sb + (i64)i * p.dq_ss + h * p.dq_sh + col) = out;
    }
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(ElementwiseTraits, bwd_dq_convert, BwdParams)
#endif
