// Hopper (sm_90a) building blocks of the wgmma kernels (sm90/): shared-memory matrix descriptors, the
// 128-byte swizzled tile layout they describe, tile loads (cp.async, TMA), the wgmma instructions,
// warpgroup barriers, register reallocation and mbarrier rings. Inline PTX only, like common.cuh;
// compiles for sm_90a alone (wgmma is an arch-specific "a" feature). scripts/probes/probe_sm90.cu
// tests the descriptors and fragment layouts on their own.
//
// References (layouts learned from, code written here):
//   PTX ISA 8.x, 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate":
//     9.7.15.5.1.1   Register fragments (A in registers, accumulator D)
//     9.7.15.5.1.2   Shared Memory Matrix Layout (swizzle atoms, K-major / MN-major,
//                    leading / stride dimension byte offsets, canonical layouts)
//     9.7.15.5.1.2.2 Matrix Descriptor Format (the 64-bit descriptor)
//   CUTLASS cute/arch/mma_sm90_desc.hpp (GmmaDescriptor bit fields), FlashAttention-3 and
//   ThunderKittens for how the descriptors are advanced along K.
//
// ---------------------------------------------------------------------------------------
// The shared-memory tile layout used for every wgmma operand here ("sw128 tile")
// ---------------------------------------------------------------------------------------
// A ROWS x COLS tile of 16-bit elements (COLS a multiple of 64), stored row-major in global
// memory (COLS contiguous), lives in shared memory as COLS/64 "column blocks". Column block
// cb holds columns 64*cb .. 64*cb+63 of every row: ROWS rows of exactly 128 bytes, one after
// the other (block size ROWS*128 bytes, blocks back to back). Within a block, every group of
// 8 rows (1024 bytes, 1024-byte aligned) is one 128B-swizzle atom: the 16-byte chunk c
// (elements 8c..8c+7 of the block's row) of row r is stored at chunk position c ^ (r % 8):
//
//     byte offset of (row r, 16-byte chunk c of the full row) =
//         (c / 8) * ROWS * 128  +  r * 128  +  ((c % 8) ^ (r % 8)) * 16
//
// This is CuTe's Swizzle<3,4,3> applied to byte addresses: address bits [4,7) (chunk in a
// 128-byte row) are XORed with bits [7,10) (row within the 1024-byte atom). The hardware
// applies it to the absolute shared-memory address, so every tile must start on a 1024-byte
// boundary (then the descriptor's "base offset" field is 0, PTX ISA 9.7.15.5.1.2.2).
//
// The same stored tile serves as either operand kind:
//   * K-major (imm-trans = 0): the tile's rows are M (or N) and its columns K. E.g. Q and K
//     for S = Q K^T (head_dim contiguous), A[64][K] and B[N][K] of the GEMM probe.
//   * MN-major (imm-trans-b = 1, B only here): the tile's rows are K and its columns N.
//     E.g. V for O = P V: V is stored [key][head_dim], and P V reads it as B = K x N with
//     K = key, N = head_dim, N contiguous. B2[K][N] of the GEMM probe.
// The chunk swizzle also makes the 16-byte cp.async writes (8 consecutive chunks of a row per
// 8 lanes) and the epilogue's staging stores conflict-free.
#pragma once
#include "common/common.cuh"

namespace frt {
namespace sm90 {

constexpr int kSwizzleBytes = 128;              // bytes per swizzled row (one column block row)
constexpr int kAtomBytes = 8 * kSwizzleBytes;   // one 8-row swizzle atom: 1024 bytes
constexpr int kBlockCols = kSwizzleBytes / 2;   // 16-bit elements per column-block row: 64

// Byte offset of 16-byte chunk c (c = column / 8 over the full row) of row r in a sw128 tile
// of ROWS rows (see the layout comment at the top).
template <int ROWS>
FRT_DEVICE u32 sw128_offset(int r, int c) {
    return (u32)((c >> 3) * (ROWS * kSwizzleBytes) + r * kSwizzleBytes + (((c & 7) ^ (r & 7)) << 4));
}

// Round a shared address up to the 1024-byte swizzle-atom boundary.
FRT_DEVICE u32 align_atom(u32 addr) { return (addr + (kAtomBytes - 1)) & ~(u32)(kAtomBytes - 1); }

// Copy a ROWS x COLS tile of 16-bit elements (row stride g_stride elements, columns contiguous)
// into a sw128 tile at s_tile (1024-byte aligned); rows >= rows_valid lie past the tensor and
// columns >= cols_valid (a multiple of 8: a head_dim the kernel pads, params.cuh: head_dim) past its rows: both
// are zeroed (cp.async with source size 0), not read. Consecutive threads take consecutive 16-byte
// chunks of a row: coalesced global reads, and each 8-lane phase writes 8 distinct chunk slots
// of one 128-byte row (no bank conflicts).
// UNROLL: the copy loop's unroll factor (0: in full); a producer warpgroup with few registers takes 4.
template <int ROWS, int COLS, int NTHREADS, int UNROLL = 0>
FRT_DEVICE void load_tile_sw128(u32 s_tile, const u16* g, i64 g_stride, int rows_valid, int cols_valid, int tid) {
    constexpr int CPR = COLS / 8, TOTAL = ROWS * CPR;  // 16-byte chunks per row, in all
    static_assert(COLS % kBlockCols == 0, "sw128 tiles hold whole 64-column blocks");
    static_assert(ROWS % 8 == 0, "sw128 tiles hold whole 8-row atoms");
    static_assert(TOTAL % NTHREADS == 0, "tile chunks must divide evenly among the threads");
    if constexpr (NTHREADS % CPR == 0 && (NTHREADS / CPR) % 8 == 0) {
        // A thread's chunks share one column and one swizzle phase, RSTEP rows apart: one shared
        // and one global address, stepped. (With the general form below the wgmma forward ran 247
        // instructions between a key tile's barrier and its first wgmma, 187 with this one:
        // docs/perf-notes.md: Forward: wgmma (fwd_sm90).)
        constexpr int RSTEP = NTHREADS / CPR;
        const u32 ut = (u32)tid;
        const int c = (int)(ut % CPR), r0 = (int)(ut / CPR);
        const u32 s0 = s_tile + sw128_offset<ROWS>(r0, c);
        const u16* src = g + (i64)r0 * g_stride + c * 8;
        const i64 step = (i64)RSTEP * g_stride;
        const int rows_ok = c * 8 < cols_valid ? rows_valid : 0;
#pragma unroll
        for (int i = 0; i < TOTAL / NTHREADS; ++i, src += step) {
            const bool ok = r0 + i * RSTEP < rows_ok;
            cp_async16(s0 + i * RSTEP * kSwizzleBytes, ok ? src : g, ok);
        }
    } else if constexpr (NTHREADS % CPR == 0 && UNROLL > 0) {
        // One column, RSTEP (< 8) rows apart: the swizzle phase changes, so each shared address is found afresh
        // (head_dim 256 with 128 threads: the general form below kept 32 addresses live and spilled
        // fwd_sm90_ws's producer).
        constexpr int RSTEP = NTHREADS / CPR;
        const u32 ut = (u32)tid;
        const int c = (int)(ut % CPR), r0 = (int)(ut / CPR);
        const u16* src = g + (i64)r0 * g_stride + c * 8;
        const i64 step = (i64)RSTEP * g_stride;
        const int rows_ok = c * 8 < cols_valid ? rows_valid : 0;
#pragma unroll UNROLL
        for (int i = 0; i < TOTAL / NTHREADS; ++i, src += step) {
            const int r = r0 + i * RSTEP;
            cp_async16(s_tile + sw128_offset<ROWS>(r, c), r < rows_ok ? src : g, r < rows_ok);
        }
    } else {
        // (fwd_sm90_ws's producer at head_dim 192, 12 chunks of K or V and 24 of Q a thread, spilled 752 bytes
        // unrolled in full.)
        constexpr int BY = UNROLL > 0 ? UNROLL : TOTAL / NTHREADS;
#pragma unroll BY
        for (int i = 0; i < TOTAL / NTHREADS; ++i) {
            const int idx = tid + i * NTHREADS;
            const int r = idx / CPR, c = idx % CPR;
            const bool ok = r < rows_valid && c * 8 < cols_valid;
            cp_async16(s_tile + sw128_offset<ROWS>(r, c), ok ? g + (i64)r * g_stride + c * 8 : g, ok);
        }
    }
}

// load_tile_sw128's tile (rows_valid, cols_valid as there) by one warp of a warp-specialised loader, in few
// registers: a loop, not unrolled, over the tile's 16-byte chunks (lane l copies chunks l, l + 32, ...), each address
// found afresh; by loads and shared stores, so that the warp's mbarrier arrivals after them order them before the
// readers' waits (compute-sanitizer's racecheck follows mbarriers, and flagged cp.async copies waited for by
// cp.async.wait_group before the arrival).
template <int ROWS, int COLS>
FRT_DEVICE void copy_tile_sw128_warp(u32 s_tile, const u16* g, i64 g_stride, int rows_valid, int cols_valid, int lane) {
    constexpr int CPR = COLS / 8;
    static_assert(COLS % kBlockCols == 0 && ROWS % 8 == 0, "sw128 tiles hold whole 64-column blocks and 8-row atoms");
#pragma unroll 1
    for (int i = lane; i < ROWS * CPR; i += 32) {
        const int r = i / CPR, c = i % CPR;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < rows_valid && c * 8 < cols_valid) v = *reinterpret_cast<const uint4*>(g + r * g_stride + c * 8);
        st_shared_v4(s_tile + sw128_offset<ROWS>(r, c), v.x, v.y, v.z, v.w);
    }
}

// The same sw128 tile by TMA (cp.async.bulk.tensor): one 64-column x ROWS-row box per column block
// from `map`, a CUtensorMap of a (B, S, H, D) tensor (dims D, H, S, B; box 64 x 1 x ROWS x 1; 128-byte
// swizzle, which is the sw128 layout: chunk c of row r at c ^ (r % 8), from a 1024-byte-aligned
// start), at (head h, seq row `row`, batch entry b). One thread issues; the boxes complete the mbarrier
// `bar` by their bytes, which that thread announced first (mbar_arrive_expect_tx). `map` is the address of a
// __grid_constant__ kernel parameter.
template <int ROWS, int COLS>
FRT_DEVICE void load_tile_tma(u32 s_tile, const void* map, u32 bar, int h, int row, int b) {
    static_assert(COLS % kBlockCols == 0 && ROWS <= 256, "TMA boxes: whole 64-column blocks, at most 256 rows");
#pragma unroll
    for (int cb = 0; cb < COLS / kBlockCols; ++cb)
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
            :: "r"(s_tile + cb * ROWS * kSwizzleBytes), "l"(map), "r"(cb * kBlockCols), "r"(h), "r"(row), "r"(b), "r"(bar)
            : "memory");
}

// Brings `map` (a CUtensorMap, the address of a __grid_constant__ kernel parameter) into the TMA unit's descriptor
// cache ahead of its first load, as FlashAttention-3 / 4 do at a kernel's start.
FRT_DEVICE void prefetch_tensormap(const void* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(map) : "memory");
}

// ---------------------------------------------------------------------------------------
// Matrix descriptor (PTX ISA 9.7.15.5.1.2.2), a 64-bit register operand of wgmma:
//   bits  0-13  start address:                 (addr & 0x3FFFF) >> 4
//   bits 16-29  leading dimension byte offset: (LBO & 0x3FFFF) >> 4
//   bits 32-45  stride dimension byte offset:  (SBO & 0x3FFFF) >> 4
//   bits 49-51  matrix base offset: 0 here, since every swizzle atom starts on a 1024-byte
//               boundary (otherwise (atom start >> 7) & 7)
//   bits 62-63  swizzle mode: 0 none, 1 = 128-byte swizzle, 2 = 64-byte, 3 = 32-byte
//   (bits 14-15, 30-31, 46-48, 52-61 are zero)
//
// LBO / SBO for the 128B swizzle (PTX ISA 9.7.15.5.1.2.1, in 16-byte units T = 8 bf16):
//   K-major, canonical ((8,m),(T,2k)):((8T,SBO),(1,T)):
//       SBO = byte distance between consecutive groups of 8 rows (M or N) = 1024 here;
//       LBO is unused for swizzled K-major layouts ("assumed to be 1"): encoded as 1.
//       A k-step of 16 elements is 32 bytes of a 128-byte row, so the K extent of one wgmma
//       never leaves the swizzle row; step kk starts at column block kk/4, byte 32*(kk%4).
//       Adding 32*(kk%4) to the start address is how CUTLASS / FA3 walk K inside a swizzle
//       row: the hardware swizzles the address it computes, (row*128 + chunk*16) from the
//       start, so chunk 2*(kk%4)+c of row r lands at ((2*(kk%4)+c) ^ (r%8)), as stored.
//   MN-major, canonical ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)):
//       the MN axis runs along the 128-byte row (64 elements), the next 64 MN-elements are
//       LBO bytes further (the next column block: ROWS*128 bytes); the K axis runs down the
//       rows, 8 rows per atom, the next 8 K-rows are SBO = 1024 bytes further. A k-step of
//       16 is 16 whole rows: step kk starts 16*128*kk bytes into every column block.
// ---------------------------------------------------------------------------------------
// A descriptor as two words. The low word holds the start address (bits 0-13) and LBO (bits 16-29), the high word SBO
// (kAtomBytes) and the 128-byte swizzle mode; base offset 0. The k-steps of one tile differ only in their start:
// desc_lo builds the low word of the tile's first step once, desc_at adds a step's byte offset >> 4 to it, one add a
// step where rebuilding every field from the step's address took five uniform instructions (docs/perf-notes.md,
// Per-pair fixed cost; a 64-bit base descriptor cost registers: a masked wgmma forward spilled). The add stays inside
// the 14-bit start field: the offset is a multiple of 16 bytes and start + offset a shared address below 2^18, so the
// sum is ((start + offset) & 0x3FFFF) >> 4, the field itself.
template <u32 LBO_BYTES>
FRT_DEVICE u32 desc_lo(u32 start) {
    return ((start & 0x3FFFFu) >> 4) | (((LBO_BYTES & 0x3FFFFu) >> 4) << 16);
}
FRT_DEVICE u64 desc_at(u32 lo, u32 offset_bytes) {
    constexpr u32 kHi = (kAtomBytes >> 4) | (1u << 30);  // bits 32-45: SBO; bits 62-63 = 1: 128-byte swizzle
    return ((u64)kHi << 32) | (u64)(lo + (offset_bytes >> 4));
}

// K-major operand (rows = M or N, columns = K) for k-step kk (16 columns) of a sw128 tile
// whose column blocks are ROWS rows tall; s_rows is the address of the operand's first row
// inside column block 0 (e.g. s_tile + 64*128*warpgroup for a warpgroup's 64-row slice).
template <int ROWS>
FRT_DEVICE u64 desc_k_major(u32 s_rows, int kk) {
    const u32 lo = desc_lo<16 /* unused: encodes 1 */>(s_rows);
    return desc_at(lo, (u32)((kk >> 2) * (ROWS * kSwizzleBytes) + (kk & 3) * 32));
}

// MN-major B operand (rows = K, columns = N, N contiguous) for k-step kk (16 rows) of a sw128
// tile of K_ROWS rows: column block stride K_ROWS*128 = LBO, 8-row stride 1024 = SBO.
template <int K_ROWS>
FRT_DEVICE u64 desc_mn_major(u32 s_tile, int kk) {
    return desc_at(desc_lo<K_ROWS * kSwizzleBytes>(s_tile), (u32)(kk * 16 * kSwizzleBytes));
}

// ---------------------------------------------------------------------------------------
// Ordering primitives (PTX ISA 9.7.15.6 / 9.7.15.7, 9.7.12.4 membar/fence)
// ---------------------------------------------------------------------------------------
// wgmma.fence: before the first wgmma of a batch, and whenever the accumulator or A-fragment
// registers were touched by ordinary instructions since the last wgmma that used them.
FRT_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Close the wgmma instructions issued so far into one wgmma-group.
FRT_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N wgmma-groups of this warp are pending.
template <int N>
FRT_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// wgmma reads shared memory through the async proxy: writes made through the generic proxy
// (st.shared, and the cp.async non-bulk copies) must be fenced before it reads them. Each
// writing thread fences after cp.async.wait_group, then a barrier, then the wgmma.
FRT_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Bulk reduce-add (PTX ISA 9.7.9.25.4.2, cp.reduce.async.bulk, non-tensor form): `bytes` (a multiple of 16) of fp32 at
// shared address s added element-wise into global memory at g (both 16-byte aligned) by the TMA unit, atomically per
// element. The shared data was written through the generic proxy: fenced (fence_proxy_async) by its writers, then a
// barrier, before the issue. Completion is tracked per thread in bulk groups: commit closes the issued ones into a
// group; wait_read<N> returns once at most N of the thread's groups still read shared memory (their source may be
// rewritten), wait<N> once at most N are incomplete (their adds performed).
FRT_DEVICE void bulk_reduce_add_f32(float* g, u32 s, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(g), "r"(s), "r"(bytes) : "memory");
}
// The same bytes copied (cp.async.bulk, non-tensor form), not added: the same bulk groups.
FRT_DEVICE void bulk_store(void* g, u32 s, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 :: "l"(g), "r"(s), "r"(bytes) : "memory");
}
FRT_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
FRT_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory"); }
template <int N>
FRT_DEVICE void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory"); }

// Compiler-only fence on accumulator registers: the wgmma asm statements "write" them when
// issued, but the values exist only after wgmma_wait. Passing every register through an
// empty volatile asm after the wait (and before the issue) keeps the compiler from moving
// their uses across it (volatile asms are not reordered among themselves).
template <int R>
FRT_DEVICE void fence_operand(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
FRT_DEVICE void fence_operand(u32 (&a)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// Barrier of the 128 threads of one warpgroup (ids 1.. are free: __syncthreads uses 0). The id is
// an immediate: with a register id ptxas reserves all 16 hardware barriers.
template <int ID>
FRT_DEVICE void warpgroup_bar() { asm volatile("bar.sync %0, 128;\n" :: "n"(ID) : "memory"); }
// A producer / consumer handoff between warpgroups on named barrier ID over THREADS threads: the
// producers arrive (no wait; their earlier shared-memory writes are ordered before the consumers'
// reads after the barrier), the consumers wait until all THREADS threads have arrived or waited.
template <int ID, int THREADS>
FRT_DEVICE void bar_arrive() { asm volatile("bar.arrive %0, %1;\n" :: "n"(ID), "n"(THREADS) : "memory"); }
template <int ID, int THREADS>
FRT_DEVICE void bar_wait() { asm volatile("bar.sync %0, %1;\n" :: "n"(ID), "n"(THREADS) : "memory"); }
// warpgroup_bar<ID> that also tells whether `pred` holds on all 128 threads (bar.red.and).
template <int ID>
FRT_DEVICE bool warpgroup_all(bool pred) {
    u32 all;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.u32 p, %1, 0;\n"
        "bar.red.and.pred p, %2, 128, p;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n" : "=r"(all) : "r"((u32)pred), "n"(ID) : "memory");
    return all != 0;
}

// Hand registers between warpgroups of a warp-specialised kernel (PTX ISA: setmaxnreg): every warp of
// a warpgroup runs the same one; the kernel's launch bound sets the count they start from.
template <int REGS>
FRT_DEVICE void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS)); }
template <int REGS>
FRT_DEVICE void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS)); }

// mbarriers (PTX ISA 9.7.13.15) for the warp-specialised kernels: a 64-bit shared word counting
// arrivals per phase. `count` arrivals complete a phase; a waiter names the phase by its parity
// (the barrier starts in phase 0; waiting on parity 1 returns at once: the "previous" phase).
FRT_DEVICE void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
FRT_DEVICE void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// One arrival, made when every cp.async this thread issued so far has landed (.noinc: it counts
// towards the barrier's expected arrivals).
FRT_DEVICE void mbar_arrive_cp_async(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
// One arrival that also makes the phase wait for `bytes` more of transactions (TMA loads' complete_tx).
FRT_DEVICE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
// (the spin on mbarrier `bar` (%0) until phase `parity` (%1) completes; inside braces, so its label is local)
#define FRT_MBAR_SPIN                                                   \
    ".reg .pred done;\n"                                                \
    "WAIT:\n"                                                           \
    "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"        \
    "@!done bra WAIT;\n"
FRT_DEVICE void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n" FRT_MBAR_SPIN "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// mbar_wait for a buffer that only wgmma (the async proxy) reads after it, placed between another wgmma's issue and
// its wait: no memory clobber (beside the wgmmas one made ptxas serialise them; volatile asm keeps its place among
// the wgmma asm), and the proxy fence that makes a cp.async fill of the buffer visible to wgmma, in the same asm.
FRT_DEVICE void mbar_wait_for_wgmma(u32 bar, u32 parity) {
    asm volatile("{\n" FRT_MBAR_SPIN "fence.proxy.async.shared::cta;\n}\n" :: "r"(bar), "r"(parity));
}
#undef FRT_MBAR_SPIN

// A position in a ring of STAGES buffers, each guarded by mbarriers (a "full" one the consumers wait on, an
// "empty" one the producers wait on): fill n (n = count) uses slot n % STAGES, in phase n / STAGES of that
// slot's barriers. Consumers wait for a fill with parity(); producers wait for its slot with free_parity(),
// which the first pass over the ring finds free (the barriers start in phase 0).
template <int STAGES>
struct Ring {
    u32 count = 0;
    FRT_DEVICE u32 slot() const { return count % STAGES; }
    FRT_DEVICE u32 parity() const { return (count / STAGES) & 1; }
    FRT_DEVICE u32 free_parity() const { return parity() ^ 1; }
    FRT_DEVICE Ring prev() const { return Ring{count - 1}; }  // the fill before this one (count > 0)
    FRT_DEVICE Ring& operator++() {
        ++count;
        return *this;
    }
};

// ---------------------------------------------------------------------------------------
// wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16, N = 32 to 256.
//
// Accumulator layout (PTX ISA Figure "WGMMA .m64nNk16 register fragment layout for
// accumulator matrix D"): warp w (0-3) of the warpgroup owns rows 16w..16w+15; with
// g = lane / 4, t = lane % 4, thread register d[4j + 2h + e] (j < N/8, h, e in {0,1}) is
//     row 16w + g + 8h,  column 8j + 2t + e         (N/2 floats per thread)
// i.e. the m16n8 mma.sync C fragment, repeated along N.
//
// A from registers (Figure "WGMMA .m64nNk16 register fragment layout for matrix A"): four
// .b32 registers of two 16-bit elements each, the low half holding the lower column; warp w
// owns rows 16w..16w+15 and, like mma.sync m16n8k16's A fragment:
//     a[0]: row g,   cols 2t, 2t+1       a[1]: row g+8, cols 2t, 2t+1
//     a[2]: row g,   cols 2t+8, 2t+9     a[3]: row g+8, cols 2t+8, 2t+9
// So an accumulator of N columns becomes the A operand of N/16 k-steps with
//     a_kk = {pack(d[8kk], d[8kk+1]), pack(d[8kk+2], d[8kk+3]),
//             pack(d[8kk+4], d[8kk+5]), pack(d[8kk+6], d[8kk+7])}.
//
// Operands: d (accumulator, in/out), a-desc or a regs, b-desc, scale-d (predicate: false
// gives D = A*B, ignoring d's old value), imm-scale-a = imm-scale-b = 1, imm-trans-a = TRANS_A
// (shared A only; 0: A K-major, 1: MN-major), imm-trans-b = TRANS_B (0: B K-major, 1: B MN-major, e.g. V in P V).
// ---------------------------------------------------------------------------------------
#define FRT_WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                     "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define FRT_WG_D16 FRT_WG_D8(0), FRT_WG_D8(8)
#define FRT_WG_D32 FRT_WG_D8(0), FRT_WG_D8(8), FRT_WG_D8(16), FRT_WG_D8(24)
#define FRT_WG_D64 FRT_WG_D32, FRT_WG_D8(32), FRT_WG_D8(40), FRT_WG_D8(48), FRT_WG_D8(56)
#define FRT_WG_D96 FRT_WG_D64, FRT_WG_D8(64), FRT_WG_D8(72), FRT_WG_D8(80), FRT_WG_D8(88)
#define FRT_WG_D128 FRT_WG_D96, FRT_WG_D8(96), FRT_WG_D8(104), FRT_WG_D8(112), FRT_WG_D8(120)
#define FRT_WG_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FRT_WG_R32                                                                                         \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FRT_WG_D40 FRT_WG_D32, FRT_WG_D8(32)
#define FRT_WG_R40                                                                                         \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define FRT_WG_D48 FRT_WG_D40, FRT_WG_D8(40)
#define FRT_WG_D56 FRT_WG_D48, FRT_WG_D8(48)
#define FRT_WG_R48    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47}"
#define FRT_WG_R56    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}"
#define FRT_WG_D88 FRT_WG_D64, FRT_WG_D8(64), FRT_WG_D8(72), FRT_WG_D8(80)
#define FRT_WG_R88    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
    "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
    "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"
#define FRT_WG_R64                                                                                         \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "   \
    "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "   \
    "%62, %63}"

#define FRT_WG_D80 FRT_WG_D64, FRT_WG_D8(64), FRT_WG_D8(72)
#define FRT_WG_D112 FRT_WG_D96, FRT_WG_D8(96), FRT_WG_D8(104)
#define FRT_WG_R80    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
    "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
    "%78, %79}"
#define FRT_WG_R112    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
    "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
    "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, " \
    "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111}"

// One wgmma m64nNk16 with f32 accumulators; TY is the operand type (bf16 or f16), A from
// shared memory (descriptor) or registers (four 16x2-bit registers, layout above).
#define FRT_WG_TY(BF16) ((BF16) ? "bf16" : "f16")
#define FRT_WG_SS(SHAPE, TY, R, D, IA, IB, IP, ITA, IT)                                         \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " IP ", 0;\n"                             \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " R ", " IA ", " IB \
                 ", p, 1, 1, " ITA ", " IT ";\n}\n"                                              \
                 : D : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
#define FRT_WG_SS_N(SHAPE, H, IA, IB, IP, ITA, IT)                                              \
    do {                                                                                        \
        if constexpr (BF16)                                                                     \
            FRT_WG_SS(SHAPE, "bf16", FRT_WG_R##H, FRT_WG_D##H, IA, IB, IP, ITA, IT);            \
        else                                                                                    \
            FRT_WG_SS(SHAPE, "f16", FRT_WG_R##H, FRT_WG_D##H, IA, IB, IP, ITA, IT);             \
    } while (0)
#define FRT_WG_RS(SHAPE, TY, R, D, IA, IB, IP, IT)                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " IP ", 0;\n"                             \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " R ", " IA ", " IB \
                 ", p, 1, 1, " IT ";\n}\n"                                                      \
                 : D : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B))

#define FRT_WG_R96    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
    "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
    "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define FRT_WG_R128    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
    "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
    "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, " \
    "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, " \
    "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

// A from shared memory (descriptor), B from shared memory (descriptor). TRANS_A = 1: A MN-major (M contiguous,
// desc_mn_major; 16-bit types only), e.g. dS^T stored [key][query] read as dS for dQ = dS K.
template <int N, int TRANS_B, bool BF16 = true, int TRANS_A = 0>
FRT_DEVICE void wgmma_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b, int scale_d) {
    static_assert(N == 32 || N == 64 || N == 80 || N == 96 || N == 112 || N == 128 || N == 176,
                  "wgmma_ss: N = 32, 64, 80, 96, 112, 128 or 176");
    static_assert((TRANS_A == 0 || TRANS_A == 1) && (TRANS_B == 0 || TRANS_B == 1), "wgmma_ss: TRANS_A/B are 0 or 1");
    // (FRT_WG_SS_N: the bf16 or f16 form of one shape; H = N / 2 accumulator registers, then the operands' indices)
    if constexpr (N == 32)
        FRT_WG_SS_N("m64n32k16", 16, "%16", "%17", "%18", "%19", "%20");
    else if constexpr (N == 64)
        FRT_WG_SS_N("m64n64k16", 32, "%32", "%33", "%34", "%35", "%36");
    else if constexpr (N == 80)
        FRT_WG_SS_N("m64n80k16", 40, "%40", "%41", "%42", "%43", "%44");
    else if constexpr (N == 96)
        FRT_WG_SS_N("m64n96k16", 48, "%48", "%49", "%50", "%51", "%52");
    else if constexpr (N == 112)
        FRT_WG_SS_N("m64n112k16", 56, "%56", "%57", "%58", "%59", "%60");
    else if constexpr (N == 176)
        FRT_WG_SS_N("m64n176k16", 88, "%88", "%89", "%90", "%91", "%92");
    else
        FRT_WG_SS_N("m64n128k16", 64, "%64", "%65", "%66", "%67", "%68");
}

// A from registers (four 16x2-bit registers, layout above), B from shared memory (descriptor).
template <int N, int TRANS_B, bool BF16 = true>
FRT_DEVICE void wgmma_rs(float (&d)[N / 2], const u32 (&a)[4], u64 desc_b, int scale_d) {
    static_assert(N == 64 || N == 96 || N == 128 || N == 160 || N == 192 || N == 224 || N == 256,
                  "wgmma_rs: N = 64, 96, 128, 160, 192, 224 or 256");
    static_assert(TRANS_B == 0 || TRANS_B == 1, "wgmma_rs: TRANS_B is 0 or 1");
    // (FRT_WG_RS_N: the bf16 or f16 form of one shape; H = N / 2 accumulator registers, then the operands' indices)
#define FRT_WG_RS_N(SHAPE, H, IA, IB, IP, IT)                                    \
    do {                                                                         \
        if constexpr (BF16)                                                      \
            FRT_WG_RS(SHAPE, "bf16", FRT_WG_R##H, FRT_WG_D##H, IA, IB, IP, IT); \
        else                                                                     \
            FRT_WG_RS(SHAPE, "f16", FRT_WG_R##H, FRT_WG_D##H, IA, IB, IP, IT);  \
    } while (0)
    if constexpr (N == 64)
        FRT_WG_RS_N("m64n64k16", 32, "{%32, %33, %34, %35}", "%36", "%37", "%38");
    else if constexpr (N == 96)
        FRT_WG_RS_N("m64n96k16", 48, "{%48, %49, %50, %51}", "%52", "%53", "%54");
    else if constexpr (N == 128)
        FRT_WG_RS_N("m64n128k16", 64, "{%64, %65, %66, %67}", "%68", "%69", "%70");
    else if constexpr (N == 160)
        FRT_WG_RS_N("m64n160k16", 80, "{%80, %81, %82, %83}", "%84", "%85", "%86");
    else if constexpr (N == 192)
        FRT_WG_RS_N("m64n192k16", 96, "{%96, %97, %98, %99}", "%100", "%101", "%102");
    else if constexpr (N == 224)
        FRT_WG_RS_N("m64n224k16", 112, "{%112, %113, %114, %115}", "%116", "%117", "%118");
    else
        FRT_WG_RS_N("m64n256k16", 128, "{%128, %129, %130, %131}", "%132", "%133", "%134");
#undef FRT_WG_RS_N
}

// acc (N columns) = A B^T over 16 KSTEPS columns of k, in k-steps issued back to back, the first overwriting
// acc: A this warpgroup's 64 rows of a K-major sw128 tile of A_ROWS rows (s_a), B a K-major tile of N rows.
// (S = Q K^T in the forward and dQ kernels, S^T = K Q^T and dP^T = V dO^T in dK/dV.) The caller commits.
template <int N, int A_ROWS, int KSTEPS, bool BF16>
FRT_DEVICE void wgmma_abt(float (&acc)[N / 2], u32 s_a, u32 s_b) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
        wgmma_ss<N, 0, BF16>(acc, desc_k_major<A_ROWS>(s_a, kk), desc_k_major<N>(s_b, kk), kk > 0);
}
// The same with A's k-steps in registers (a[kk]: wgmma_rs's A fragments, e.g. sw128_to_a_frags).
template <int N, int KSTEPS, bool BF16>
FRT_DEVICE void wgmma_abt(float (&acc)[N / 2], const u32 (&a)[KSTEPS][4], u32 s_b) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
        wgmma_rs<N, 0, BF16>(acc, a[kk], desc_k_major<N>(s_b, kk), kk > 0);
}

#undef FRT_WG_TY
#undef FRT_WG_SS
#undef FRT_WG_SS_N
#undef FRT_WG_RS
#undef FRT_WG_D8
#undef FRT_WG_D16
#undef FRT_WG_D32
#undef FRT_WG_D40
#undef FRT_WG_D48
#undef FRT_WG_D56
#undef FRT_WG_D64
#undef FRT_WG_D80
#undef FRT_WG_D88
#undef FRT_WG_D96
#undef FRT_WG_D112
#undef FRT_WG_D128
#undef FRT_WG_R96
#undef FRT_WG_R128
#undef FRT_WG_R16
#undef FRT_WG_R32
#undef FRT_WG_R40
#undef FRT_WG_R48
#undef FRT_WG_R56
#undef FRT_WG_R64
#undef FRT_WG_R80
#undef FRT_WG_R88
#undef FRT_WG_R112

// d += A B, issued (not committed): A the K_ROWS / 16 register fragments `a` (acc_to_a_frag), B the
// MN-major K_ROWS x N shared tile at s_b (desc_mn_major).
template <int N, int K_ROWS, bool BF16>
FRT_DEVICE void wgmma_rs_mn(float (&d)[N / 2], const u32 (&a)[K_ROWS / 16][4], u32 s_b) {
#pragma unroll
    for (int kk = 0; kk < K_ROWS / 16; ++kk) wgmma_rs<N, 1, BF16>(d, a[kk], desc_mn_major<K_ROWS>(s_b, kk), 1);
}

// wgmma_rs_mn, waited for. The fence first orders the caller's writes to a and d (the fragment
// packing, an accumulator rescale) before the wgmmas that read them.
template <int N, int K_ROWS, bool BF16>
FRT_DEVICE void wgmma_rs_wait(float (&d)[N / 2], const u32 (&a)[K_ROWS / 16][4], u32 s_b) {
    wgmma_fence();
    wgmma_rs_mn<N, K_ROWS, BF16>(d, a, s_b);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(d);
}

// Accumulator columns 16kk..16kk+15 (N/2 floats per thread) as the A operand of k-step kk.
template <int R, bool BF16 = true>
FRT_DEVICE void acc_to_a_frag(const float (&d)[R], int kk, u32 (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = Elem<BF16>::pack(d[8 * kk + 2 * i], d[8 * kk + 2 * i + 1]);
}

// The A fragments of k-steps 0 .. K / 16 - 1 (the layout acc_to_a_frag makes) of a warpgroup's 64 rows
// of a sw128 tile of ROWS rows (s_rows: the address of its first row), read from shared memory.
template <int ROWS, int K>
FRT_DEVICE void sw128_to_a_frags(u32 s_rows, u32 (&a)[K / 16][4], int w, int g, int t) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 at = s_rows + sw128_offset<ROWS>(16 * w + g + 8 * (i & 1), 2 * kk + (i >> 1)) + 4 * t;
            asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(a[kk][i]) : "r"(at));
        }
}

// Epilogue, step 1: a warpgroup's 64 x N fp32 accumulator (wgmma layout), times `scale`, as 16-bit
// values into its 64 rows of a sw128 tile of ROWS rows (s_rows: the address of its first row).
// Step 2, after a barrier of the warpgroup: sw128_rows_to_global. Each stmatrix stores four 8 x 8 blocks
// (rows 16 w .. + 15 of two 8-column blocks): an accumulator 8 x 8 block is laid out across the warp as
// stmatrix's fragment (lane 4 g + t: row g, columns 2 t, 2 t + 1), and lane l gives the address of row l % 8
// of block l / 8.
template <int ROWS, int N, bool BF16>
FRT_DEVICE void acc_to_sw128(u32 s_rows, const float (&d)[N / 2], float scale, int w, int g, int t) {
    static_assert(N % 16 == 0, "acc_to_sw128: pairs of 8-column blocks");
    const int lane = 4 * g + t, mat = lane >> 3;
    const int row = 16 * w + 8 * (mat & 1) + (lane & 7);
#pragma unroll
    for (int j = 0; j < N / 8; j += 2) {
        const u32 at = s_rows + sw128_offset<ROWS>(row, j + (mat >> 1));
        u32 v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int jj = j + (i >> 1), hh = i & 1;
            v[i] = Elem<BF16>::pack(d[4 * jj + 2 * hh] * scale, d[4 * jj + 2 * hh + 1] * scale);
        }
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" :: "r"(at), "r"(v[0]), "r"(v[1]),
                     "r"(v[2]), "r"(v[3]));
    }
}

// A warpgroup's A fragments of k-steps 0 .. K / 16 - 1 (acc_to_a_frag's layout: 64 rows, K columns) into its 64
// rows of a sw128 tile of ROWS rows (s_rows: its first row), by stmatrix as acc_to_sw128 stores: fragment kk is
// acc_to_sw128's store of column blocks 2 kk, 2 kk + 1.
template <int ROWS, int K>
FRT_DEVICE void a_frags_to_sw128(u32 s_rows, const u32 (&a)[K / 16][4], int w, int g, int t) {
    const int lane = 4 * g + t, mat = lane >> 3;
    const int row = 16 * w + 8 * (mat & 1) + (lane & 7);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(s_rows + sw128_offset<ROWS>(row, 2 * kk + (mat >> 1))), "r"(a[kk][0]), "r"(a[kk][1]),
                     "r"(a[kk][2]), "r"(a[kk][3]));
}

// Epilogue, step 2: rows [0, rows_valid) and columns [0, cols_valid) (a multiple of 8: params.cuh, head_dim) of a
// warpgroup's 64 rows of a sw128 tile (ROWS rows, COLS columns; s_rows: its first row) to global memory (row stride
// `stride` elements), 16 bytes per store; wtid is the thread's index in the warpgroup. The stores are .cs (streaming:
// first out of L2): a kernel never reads its outputs, and in the forward they evicted the K / V that other blocks
// were about to read (docs/perf-notes.md: Per-item fixed cost).
// The shared loads go in batches of up to 8 before their stores (all 64 rows are staged: the rows past
// rows_valid are read and not stored): one at a time, each store waited for its load (docs/perf-notes.md: Per-item fixed cost).
template <int ROWS, int COLS>
FRT_DEVICE void sw128_rows_to_global(u16* g, i64 stride, u32 s_rows, int rows_valid, int cols_valid, int wtid) {
    constexpr int CPR = COLS / 8, N = 64 * CPR / 128, BATCH = 8;
#pragma unroll
    for (int i0 = 0; i0 < N; i0 += BATCH) {
        uint4 val[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH && i0 + i < N; ++i) {
            const int idx = wtid + (i0 + i) * 128;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(val[i].x), "=r"(val[i].y), "=r"(val[i].z), "=r"(val[i].w)
                         : "r"(s_rows + sw128_offset<ROWS>(idx / CPR, idx % CPR)));
        }
#pragma unroll
        for (int i = 0; i < BATCH && i0 + i < N; ++i) {
            const int idx = wtid + (i0 + i) * 128, r = idx / CPR, c = idx % CPR;
            if (r < rows_valid && c * 8 < cols_valid)
                asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};\n"
                             :: "l"(g + (i64)r * stride + c * 8), "r"(val[i].x), "r"(val[i].y), "r"(val[i].z),
                             "r"(val[i].w) : "memory");
        }
    }
}

// A warpgroup's 64 x N fp32 accumulator (wgmma layout: row 16 w + g + 8 hh, columns 8 jj + 2 t, + 1), row hh's
// values times scale[hh], as 16-bit values straight to global memory (row stride `stride` elements): rows [0,
// rows_valid) and columns [0, cols_valid) (a multiple of 8). No shared memory: the single-Q-slot forward frees its Q
// slot before its epilogue this way (docs/perf-notes.md: head_dim 192 and 256). Each quad transposes its 4 x 4 words
// of four 8-column groups (two exchanges of shfl.xor) so that lane t stores group t's 8 columns by one 16-byte .cs
// store: a quad writes 64 contiguous bytes of its row (4-byte stores of each pair took 4x the store instructions,
// each touching 8 lines: 7% of the head_dim 256 forward at 1k).
template <int N, bool BF16>
FRT_DEVICE void acc_to_global(u16* g, i64 stride, const float (&d)[N / 2], const float (&scale)[2], int rows_valid,
                              int cols_valid, int w, int gr, int t) {
    static_assert(N % 32 == 0, "acc_to_global: whole quads of 8-column groups");
    const bool high = t & 2, odd = t & 1;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = 16 * w + gr + 8 * hh;
        u16* row = g + (i64)r * stride + 8 * t;
#pragma unroll
        for (int a = 0; a < N / 32; ++a) {
            u32 x[4];  // x[k]: this lane's pair of group 4 a + k; after the exchanges, lane k's pair of group 4 a + t
#pragma unroll
            for (int k = 0; k < 4; ++k)
                x[k] = Elem<BF16>::pack(d[4 * (4 * a + k) + 2 * hh] * scale[hh],
                                        d[4 * (4 * a + k) + 2 * hh + 1] * scale[hh]);
#pragma unroll
            for (int k = 0; k < 2; ++k) {  // lanes t, t ^ 2 swap the groups of each other's half
                const u32 got = __shfl_xor_sync(0xffffffffu, high ? x[k] : x[k + 2], 2);
                if (high) x[k] = got; else x[k + 2] = got;
            }
#pragma unroll
            for (int k = 0; k < 4; k += 2) {  // lanes t, t ^ 1 likewise within each half
                const u32 got = __shfl_xor_sync(0xffffffffu, odd ? x[k] : x[k + 1], 1);
                if (odd) x[k] = got; else x[k + 1] = got;
            }
            if (r < rows_valid && 32 * a + 8 * t < cols_valid)
                asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};\n"
                             :: "l"(row + 32 * a), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]) : "memory");
        }
    }
}

}  // namespace sm90
}  // namespace frt
