// Attention forward on Hopper (sm_90a): O = softmax(scale * Q K^T) V and LSE with wgmma.
//
// The same problem and masks as fwd.cu (QueryTile: GQA, spans / mask_mod lists, ragged tiles),
// for head_dim 64, 128, 192, 256, over work items of one 128-row query tile each (params.cuh:
// work_item, a 1-D grid). Up to head_dim 192 the kernel is persistent: the grid holds the blocks
// that run at once, a counter hands out the items after the first, and on an item's last key
// tile the block loads the next item's Q (into a second Q buffer) and first K/V tile, which land
// while the last tile and the epilogue run: with few key tiles per item (causal at S ~1k) a
// block's first loads were otherwise exposed (docs/perf-notes.md, session 8).
// 256 threads = two warpgroups of 64 query rows each. Q (128 x D) is loaded once per item and K/V
// tiles (BN x D) double-buffered by cp.async into 128-byte-swizzled shared tiles (wgmma.cuh);
// S = Q K^T is a wgmma with both operands in shared memory, the online softmax (base 2, scale
// folded in) runs on the fp32 accumulator fragments, and O += P V is a wgmma with P from
// registers and V as the transposed (MN-major) B operand. Each GEMM is waited for before the
// softmax that needs it (no overlap of softmax and MMA yet: docs/perf-notes.md).
#include "params.cuh"
#include "wgmma.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct FwdSm90Traits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int MASK = FRT_MASK, NTHREADS = NW * 32;
    static_assert(D % 64 == 0 && D <= 256, "fwd_sm90: head_dim 64, 128, 192 or 256 (whole swizzle blocks)");
    static_assert(BM == 128 && NW == 8, "fwd_sm90: 128 query rows, two warpgroups");
    static_assert(BN == 64 || BN == 128, "fwd_sm90: key tiles of 64 or 128");
    static constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;  // one K or one V tile
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;                     // K, then V
    // Persistent up to head_dim 192: a second Q buffer receives the next work item's Q while this
    // item's last key tile and epilogue run. At 256 two do not fit (2 x 64 KB of Q + 2 x 64 KB of
    // K/V): one work item per block.
    static constexpr bool PERSIST = D <= 192;
    static constexpr int Q_BUFS = PERSIST ? 2 : 1;
    static constexpr int SMEM = Q_BUFS * Q_BYTES + 2 * STAGE_BYTES + sm90::kAtomBytes;  // + alignment slack
};

template <class T>
__device__ void fwd_sm90(const FwdParams& p) {
    using namespace sm90;
    constexpr int BM = T::BM, BN = T::BN, D = T::D, NT = T::NTHREADS;
    using Tile = QueryTile<BM, BN, T::CAUSAL, T::MASK, T::Q_BUFS>;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int next_item[2];  // the block's item after its current one, by the parity of the current one
    __shared__ Tile next_tile[2];  // that item's tile, a copy per warpgroup
    const u32 sQ0 = align_atom(smem_u32(smem));   // Q buffer b at sQ0 + b * Q_BYTES
    const u32 sKV = sQ0 + T::Q_BUFS * T::Q_BYTES;  // stage s: K at sKV + s * STAGE_BYTES, V KV_BYTES after it

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, w = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const int n_m = ceil_div(p.Sq, BM), n_items = n_m * p.H * p.B;

    auto make_tile = [&](int item, int slot) {
        const WorkItem wi = work_item<T::CAUSAL>(p, item, n_m);
        return Tile(p, wi.m, wi.h, wi.b, slot, tid, NT);
    };
    auto load_q = [&](const Tile& tl, int buf) {
        // tid made opaque here: otherwise the compiler keeps the copies' per-thread offsets in
        // registers from one item to the next (+25-35 registers)
        int tid_q = tid;
        asm volatile("" : "+r"(tid_q));
        load_tile_sw128<BM, D, NT>(sQ0 + buf * T::Q_BYTES, p.q + tl.b * p.q_sb + tl.row0 * p.q_ss + tl.h * p.q_sh,
                                   p.q_ss, tl.rows, tid_q);
    };
    auto load_kv = [&](const Tile& tl, int stage, int j) {
        int tid_kv = tid;
        asm volatile("" : "+r"(tid_kv));
        const u32 sK = sKV + stage * T::STAGE_BYTES;
        const i64 n0 = tl.vis->k_row0 + (i64)j * BN;
        const int rows = tl.vis->Ek - j * BN;
        load_tile_sw128<BN, D, NT>(sK, p.k + tl.b * p.k_sb + n0 * p.k_ss + tl.hk * p.k_sh, p.k_ss, rows, tid_kv);
        load_tile_sw128<BN, D, NT>(sK + T::KV_BYTES, p.v + tl.b * p.v_sb + n0 * p.v_ss + tl.hk * p.v_sh, p.v_ss, rows,
                                   tid_kv);
    };
    // Thread 0 claims the block's next item from the counter one item ahead (the atomic's latency
    // hides under an item's work) and publishes it in next_item before a barrier.
    auto claim = [&]() { return p.tile_counter ? (int)gridDim.x + atomicAdd(p.tile_counter, 1) : n_items; };

    int par = 0;  // parity of the block's current item: its Q buffer, tile slot and next_item entry
    int kv = 0;   // key tiles loaded so far: the next one goes to stage kv & 1
    Tile tile = make_tile(blockIdx.x, 0);
    int claimed = n_items;
    if (T::PERSIST && tid == 0) claimed = claim();
    load_q(tile, 0);
    if (tile.n_blocks > 0) load_kv(tile, 0, tile.key_tile(0));
    cp_async_commit();

    for (;;) {
        // This warpgroup's 64 query rows: rows 64 wg.. of every column block of the Q tile. A thread
        // holds rows 16 w + g (hh = 0) and 16 w + g + 8 (hh = 1) of them; its accumulator element
        // [4 j + 2 hh + e] is column 8 j + 2 t + e (wgmma.cuh: the accumulator layout).
        const u32 sQw = sQ0 + par * T::Q_BYTES + wg * 64 * kSwizzleBytes;
        const int row_base = tile.m0 + 64 * wg + 16 * w + g;
        const int n_blocks = tile.n_blocks;

        float o[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
        float row_max[2] = {-FRT_INF, -FRT_INF}, row_sum[2] = {0.f, 0.f};

        // The next item (whole block, after a barrier that published next_item): its tile in slot
        // par ^ 1, its Q into the other Q buffer, its first key tile into `stage`. The tile waits in
        // shared memory, a copy per warpgroup, read after the epilogue's warpgroup barrier (held in
        // registers through the last key tile, it cost the head_dim 192 kernel a spill).
        bool has_next = false;
        auto prefetch = [&](int stage) {
            if constexpr (T::PERSIST) {
                const int item = next_item[par];
                if (item < n_items) {
                    has_next = true;
                    const Tile next = make_tile(item, par ^ 1);
                    load_q(next, par ^ 1);
                    if (next.n_blocks > 0) load_kv(next, stage, next.key_tile(0));
                    if ((tid & 127) == 0) next_tile[wg] = next;
                }
            }
        };
        if (n_blocks == 0) {  // nothing to visit: only this item's Q is in flight
            if (T::PERSIST && tid == 0) next_item[par] = claimed;
            cp_async_wait<0>();
            __syncthreads();  // every Q copy landed before O overwrites its rows; next_item published
            prefetch(kv & 1);
            cp_async_commit();
        }

        // Key tiles last to first (as fwd.cu): the ones needing the element mask come first.
        for (int it = 0; it < n_blocks; ++it) {
            const int j = tile.key_tile(it), stage = (kv + it) & 1, n0 = j * BN;
            if (T::PERSIST && tid == 0 && it == n_blocks - 1) next_item[par] = claimed;
            cp_async_wait<0>();
            fence_proxy_async();  // this thread's cp.async writes -> visible to wgmma (async proxy)
            __syncthreads();      // every thread's writes landed; every warpgroup is done with the other stage
            if (it + 1 < n_blocks)
                load_kv(tile, stage ^ 1, tile.next_key_tile(it, j));
            else
                prefetch(stage ^ 1);  // lands while this tile and the epilogue run
            cp_async_commit();
            const u32 sK = sKV + stage * T::STAGE_BYTES, sV = sK + T::KV_BYTES;

            float s[BN / 2];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                wgmma_ss<BN, 0, T::BF16>(s, desc_k_major<BM>(sQw, kk), desc_k_major<BN>(sK, kk), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_operand(s);

            if (tile.needs_mask(it, j)) {
#pragma unroll
                for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        if (!tile.visible(row_base + 8 * (c >> 1), n0 + 8 * jj + 2 * t + (c & 1), tile.h))
                            s[4 * jj + c] = -FRT_INF;
            }

#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float mx = -FRT_INF;
#pragma unroll
                for (int jj = 0; jj < BN / 8; ++jj) mx = fmaxf(mx, fmaxf(s[4 * jj + 2 * hh], s[4 * jj + 2 * hh + 1]));
                const float m_new = fmaxf(row_max[hh], warp_max4(mx) * p.scale_log2);
                // A row that has seen only masked keys keeps m = -inf; subtract 0 then.
                const float base = m_new == -FRT_INF ? 0.f : m_new;
                const float alpha = fast_exp2(row_max[hh] - base);
                row_max[hh] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& x = s[4 * jj + 2 * hh + e];
                        x = fast_exp2(fmaf(x, p.scale_log2, -base));
                        sum += x;
                    }
                row_sum[hh] = row_sum[hh] * alpha + sum;
#pragma unroll
                for (int jj = 0; jj < D / 8; ++jj) o[4 * jj + 2 * hh] *= alpha, o[4 * jj + 2 * hh + 1] *= alpha;
            }

            u32 pa[BN / 16][4];
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) acc_to_a_frag<BN / 2, T::BF16>(s, kk, pa[kk]);
            wgmma_rs_wait<D, BN, T::BF16>(o, pa, sV);  // O += P V (after the o rescale and the pa writes)
        }
        kv += n_blocks;
        // The item after the next one: claimed now, read at the next one's last key tile.
        if (T::PERSIST && has_next && tid == 0) claimed = claim();

        // Epilogue: normalise, LSE, stage O into this warpgroup's own 64 rows of the Q tile (only it
        // read them, its wgmmas are complete, and every Q copy landed before the first key tile's
        // barrier or the barrier above), then 16-byte stores of the rows that exist.
        const int rows_wg = tile.rows - 64 * wg;
        float* glse = p.lse + tile.stat0 + 64 * wg;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float sum = warp_sum4(row_sum[hh]);
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
            for (int jj = 0; jj < D / 8; ++jj) o[4 * jj + 2 * hh] *= inv, o[4 * jj + 2 * hh + 1] *= inv;
            const int r = 16 * w + g + 8 * hh;
            if (t == 0 && r < rows_wg) glse[r] = sum > 0.f ? (row_max[hh] + __log2f(sum)) * kLn2 : -FRT_INF;
        }
        acc_to_sw128<BM, D, T::BF16>(sQw, o, 1.f, w, g, t);
        if (wg == 0)
            warpgroup_bar<1>();
        else
            warpgroup_bar<2>();
        sw128_rows_to_global<BM, D>(p.o + tile.b * p.o_sb + (tile.row0 + 64 * wg) * p.o_ss + tile.h * p.o_sh, p.o_ss,
                                    sQw, rows_wg, tid & 127);
        if (!has_next) break;
        // This Q buffer, slot and next_tile entry are next written at the next item's last key
        // tile (or its barrier without one), after its barriers.
        tile = next_tile[wg];
        par ^= 1;
    }
    cp_async_wait<0>();  // the last (empty) group
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(FwdSm90Traits, fwd_sm90, FwdParams)
#endif
