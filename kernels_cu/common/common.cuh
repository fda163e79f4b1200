// Device helpers shared by every kernel family.
//
// No CUDA header is included anywhere under kernels_cu/: everything below is
// inline PTX or an NVRTC builtin, so a kernel compiles the same way with any
// NVRTC 12.x/13.x and no runtime-header version can disagree with the compiler.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define FRT_INF __int_as_float(0x7f800000)
#define FRT_DEVICE __device__ __forceinline__

namespace frt {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int round_up(int a, int b) { return ceil_div(a, b) * b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------
// Shared-memory tile geometry. Rows are padded by 16 bytes: with a payload that
// is a multiple of 32 bytes, the row pitch is an odd multiple of 16 bytes, so
// the 8 row addresses of every ldmatrix phase and every 16-byte cp.async phase
// fall into 8 distinct 16-byte bank groups (no bank conflicts, for any head_dim).
// Where rows are a multiple of 128 bytes a kernel may take them unpadded and
// swizzled instead (chunk_at below; decode.cu, fwd.cu: spec.KernelSpec.swizzled).
// ---------------------------------------------------------------------------
template <int COLS>
struct Pitch {
    static_assert(COLS % 16 == 0, "tile columns must be a multiple of 16");
    static constexpr int elems = COLS + 8;
    static constexpr int bytes = elems * 2;
};

// The byte offset of 16-byte chunk `chunk` of row `row` in a shared tile of `pitch`-byte rows: as is in a padded
// tile (Pitch); with SWZ, an unpadded tile whose rows are a multiple of 128 bytes, at chunk ^ (row & 7), so that the
// 8 rows of an ldmatrix phase still fall into 8 distinct bank groups. A padded pitch costs cp.async: L1 fetched 1.5x a
// tile's sectors from L2, swizzled rows that start on 128-byte lines 1.0x (H200; docs/perf-notes.md, Decode: the
// loader).
template <bool SWZ>
FRT_DEVICE u32 chunk_at(int row, int chunk, int pitch) {
    return row * pitch + ((SWZ ? chunk ^ (row & 7) : chunk) << 4);
}
// The same for an ldmatrix lane's row, whose low 3 bits are the lane's (lane & 7) in every x4 / x2 phase below: the
// XOR then takes a value the warp computes once, not one per fragment (chunk_at per fragment spilled 8-12 bytes in
// the mma.sync forward at head_dim 128 / 256, NVRTC 12.9). sw: an operand that starts sw chunks into the rows' 128-byte
// line (its base at the line, swz_col), where sw's bits and those of every chunk read are disjoint: (sw + c) ^ x is
// then c ^ (x ^ sw).
template <bool SWZ>
FRT_DEVICE u32 lane_chunk_at(int row, int chunk, int pitch, int lane, int sw = 0) {
    return row * pitch + ((SWZ ? chunk ^ ((lane & 7) ^ sw) : chunk) << 4);
}
// An operand that starts `col` columns into a tile's rows: its base's byte offset and lane_chunk_at's sw. Padded, the
// column itself; swizzled, the column's 64-column line, and its chunk within the line as sw.
template <bool SWZ>
FRT_DEVICE u32 swz_col(int col) { return SWZ ? (col & ~63) * 2 : col * 2; }
template <bool SWZ>
FRT_DEVICE int swz_sw(int col) { return SWZ ? (col >> 3) & 7 : 0; }
// Whether an operand of n chunks per warp, at a multiple of n chunks into the row, meets lane_chunk_at's sw rule.
__host__ __device__ constexpr bool swz_disjoint(int n) { return n == 1 || n == 2 || n == 4 || n % 8 == 0; }

FRT_DEVICE u32 smem_u32(const void* p) {
    u32 r;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(r) : "l"(p));
    return r;
}

// ---------------------------------------------------------------------------
// Element types: bf16 and fp16 are carried as raw 16-bit words.
// ---------------------------------------------------------------------------
template <bool BF16>
struct Elem;

template <>
struct Elem<true> {
    static FRT_DEVICE u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static FRT_DEVICE float to_float(u16 x) { return __int_as_float(((u32)x) << 16); }
    static FRT_DEVICE void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <>
struct Elem<false> {
    static FRT_DEVICE u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static FRT_DEVICE float to_float(u16 x) {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
        return f;
    }
    static FRT_DEVICE void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// The backward's row statistics (bwd_preprocess.cu; bwd_dq_sm90.cu computes its own rows' too):
// acc + the sum of the products of two 16-byte vectors of eight 16-bit values (delta = rowsum(dO o O)),
// and lse2 = lse * log2(e), +inf where lse = -inf (the row saw no key: P = 0).
template <bool BF16>
FRT_DEVICE float dot8(uint4 a, uint4 b, float acc) {
    const u16* a8 = reinterpret_cast<const u16*>(&a);
    const u16* b8 = reinterpret_cast<const u16*>(&b);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(Elem<BF16>::to_float(a8[e]), Elem<BF16>::to_float(b8[e]), acc);
    return acc;
}
FRT_DEVICE float lse2_of(float lse) { return lse == -FRT_INF ? FRT_INF : lse * kLog2e; }

FRT_DEVICE float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// 2^x on the FMA units instead of the MUFU one (for x <= 0: softmax exponents after the row max), which the forward's
// online softmax takes for part of each row's elements where MUFU is the bottleneck (softmax.cuh: online_row). x =
// j + f with j = round(x), from the low mantissa bits of x + 1.5 * 2^23, and f in [-0.5, 0.5]; 2^f by a degree-3
// minimax polynomial (relative error 7.5e-5 in fp32, under bf16's and fp16's rounding of P); j added to the exponent
// field. 0 below -126, as ex2.approx.ftz flushes, and exactly 0 for a masked score's -inf (whose f is NaN); a NaN
// argument is returned (as ex2 propagates it).
FRT_DEVICE float poly_exp2(float x) {
    const float t = __fadd_rn(x, 12582912.f);              // (the _rn adds: never folded away)
    const float f = __fsub_rn(x, __fsub_rn(t, 12582912.f));  // x - round(x)
    const float p = fmaf(fmaf(fmaf(0.05517167f, f, 0.24261113f), f, 0.69326097f), f, 0.99992806f);
    const float r = __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
    return x < -126.f ? 0.f : __fadd_rn(r, __fsub_rn(x, x));  // (x - x: 0, or NaN for a NaN x)
}

FRT_DEVICE float fast_rcp(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}
FRT_DEVICE float fast_log2(float x) {
    float r;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

FRT_DEVICE float warp_max4(float x) {  // max over the 4 lanes that share a fragment row
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

FRT_DEVICE float warp_sum4(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A value the caller knows to be the same in every thread of the block (e.g. read back from
// shared memory after a block reduction), passed through lane 0 so that the compiler knows it
// too: ptxas serialises the wgmmas of a loop whose trip count it takes to be divergent.
FRT_DEVICE int block_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// The threads that search a tile's span together (mask.cuh: block_rank, fill_tile_intervals): a
// barrier, and one that counts the threads whose predicate holds. The whole block, or (NamedGroup)
// the THREADS threads of named barrier ID, for a kernel whose warpgroups cannot meet (fwd_sm90_ws).
struct WholeBlock {
    FRT_DEVICE void sync() const { __syncthreads(); }
    FRT_DEVICE int count(bool pred) const { return __syncthreads_count(pred); }
};
template <int ID, int THREADS>
struct NamedGroup {
    FRT_DEVICE void sync() const { asm volatile("bar.sync %0, %1;\n" :: "n"(ID), "n"(THREADS) : "memory"); }
    FRT_DEVICE int count(bool pred) const {
        u32 c;
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "setp.ne.u32 p, %1, 0;\n"
            "bar.red.popc.u32 %0, %2, %3, p;\n"
            "}\n" : "=r"(c) : "r"((u32)pred), "n"(ID), "n"(THREADS) : "memory");
        return (int)c;
    }
};

// ---------------------------------------------------------------------------
// ldmatrix / cp.async
// ---------------------------------------------------------------------------
FRT_DEVICE void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
FRT_DEVICE void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
FRT_DEVICE void ldsm_x2(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1) : "r"(addr));
}
FRT_DEVICE void ldsm_x2_t(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1) : "r"(addr));
}

// 16-byte global->shared copy; when !valid nothing is read and the 16 bytes are zeroed.
FRT_DEVICE void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
FRT_DEVICE void cp_async4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
FRT_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
FRT_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// Copy a ROWS x D tile (row stride g_stride elements, contiguous columns) into a
// padded shared tile of ROWS x DP. Rows >= rows_valid and columns >= COLS (<= D, a multiple of 8: the tensor's
// head_dim, params.cuh: FRT_QK_DIM, FRT_V_DIM) are zero, not read. (COLS at compile time: a run-time bound spilled
// 8-144 bytes in the mma.sync kernels at head_dim 216-256, NVRTC 13.0.)
// SWZ: the tile unpadded and swizzled (chunk_at), rows of DP * 2 bytes.
template <int ROWS, int D, int NTHREADS, int COLS = D, bool SWZ = false>
FRT_DEVICE void load_tile(u32 s_tile, const u16* g, i64 g_stride, int rows_valid, int tid) {
    constexpr int DP = round_up(D, 16);
    constexpr int CPR = DP / 8;  // 16-byte chunks per row
    constexpr int TOTAL = ROWS * CPR, LD = SWZ ? DP * 2 : Pitch<DP>::bytes;
#pragma unroll
    for (int i = 0; i < ceil_div(TOTAL, NTHREADS); ++i) {
        const int idx = tid + i * NTHREADS;
        if (TOTAL % NTHREADS == 0 || idx < TOTAL) {
            const int r = idx / CPR, c = idx % CPR;
            const bool ok = r < rows_valid && c * 8 < COLS;
            const u16* src = ok ? g + (i64)r * g_stride + c * 8 : g;
            cp_async16(s_tile + chunk_at<SWZ>(r, c, LD), src, ok);
        }
    }
}

// Store rows [0, rows_valid) and columns [0, COLS) (as load_tile's) of a ROWS x D shared tile (padded pitch) to
// global with 16-byte stores.
template <int ROWS, int D, int NTHREADS, int COLS = D>
FRT_DEVICE void store_tile(u16* g, i64 g_stride, const u16* s_tile, int rows_valid, int tid) {
    constexpr int DP = round_up(D, 16);
    constexpr int CPR = DP / 8;
    constexpr int TOTAL = ROWS * CPR;
#pragma unroll
    for (int i = 0; i < ceil_div(TOTAL, NTHREADS); ++i) {
        const int idx = tid + i * NTHREADS;
        if (TOTAL % NTHREADS == 0 || idx < TOTAL) {
            const int r = idx / CPR, c = idx % CPR;
            if (r < rows_valid && c * 8 < COLS) {
                const uint4 val = *reinterpret_cast<const uint4*>(s_tile + r * Pitch<DP>::elems + c * 8);
                *reinterpret_cast<uint4*>(g + (i64)r * g_stride + c * 8) = val;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Warp-level GEMM on m16n8k16 fragments.
//
// Accumulator acc[MT][NT][4] covers MT*16 rows x NT*8 columns; element c of
// fragment (mt, nt) sits at row mt*16 + lane/4 + 8*(c/2), column nt*8 + 2*(lane%4) + c%2.
//
// B operand layouts in shared memory:
//   B_NK: stored [n][k] (k contiguous), e.g. K for S = Q K^T   -> ldmatrix
//   B_KN: stored [k][n] (n contiguous), e.g. V for O = P V     -> ldmatrix.trans
// ---------------------------------------------------------------------------
enum BLayout { B_NK = 0, B_KN = 1 };

// Load the B fragments (b0, b1) of n-tiles nt and nt+1 (or only nt when PAIR is false)
// for k-step kk. ldb is the shared pitch in bytes.
// SWZ: the tile is swizzled (chunk_at), its rows counted from a multiple of 8.
template <int LAYOUT, bool PAIR, bool SWZ = false>
FRT_DEVICE void load_b(u32 sB, int ldb, int kk, int nt, int lane, u32& b00, u32& b01, u32& b10, u32& b11, int sw = 0) {
    if (LAYOUT == B_NK) {
        const int n = nt * 8 + ((lane >> 4) << 3) + (lane & 7);
        const int k = kk * 16 + (((lane >> 3) & 1) << 3);
        const u32 addr = sB + lane_chunk_at<SWZ>(n, k >> 3, ldb, lane, sw);
        if (PAIR) ldsm_x4(addr, b00, b01, b10, b11);
        else ldsm_x2(addr, b00, b01);
    } else {
        const int k = kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
        const int n = nt * 8 + ((lane >> 4) << 3);
        const u32 addr = sB + lane_chunk_at<SWZ>(k, n >> 3, ldb, lane, sw);
        if (PAIR) ldsm_x4_t(addr, b00, b01, b10, b11);
        else ldsm_x2_t(addr, b00, b01);
    }
}

// A operand layouts in shared memory:
//   A_MK: stored [m][k] (k contiguous), e.g. Q for S = Q K^T       -> ldmatrix
//   A_KM: stored [k][m] (m contiguous), e.g. dS^T for dQ = dS K     -> ldmatrix.trans
enum ALayout { A_MK = 0, A_KM = 1 };

// A fragment for rows mt*16.., k-step kk. lda is the shared pitch in bytes.
template <int LAYOUT = A_MK, bool SWZ = false>
FRT_DEVICE void load_a(u32 sA, int lda, int mt, int kk, int lane, u32 (&a)[4]) {
    if (LAYOUT == A_MK) {
        const int m = mt * 16 + (lane & 15);
        const int k = kk * 16 + ((lane >> 4) << 3);
        ldsm_x4(sA + lane_chunk_at<SWZ>(m, k >> 3, lda, lane), a[0], a[1], a[2], a[3]);
    } else {
        // Matrices 0..3 of the x4 are (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15);
        // lanes 8i..8i+7 address the 8 stored k-rows of matrix i.
        const int k = kk * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int m = mt * 16 + (((lane >> 3) & 1) << 3);
        ldsm_x4_t(sA + lane_chunk_at<SWZ>(k, m >> 3, lda, lane), a[0], a[1], a[2], a[3]);
    }
}

// acc += A * B for one k-step, A given as fragments in registers.
template <bool BF16, int MT, int NT, int LAYOUT, bool SWZ = false>
FRT_DEVICE void mma_kstep(float (&acc)[MT][NT][4], const u32 (&a)[MT][4], u32 sB, int ldb, int kk, int lane,
                          int sw = 0) {
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
        u32 b00, b01, b10 = 0, b11 = 0;
        if (nt + 1 < NT) load_b<LAYOUT, true, SWZ>(sB, ldb, kk, nt, lane, b00, b01, b10, b11, sw);
        else load_b<LAYOUT, false, SWZ>(sB, ldb, kk, nt, lane, b00, b01, b10, b11, sw);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            Elem<BF16>::mma(acc[mt][nt], a[mt], b00, b01);
            if (nt + 1 < NT) Elem<BF16>::mma(acc[mt][nt + 1], a[mt], b10, b11);
        }
    }
}

// acc += A * B over KSTEPS k-steps, A from shared memory (layout A_LAYOUT, pitch lda bytes). SWZ: B swizzled (and A
// unless SWZ_A says otherwise); sw: B's (lane_chunk_at).
template <bool BF16, int MT, int NT, int KSTEPS, int LAYOUT, int A_LAYOUT = A_MK, bool SWZ = false, bool SWZ_A = SWZ>
FRT_DEVICE void gemm_ss(float (&acc)[MT][NT][4], u32 sA, int lda, u32 sB, int ldb, int lane, int sw = 0) {
    // Unrolled by 2, not fully: with every k-step unrolled ptxas hoists all fragment loads
    // and spills at head_dim > 160 (seen with NVRTC 12.9).
#pragma unroll 2
    for (int kk = 0; kk < KSTEPS; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a<A_LAYOUT, SWZ_A>(sA, lda, mt, kk, lane, a[mt]);
        mma_kstep<BF16, MT, NT, LAYOUT, SWZ>(acc, a, sB, ldb, kk, lane, sw);
    }
}

// acc += A * B over KSTEPS k-steps, A fragments already in registers.
template <bool BF16, int MT, int NT, int KSTEPS, int LAYOUT, bool SWZ = false>
FRT_DEVICE void gemm_rs(float (&acc)[MT][NT][4], const u32 (&a)[KSTEPS][MT][4], u32 sB, int ldb, int lane,
                        int sw = 0) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) mma_kstep<BF16, MT, NT, LAYOUT, SWZ>(acc, a[kk], sB, ldb, kk, lane, sw);
}

// Accumulator (MT x 2*KSTEPS n-tiles) -> A fragments for the next GEMM, whose k
// runs over the accumulator's columns (P -> P V, dS -> dS K).
template <bool BF16, int MT, int KSTEPS>
FRT_DEVICE void acc_to_a(const float (&acc)[MT][2 * KSTEPS][4], u32 (&a)[KSTEPS][MT][4]) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[kk][mt][0] = Elem<BF16>::pack(acc[mt][2 * kk][0], acc[mt][2 * kk][1]);
            a[kk][mt][1] = Elem<BF16>::pack(acc[mt][2 * kk][2], acc[mt][2 * kk][3]);
            a[kk][mt][2] = Elem<BF16>::pack(acc[mt][2 * kk + 1][0], acc[mt][2 * kk + 1][1]);
            a[kk][mt][3] = Elem<BF16>::pack(acc[mt][2 * kk + 1][2], acc[mt][2 * kk + 1][3]);
        }
}

// Write an accumulator as 16-bit elements into a padded shared tile (row pitch
// ld elements), scaled by `scale`. Used to stage outputs for coalesced stores.
template <bool BF16, int MT, int NT>
FRT_DEVICE void acc_to_smem(u16* s, int ld, const float (&acc)[MT][NT][4], float scale, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = mt * 16 + g + 8 * h, c = nt * 8 + 2 * t;
                *reinterpret_cast<u32*>(s + r * ld + c) =
                    Elem<BF16>::pack(acc[mt][nt][2 * h] * scale, acc[mt][nt][2 * h + 1] * scale);
            }
}

// Acquire load / release store of a flag in global memory, GPU scope.
FRT_DEVICE int ld_acquire(const int* at) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(at) : "memory");
    return v;
}
FRT_DEVICE void st_release(int* at, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" :: "l"(at), "r"(v) : "memory");
}

// Programmatic dependent launch (sm_90+; no-ops before it). Every kernel lets a launch made as its
// programmatic dependent start once all its blocks have begun (FRT_ENTRY); such a dependent (the device
// check, spec.KernelSpec.programmatic) waits for the whole previous grid, its memory visible, before it
// touches that grid's outputs and before it ends. (A kernel launched the ordinary way waits for everything
// before it in the stream, the dependent included.)
FRT_DEVICE void launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
FRT_DEVICE void wait_previous_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// One 16-byte shared-memory store of four 32-bit words at `at` (a shared-window address, 16-byte aligned).
FRT_DEVICE void st_shared_v4(u32 at, u32 x, u32 y, u32 z, u32 w) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "r"(at), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}

// Thread block clusters (sm_90+; launch.py: a launch's cluster size): every thread of every block of the cluster
// meets here, the shared-memory writes of each before the barrier visible to all after it (release / acquire).
FRT_DEVICE void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The address of this block's shared-memory word `at` in the cluster's block `rank` (distributed shared memory).
FRT_DEVICE u32 cluster_map(u32 at, int rank) {
    u32 r = at;
#if __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(at), "r"(rank));
#endif
    return r;
}
FRT_DEVICE float cluster_ld(u32 at) {
    float x = 0.f;
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(at) : "memory");
#endif
    return x;
}
FRT_DEVICE float4 cluster_ld4(u32 at) {
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                 : "r"(at) : "memory");
#endif
    return x;
}

// Fire-and-forget fp32 atomic add of four adjacent floats (16-byte aligned address).
FRT_DEVICE void red_add4(float* at, float x, float y, float z, float w) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "l"(at), "f"(x), "f"(y), "f"(z), "f"(w)
                 : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(at), "f"(x) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(at + 1), "f"(y) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(at + 2), "f"(z) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(at + 3), "f"(w) : "memory");
#endif
}

// Atomically add an accumulator (rows of `ld` floats at `g`) to global memory, four
// floats per instruction: lanes t and t^1 swap halves of their fragments so that the
// even lane holds row r, columns 2t..2t+3 and the odd lane row r+8, columns 2t-2..2t+1.
// Rows >= rows_valid and columns >= cols_valid (a multiple of 4) are skipped.
template <int MT, int NT>
FRT_DEVICE void acc_red_add(float* g, i64 ld, const float (&acc)[MT][NT][4], int rows_valid, int cols_valid,
                            int lane) {
    const int gr = lane >> 2, t = lane & 3, odd = t & 1;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float* c = acc[mt][nt];
            const float s0 = odd ? c[0] : c[2], s1 = odd ? c[1] : c[3];
            const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
            const int row = mt * 16 + gr + 8 * odd, col = nt * 8 + 2 * (t - odd);
            if (row < rows_valid && col < cols_valid) {
                float* at = g + row * ld + col;
                if (odd) red_add4(at, r0, r1, c[2], c[3]);
                else red_add4(at, c[0], c[1], r0, r1);
            }
        }
}

template <int MT, int NT>
FRT_DEVICE void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mt][nt][c] = 0.f;
}

}  // namespace frt
