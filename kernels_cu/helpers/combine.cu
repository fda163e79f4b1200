// Merge attention results computed over disjoint key ranges: out = sum_s w_s out_s, w_s = exp(lse_s - lse),
// lse = log(sum_s exp(lse_s)); the parts are added in index order, so the result is bitwise reproducible.
// A part whose lse is -inf saw no key (weight 0); a NaN lse (decode.cu: a bad cache value) makes the row NaN. With
// sinks (decode's), each row's head sink joins as one more part with lse = sink and no value.
//
// combine: warps per (b, token, head) row, grid-stride; lane l holds columns 8l .. 8l + 7 (and the lse of parts
// l, l + 32, ...): many parts over few rows (decode's splits). combine_rows (FRT_COMBINE_ROWS = 1): a thread per
// (row, 8 columns), each over every part: few parts over many rows (context parallelism, cascades), where a warp per
// row ran latency-bound (docs/perf-notes.md, Context parallelism). Families (spec.FAMILIES): FRT_PART_F32 = 1: fp32
// parts (decode.cu's partials), else parts of the 16-bit dtype; FRT_OUT_F32 = 1: fp32 out.
#include "attention/params.cuh"

namespace frt {

template <bool F32, bool BF16>
FRT_DEVICE void load8(const void* base, i64 at, float (&x)[8]) {
    if constexpr (F32) {
        const float4* v = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(base) + at);
        const float4 a = v[0], c = v[1];
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = c.x, x[5] = c.y, x[6] = c.z, x[7] = c.w;
    } else {
        const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(base) + at);
        const u16* h = reinterpret_cast<const u16*>(&v);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = Elem<BF16>::to_float(h[e]);
    }
}

template <bool OUT_F32, bool BF16>
FRT_DEVICE void store8(void* base, i64 at, const float (&x)[8]) {
    if constexpr (OUT_F32) {
        float4* out = reinterpret_cast<float4*>(reinterpret_cast<float*>(base) + at);
        out[0] = make_float4(x[0], x[1], x[2], x[3]);
        out[1] = make_float4(x[4], x[5], x[6], x[7]);
    } else {
        uint4 v;
        v.x = Elem<BF16>::pack(x[0], x[1]), v.y = Elem<BF16>::pack(x[2], x[3]);
        v.z = Elem<BF16>::pack(x[4], x[5]), v.w = Elem<BF16>::pack(x[6], x[7]);
        *reinterpret_cast<uint4*>(reinterpret_cast<u16*>(base) + at) = v;
    }
}

#ifndef FRT_COMBINE_EARLY
#define FRT_COMBINE_EARLY 1  // a warp's first parts load beside the lse values (0: after them; A/B timing)
#endif

// At most COMBINE_MAX_PARTS parts: lane l holds the lse of parts l, l + 32, ... (their loads in flight together).
constexpr int PARTS_PER_LANE = 8;
static_assert(32 * PARTS_PER_LANE == 256, "flashrt/decoding.py: COMBINE_MAX_PARTS");

template <class T>
__device__ void combine(const CombineParams& p) {
    constexpr bool PART_F32 = FRT_PART_F32, OUT_F32 = FRT_OUT_F32;
    constexpr int WARPS = T::NW;
    // p.row_warps warps per row (1, 2, 4 or 8: more where there are many parts and few rows), each over the parts
    // wr, wr + row_warps, ...; their sums meet in shared memory and add in warp order.
    __shared__ __align__(16) float partial[WARPS][256];
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, c = lane * 8;
    const int rw = p.row_warps, wr = warp % rw, rows_per_block = WARPS / rw;
    const i64 rows = (i64)p.B * p.Sq * p.H;
    // decode_combine on sm_90 is decode.cu's programmatic dependent (spec.KernelSpec.programmatic): it was launched
    // while decode ran, and its partials are complete and visible only from here.
    wait_previous_grid();
    for (i64 base = (i64)blockIdx.x * rows_per_block; base < rows; base += (i64)gridDim.x * rows_per_block) {
        const i64 row = base + warp / rw;
        const bool live = row < rows;
        // row = (b * Sq + i) * H + h, as in out; lse is (B, H, Sq)
        const int h = (int)(row % p.H), i = (int)(row / p.H % p.Sq), b = (int)(row / ((i64)p.H * p.Sq));
        const i64 st = ((i64)b * p.H + h) * p.Sq + i, st_rows = (i64)p.B * p.H * p.Sq;
        // This warp's first BATCH parts load beside the lse values, not after them (one round trip less; a part of
        // weight 0 is then read but not added).
        constexpr int BATCH = 4;
        constexpr bool EARLY = FRT_COMBINE_EARLY;
        float first[BATCH][8];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int s = wr + u * rw;
            if (EARLY && live && s < 32 && s < p.n && c < p.D)
                load8<PART_F32, T::BF16>(p.o_part, (s * rows + row) * p.D + c, first[u]);
        }
        float w[PARTS_PER_LANE], m = -FRT_INF;
        bool nan = false;
#pragma unroll
        for (int k = 0; k < PARTS_PER_LANE; ++k) {
            const int s = lane + 32 * k;
            w[k] = live && s < p.n ? p.lse_part[s * st_rows + st] : -FRT_INF;
            nan |= w[k] != w[k];
            m = fmaxf(m, w[k]);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        nan = __any_sync(0xffffffffu, nan);
        // The head's sink: one more part, lse = sink, no value (softmax.cuh: add_sink).
        const float sink = p.sinks && live ? p.sinks[h] : -FRT_INF;
        m = fmaxf(m, sink);
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < PARTS_PER_LANE; ++k) {
            w[k] = w[k] == -FRT_INF ? 0.f : expf(w[k] - m);
            sum += w[k];
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (sink != -FRT_INF) sum += expf(sink - m);
        // This warp's parts in index order; past the first batch a part of weight 0 is not read. BATCH parts' loads
        // are issued together, then added in order (loaded one at a time, 8 splits took 8.2 us, batched 6.8: H100
        // ncu; docs/perf-notes.md, Decode: splits and the combine).
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < PARTS_PER_LANE; ++k) {
            if (32 * k >= p.n) break;
#pragma unroll 1
            for (int t0 = wr; t0 < 32 && 32 * k + t0 < p.n; t0 += BATCH * rw) {
                float ws[BATCH], x[BATCH][8];
#pragma unroll
                for (int u = 0; u < BATCH; ++u) {
                    const int t = t0 + u * rw, s = 32 * k + t;
                    ws[u] = __shfl_sync(0xffffffffu, w[k], t & 31);  // (t is the warp's: every lane takes part)
                    if (t >= 32 || s >= p.n || c >= p.D) ws[u] = 0.f;
                    if (EARLY && k == 0 && t0 == wr) {
#pragma unroll
                        for (int e = 0; e < 8; ++e) x[u][e] = first[u][e];
                    } else if (ws[u] != 0.f) {
                        load8<PART_F32, T::BF16>(p.o_part, (s * rows + row) * p.D + c, x[u]);
                    }
                }
#pragma unroll
                for (int u = 0; u < BATCH; ++u)
                    if (ws[u] != 0.f)
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[e] = fmaf(ws[u], x[u][e], acc[e]);
            }
        }
        if (rw > 1) {
            if (c < p.D) {
                *reinterpret_cast<float4*>(&partial[warp][c]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
                *reinterpret_cast<float4*>(&partial[warp][c + 4]) = make_float4(acc[4], acc[5], acc[6], acc[7]);
            }
            __syncthreads();
            if (wr == 0 && c < p.D) {
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = 0.f;
                for (int x = 0; x < rw; ++x)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[e] += partial[warp + x][c + e];
            }
            __syncthreads();  // (the next rows' sums overwrite these)
        }
        if (wr != 0 || !live) continue;
        const float inv = sum > 0.f ? 1.f / sum : 0.f, qnan = __int_as_float(0x7fffffff);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = nan ? qnan : acc[e] * inv;
        if (c < p.D) store8<OUT_F32, T::BF16>(p.o, row * p.D + c, acc);
        if (lane == 0) p.lse[st] = nan ? qnan : sum > 0.f ? m + logf(sum) : -FRT_INF;
    }
}

// A thread per (row, 8 columns): the row's lse values (a row's threads read the same ones, from L1), then its
// parts. 8 columns, BATCH loads in flight, added in index order.
template <class T>
__device__ void combine_rows(const CombineParams& p) {
    constexpr bool PART_F32 = FRT_PART_F32, OUT_F32 = FRT_OUT_F32;
    constexpr int BATCH = 2;
    const int C8 = p.D / 8;
    const i64 rows = (i64)p.B * p.Sq * p.H, st_rows = (i64)p.B * p.H * p.Sq;
    const i64 items = rows * C8, step = (i64)gridDim.x * blockDim.x;
    for (i64 item = (i64)blockIdx.x * blockDim.x + threadIdx.x; item < items; item += step) {
        const i64 row = item / C8;  // = (b * Sq + i) * H + h, as in out; lse is (B, H, Sq)
        const int c = (int)(item % C8) * 8;
        const int h = (int)(row % p.H), i = (int)(row / p.H % p.Sq), b = (int)(row / ((i64)p.H * p.Sq));
        const i64 st = ((i64)b * p.H + h) * p.Sq + i;
        const float sink = p.sinks ? p.sinks[h] : -FRT_INF;
        float m = sink;
        bool nan = false;
        for (int s = 0; s < p.n; ++s) {
            const float l = p.lse_part[s * st_rows + st];
            nan |= l != l;
            m = fmaxf(m, l);
        }
        float sum = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int s0 = 0; s0 < p.n; s0 += BATCH) {
            float ws[BATCH], x[BATCH][8];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int s = s0 + u;
                const float l = s < p.n ? p.lse_part[s * st_rows + st] : -FRT_INF;
                ws[u] = l == -FRT_INF ? 0.f : expf(l - m);
                if (ws[u] != 0.f) load8<PART_F32, T::BF16>(p.o_part, (s * rows + row) * p.D + c, x[u]);
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                sum += ws[u];  // (0 past the last part)
                if (ws[u] != 0.f)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[e] = fmaf(ws[u], x[u][e], acc[e]);
            }
        }
        if (sink != -FRT_INF) sum += expf(sink - m);
        const float inv = sum > 0.f ? 1.f / sum : 0.f, qnan = __int_as_float(0x7fffffff);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = nan ? qnan : acc[e] * inv;
        store8<OUT_F32, T::BF16>(p.o, row * p.D + c, acc);
        if (c == 0) p.lse[st] = nan ? qnan : sum > 0.f ? m + logf(sum) : -FRT_INF;
    }
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
#if FRT_COMBINE_ROWS
FRT_ENTRY(ElementwiseTraits, combine_rows, CombineParams)
#else
FRT_ENTRY(ElementwiseTraits, combine, CombineParams)
#endif
#endif
