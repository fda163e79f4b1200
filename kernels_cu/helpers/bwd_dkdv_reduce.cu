// Attention backward, dK/dV reduction for a split dK/dV pass (see bwd_dkdv.cu):
//   dK = scale * sum_s partial_dK[s],   dV = sum_s partial_dV[s]
// summed in split order s = 0, 1, ... (fixed, so the result is deterministic).
// One thread per 8 consecutive head_dim elements of one (b, key, kv head) row: T::D in the partials, of which dk holds
// the first p.head_dim and dv the first p.head_dim_v (params.cuh).
#include "attention/params.cuh"

namespace frt {

template <class T>
__device__ void bwd_dkdv_reduce(const BwdParams& p) {
    constexpr int CHUNKS = T::D / 8;
    const i64 per_split = (i64)p.B * p.Hkv * p.Sk * T::D;
    const i64 total = per_split / 8;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < total; c += stride) {
        const int col = (int)(c % CHUNKS) * 8;
        if (col >= max(p.head_dim, p.head_dim_v)) continue;  // (the columns of a padded instance)
        const i64 row = c / CHUNKS;  // (b, hk, key) row of the partial layout
        const int key = (int)(row % p.Sk);
        const i64 bh = row / p.Sk;
        const int hk = (int)(bh % p.Hkv), b = (int)(bh / p.Hkv);
        float dk[8] = {}, dv[8] = {};
        const float* src = p.dkv_partial + row * T::D + col;
        for (int s = 0; s < p.splits; ++s, src += per_split) {
            const float4* k4 = reinterpret_cast<const float4*>(src);
            const float4* v4 = reinterpret_cast<const float4*>(src + (i64)p.splits * per_split);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float4 a = k4[i], v = v4[i];
                dk[4 * i] += a.x, dk[4 * i + 1] += a.y, dk[4 * i + 2] += a.z, dk[4 * i + 3] += a.w;
                dv[4 * i] += v.x, dv[4 * i + 1] += v.y, dv[4 * i + 2] += v.z, dv[4 * i + 3] += v.w;
            }
        }
        uint4 ok, ov;
        u32* okw = reinterpret_cast<u32*>(&ok);
        u32* ovw = reinterpret_cast<u32*>(&ov);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            okw[i] = Elem<T::BF16>::pack(dk[2 * i] * p.scale, dk[2 * i + 1] * p.scale);
            ovw[i] = Elem<T::BF16>::pack(dv[2 * i], dv[2 * i + 1]);
        }
        if (col < p.head_dim)
            *reinterpret_cast<uint4*>(p.dk + b * p.dk_sb + (i64)key * p.dk_ss + hk * p.dk_sh + col) = ok;
        if (col < p.head_dim_v)
            *reinterpret_cast<uint4*>(p.dv + b * p.dv_sb + (i64)key * p.dv_ss + hk * p.dv_sh + col) = ov;
    }
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(ElementwiseTraits, bwd_dkdv_reduce, BwdParams)
#endif
