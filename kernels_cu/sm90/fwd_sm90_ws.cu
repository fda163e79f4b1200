// Attention forward on Hopper (sm_90a), warp-specialised and persistent: O = softmax(scale * Q K^T) V
// and LSE with wgmma, for dense and causal attention and every mask: padding and packed varlen lengths,
// windows and mask_mod (each thread finds a tile's keys by itself: mask_mod from its tile lists), block
// and segment ids (a search of the id arrays, which the producer warpgroup runs for the item it loads,
// and leaves in shared memory beside the item's Q slot: each row's interval of keys).
//
// 384 threads: warpgroups 0 and 1 consume (64 query rows each), warpgroup 2 produces; with 192-row query tiles
// (head_dim 64) 512: three consumer warpgroups and the producer. setmaxnreg moves registers from the producer
// (PRODUCER_REGS) to the consumers (CONSUMER_REGS).
// One block per SM loops over work items (params.cuh: work_item, BM-row query tiles ordered for L2
// and causal balance): block k starts with item k, and the producer claims each later item from a
// counter in global memory (p.sched: zero at the launch, set back to zero by its last claim) once it
// has issued the current item's last K / V tile, so that blocks take items greedily in that order, as
// the hardware hands out blocks (a static round-robin was 6% slower at 2k causal, and every earlier claim measured slower:
// docs/perf-notes.md: Per-item fixed cost). The producer decodes each
// item (WorkItem) for the consumers, beside the item in shared memory.
//
// The producer issues every load into a ring of Q_SLOTS Q slots, two K stages and two V stages of
// 128-byte-swizzled tiles (wgmma.cuh): a tile whose rows all lie inside the sequence by TMA (one thread
// issues, the mbarrier completes on the bytes: 6-7% faster than cp.async, docs/perf-notes.md: The producer, the ring and the epilogue), a ragged one by
// cp.async (its 128 threads' `cp.async.mbarrier.arrive.noinc`). The consumers hand a buffer back by
// arriving on its "empty" mbarrier. The producer runs up to two key tiles ahead, and, with two Q slots (the host's
// choice, where they fit), into the next item: its Q lands in the other slot while the consumers finish the current
// one. Where two slots do not fit beside the K / V stages (head_dim 256: 2 x 64 + 4 x 40 KiB; 192 at 112-key tiles,
// 128 at 176), the one slot goes back when the item's last S is complete (EARLY_Q), and O is stored from registers.
// Each consumer warpgroup runs fwd_sm90.cu's loop (S = Q K^T of tile it and O += P V of tile
// it - 1 issued together, tile it's softmax under the P V wgmma), and the warpgroups issue
// their wgmmas in turn (named barriers 4, 5 and 7): one's softmax runs under the others' wgmmas; not above
// head_dim 128 (FwdWsTraits::PINGPONG).
#include "sm90/fwd_sm90.cuh"

#ifndef FRT_FWD_PINGPONG_MAX_D  // (256: an A/B of FwdWsTraits::PINGPONG)
#define FRT_FWD_PINGPONG_MAX_D 128
#endif
#ifndef FRT_FWD_RESCALE_UNDER_S  // (0: an A/B of FwdWsTraits::RESCALE_UNDER_S)
#define FRT_FWD_RESCALE_UNDER_S 1
#endif
#ifndef FRT_FWD_V_LAGS  // (0: an A/B of FwdWsTraits::V_LAGS)
#define FRT_FWD_V_LAGS 1
#endif
#ifndef FRT_FWD_MAX_SLACK  // (0: an A/B of fwd_sm90.cuh's FwdRows::MAX_SLACK here)
#define FRT_FWD_MAX_SLACK 8
#endif
#ifndef FRT_MAX_CHAINS  // (1: an A/B of fwd_sm90.cuh's FwdRows::MAX_CHAINS above head_dim 64, where it is 1)
#define FRT_MAX_CHAINS 4
#endif
#ifndef FRT_FWD_TMA_TAILS  // (0: an A/B of FwdWsTraits::TMA_TAILS)
#define FRT_FWD_TMA_TAILS 1
#endif
#ifndef FRT_FWD_FREE_LOOP  // (0: an A/B of the causal loop below the diagonal where key and query tiles differ)
#define FRT_FWD_FREE_LOOP 1
#endif
#ifndef FRT_FWD_EARLY_Q  // (0: an A/B of FwdWsTraits::EARLY_Q)
#define FRT_FWD_EARLY_Q 1
#endif
#ifndef FRT_QK_WIDTH  // (spec.KernelSpec.qk_width: FwdWsTraits::QK_STEPS)
#define FRT_QK_WIDTH FRT_HEAD_DIM
#endif
#ifndef FRT_V_WIDTH  // (spec.KernelSpec.v_width: FwdWsTraits::DV)
#define FRT_V_WIDTH FRT_HEAD_DIM
#endif

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct FwdWsTraits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int MASK = FRT_MASK, NTHREADS = NW * 32, CONSUMER_WGS = BM / 64, CONSUMERS = BM * 2;
    static constexpr int PRODUCERS = 128;
    static constexpr bool IDS = MASK & (MASK_BLOCK_IDS | MASK_SEGMENTS);
    // CONSUMERS * CONSUMER_REGS + 128 * PRODUCER_REGS = NTHREADS * LAUNCH_REGS (168 x 384, 128 x 512). With id arrays the
    // producer searches (QueryTile), which spilled at 56 registers; the consumers fit 216 without mask_mod
    // (ids with mask_mod: fwd_sm90; both splits spilled, tiles.py). Above head_dim 128 (a 64 x D O accumulator of
    // 96-128 registers) 240 / 24 without ids: no spills, as with 224 / 56; the two not timed against each other.
    // Three consumer warpgroups: 160 / 32.
    static constexpr int CONSUMER_REGS = CONSUMER_WGS == 3 ? 160 : IDS ? 216 : D > 128 ? 240 : 224;
    static constexpr int LAUNCH_REGS = 65536 / NTHREADS / 8 * 8;
    static constexpr int PRODUCER_REGS = (NTHREADS * LAUNCH_REGS - CONSUMERS * CONSUMER_REGS) / 128;
    static_assert(!(IDS && (MASK & MASK_MOD)), "fwd_sm90_ws: ids with mask_mod take fwd_sm90");
    static_assert(D % 64 == 0 && D <= 256, "fwd_sm90_ws: head_dim 64, 128, 192 or 256 (whole swizzle blocks)");
    static_assert((BM == 128 || (BM == 192 && D == 64)) && NW == BM / 16 + 4,
                  "fwd_sm90_ws: 128 query rows (192 at head_dim 64), a consumer warpgroup per 64 and a producer one");
    static_assert(D > 128 ? BN % 16 == 0 && 64 <= BN && BN <= (D == 192 ? 112 : 80)
                          : BN == 64 || BN == 128 || (BN == 176 && D == 128 && !CAUSAL),
                  "fwd_sm90_ws: key tiles of 64 or 128 (176 at 128 not causal; above head_dim 128 64 to 80, 112 at "
                  "192: shared memory)");
    static constexpr int Q_SLOTS = FRT_Q_SLOTS;  // (spec.KernelSpec.q_slots: two where they fit)
    static_assert(Q_SLOTS == 1 || Q_SLOTS == 2, "fwd_sm90_ws: one or two Q slots");
    // One Q slot without id arrays (whose key intervals live beside the slot): each consumer warpgroup hands the slot
    // back once its last S is complete and stores O from registers, so that the next item's Q loads under the last
    // tile's softmax, P V and epilogue (docs/perf-notes.md: head_dim 192 and 256).
    static constexpr bool EARLY_Q = Q_SLOTS == 1 && !IDS && FRT_FWD_EARLY_Q;
    static constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
    // S = Q K^T over the first FRT_QK_WIDTH columns, O = P V over the first FRT_V_WIDTH (spec.KernelSpec.qk_width,
    // v_width): a head_dim between the instances (72 .. 120 at 128, 136 .. 184 at 192, ...) loads and keeps its tiles
    // at the instance's width, zero past its own columns, and skips the k-steps of S and the columns of O that would
    // hold only those zeros (docs/perf-notes.md: Padded head_dims).
    static_assert(FRT_QK_WIDTH % 16 == 0 && 0 < FRT_QK_WIDTH && FRT_QK_WIDTH <= D, "fwd_sm90_ws: qk width");
    static_assert(FRT_V_WIDTH % 16 == 0 && 0 < FRT_V_WIDTH && FRT_V_WIDTH <= D, "fwd_sm90_ws: v width");
    static constexpr int QK_STEPS = FRT_QK_WIDTH / 16, DV = FRT_V_WIDTH;
    // The consumer warpgroups take turns at the wgmmas (named barriers 4, 5, 7) up to head_dim 128; above it each
    // issues when its operands are there (FlashAttention-3 / 4's choice; docs/perf-notes.md: head_dim 192 and 256)
    static constexpr bool PINGPONG = D <= FRT_FWD_PINGPONG_MAX_D;
    // Without the turns, O's rescale by the last softmax runs under the S wgmma, before P V is issued (FA3 / 4's
    // order above head_dim 128), not between the P V wait and the S issue
    static constexpr bool RESCALE_UNDER_S = !PINGPONG && FRT_FWD_RESCALE_UNDER_S;
    // The producer fills K(it) before V(it - 1) (V a tile behind K), so that K, needed first in an iteration, does not
    // queue behind a V stage the slower warpgroup still holds; the consumers wait for V(it - 1) after issuing S(it),
    // right before P V (FlashAttention-3 / 4's order; docs/perf-notes.md: The producer, the ring and the epilogue)
    static constexpr bool V_LAGS = FRT_FWD_V_LAGS;
    // A ragged tile whose missing rows lie past the tensor's end (not packed varlen, the sequence running to the end of
    // its tensor: 1k keys in 176-key tiles) loads by TMA too, which fills those rows with zeros as cp.async would
    // (FlashAttention-3 / 4 load every tile by TMA); past a padded length or into the next packed sequence, cp.async
    static constexpr bool TMA_TAILS = FRT_FWD_TMA_TAILS;
    // mbarriers (8 bytes each): Q full / empty, K full / empty, V full / empty, two of each (Q: one per slot); then each Q
    // slot's work item (32 bytes: the item, an int, -1 when no work is left, and at 16 bytes its WorkItem,
    // decoded by the producer), then the producer's next claimed item (int). With id arrays, then each Q
    // slot's key intervals (QueryTile's shared_keys).
    enum : int { Q_FULL = 0, Q_EMPTY = 2, K_FULL = 4, K_EMPTY = 6, V_FULL = 8, V_EMPTY = 10, N_BARS = 12 };
    enum : int { SLOT_BYTES = 32, CLAIMED = 2 * SLOT_BYTES };
    static constexpr int BAR_BYTES = 192, KEYS_BYTES = IDS ? (int)sizeof(TileIntervals<BM>) : 0;
    static_assert(8 * N_BARS + CLAIMED + 4 <= BAR_BYTES, "fwd_sm90_ws: mbarriers and work items");
    static constexpr int SMEM = Q_SLOTS * Q_BYTES + 4 * KV_BYTES + BAR_BYTES + Q_SLOTS * KEYS_BYTES + sm90::kAtomBytes;  // + alignment slack
};

FRT_DEVICE void st_shared_s32(u32 at, int v) { asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at), "r"(v) : "memory"); }
FRT_DEVICE int ld_shared_s32(u32 at) {
    int v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(at) : "memory");
    return v;
}
FRT_DEVICE void st_shared_item(u32 at, const WorkItem& wi) { st_shared_v4(at, wi.m, wi.h, wi.b, wi.hk); }
// (Each field passed through lane 0, so that ptxas knows the item's loop bounds to be uniform: block_uniform.)
FRT_DEVICE WorkItem ld_shared_item(u32 at) {
    WorkItem wi;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(wi.m), "=r"(wi.h), "=r"(wi.b), "=r"(wi.hk) : "r"(at)
                 : "memory");
    return {block_uniform(wi.m), block_uniform(wi.h), block_uniform(wi.b), block_uniform(wi.hk)};
}

// The it-th key tile an item visits: causal without mask bits first to last, so that the diagonal tile
// comes last and its mask and softmax run under the other warpgroup's wgmmas (S=8k causal 6% faster than
// last to first, S=1k the same: docs/perf-notes.md: Causal work items); otherwise last to first, as the other
// kernels.
template <class Tile>
FRT_DEVICE int key_tile(const Tile& tile, int it) {
    return Tile::ROW_LIMIT ? tile.n_first + it : tile.key_tile(it);
}

// A producer's fill of one ROWS x D tile at s_tile, completing the mbarrier `full` (one arrival per producer):
// by TMA from `map` at (head h, row, batch entry b) when by_tma (all its rows inside the sequence, or the missing ones
// past the tensor's end: TMA_TAILS; thread 0 issues and announces the whole box's bytes, the others arrive), else by
// the zero-filling cp.async copy of its first `rows` rows and `cols` columns from g (row stride `stride`). (The map's
// bounds are the tensor's: TMA fills the columns past a padded head_dim with zeros and counts their bytes.)
template <int ROWS, int D, int PRODUCERS>
FRT_DEVICE void fill_tile(u32 s_tile, u32 full, bool by_tma, const void* map, int h, int row, int b, const u16* g,
                          i64 stride, int rows, int cols, int ptid) {
    using namespace sm90;
    if (by_tma) {
        if (ptid == 0) {
            mbar_arrive_expect_tx(full, ROWS * D * 2);
            load_tile_tma<ROWS, D>(s_tile, map, full, h, row, b);
        } else {
            mbar_arrive(full);
        }
    } else {
        load_tile_sw128<ROWS, D, PRODUCERS, 4>(s_tile, g, stride, rows, cols, ptid);  // (by 4: its few registers)
        mbar_arrive_cp_async(full);
    }
}

template <class T>
__device__ void fwd_sm90_ws(const FwdParams& p) {
    using namespace sm90;
    constexpr int BM = T::BM, BN = T::BN, D = T::D;
    extern __shared__ __align__(16) unsigned char smem[];
    const u32 sQ = align_atom(smem_u32(smem));         // slot s at sQ + s * Q_BYTES
    const u32 sK = sQ + T::Q_SLOTS * T::Q_BYTES;        // stage s at sK + s * KV_BYTES
    const u32 sV = sK + 2 * T::KV_BYTES;
    const u32 bars = sV + 2 * T::KV_BYTES, slots = bars + 8 * T::N_BARS;
    auto bar = [&](int which, u32 s) { return bars + 8 * (which + s); };
    auto slot_keys = [&](u32 s) {  // Q slot s's key intervals (id arrays)
        return reinterpret_cast<TileIntervals<BM>*>(smem + (bars + T::BAR_BYTES + s * T::KEYS_BYTES - smem_u32(smem)));
    };

    const int tid = threadIdx.x, lane = tid & 31;
    const int n_m = ceil_div(p.Sq, BM), n_items = n_m * p.H * p.B;
    if (tid == 0) {
        for (int s = 0; s < 2; ++s) {
            if (s < T::Q_SLOTS) mbar_init(bar(T::Q_FULL, s), T::PRODUCERS + 1);  // the producers' copies, and thread 0's item
            mbar_init(bar(T::K_FULL, s), T::PRODUCERS);
            mbar_init(bar(T::V_FULL, s), T::PRODUCERS);
            if (s < T::Q_SLOTS) mbar_init(bar(T::Q_EMPTY, s), T::CONSUMERS);
            mbar_init(bar(T::K_EMPTY, s), T::CONSUMERS);
            mbar_init(bar(T::V_EMPTY, s), T::CONSUMERS);
        }
    }
    __syncthreads();

    const int wg = block_uniform(tid >> 7);  // (uniform to ptxas: else it serialises the wgmmas below)
    if (wg == T::CONSUMER_WGS) {
        // ---- producer warpgroup ----
        setmaxnreg_dec<T::PRODUCER_REGS>();
        const int ptid = tid - T::CONSUMERS;
        int item = blockIdx.x;
        Ring<T::Q_SLOTS> qr;  // the Q slots' fills so far (common/wgmma.cuh: Ring)
        Ring<2> kr;           // ... and the K / V stages'
        for (;; ++qr) {
            const u32 qs = qr.slot();
            mbar_wait(bar(T::Q_EMPTY, qs), qr.free_parity());
            if (item >= n_items) {  // no work left: tell the consumers
                if (ptid == 0) {
                    st_shared_s32(slots + T::SLOT_BYTES * qs, -1);
                    mbar_arrive(bar(T::Q_FULL, qs));
                }
                mbar_arrive_cp_async(bar(T::Q_FULL, qs));
                break;
            }
            const WorkItem wi = work_item<T::CAUSAL>(p, item, n_m);
            const QueryTile<BM, BN, T::CAUSAL, T::MASK, true> tile(p, wi, ptid, T::PRODUCERS, slot_keys(qs), true);
            const bool packed = (T::MASK & MASK_LENGTHS) && p.cu_q;
            const int map_b = packed ? 0 : tile.b;  // packed varlen: one batch entry
            const bool q_tail = T::TMA_TAILS && !packed && tile.vis.Lq == p.Sq;  // (TMA_TAILS)
            const bool kv_tail = T::TMA_TAILS && !packed && tile.vis.Lk == p.Sk;
            const u32 q_full = bar(T::Q_FULL, qs);
            fill_tile<BM, D, T::PRODUCERS>(sQ + qs * T::Q_BYTES, q_full, p.use_tma && (tile.rows == BM || q_tail),
                                           &p.q_map, tile.h,
                                           (int)tile.row0, map_b,
                                           p.q + tile.b * p.q_sb + tile.row0 * p.q_ss + tile.h * p.q_sh, p.q_ss,
                                           tile.rows, p.head_dim, ptid);
            if (ptid == 0) {
                st_shared_s32(slots + T::SLOT_BYTES * qs, item);
                st_shared_item(slots + T::SLOT_BYTES * qs + 16, wi);
                mbar_arrive(q_full);
            }
            const u16* gk = p.k + tile.b * p.k_sb + tile.vis.k_row0 * p.k_ss + tile.hk * p.k_sh;
            const u16* gv = p.v + tile.b * p.v_sb + tile.vis.k_row0 * p.v_ss + tile.hk * p.v_sh;
            // key tile it's K (value: V) into its ring stage (the count `at`: K and V tile it share stage it % 2)
            auto fill_kv = [&](bool value, int it, Ring<2> at) {
                const int j = key_tile(tile, it), rows = tile.vis.Lk - j * BN;
                const u32 s = at.slot();
                const int krow = (int)tile.vis.k_row0 + j * BN;
                const bool by_tma = p.use_tma && (rows >= BN || kv_tail);
                mbar_wait(bar(value ? T::V_EMPTY : T::K_EMPTY, s), at.free_parity());
                if (value)
                    fill_tile<BN, D, T::PRODUCERS>(sV + s * T::KV_BYTES, bar(T::V_FULL, s), by_tma, &p.v_map, tile.hk,
                                                   krow, map_b, gv + (i64)j * BN * p.v_ss, p.v_ss, rows, p.head_dim_v,
                                                   ptid);
                else
                    fill_tile<BN, D, T::PRODUCERS>(sK + s * T::KV_BYTES, bar(T::K_FULL, s), by_tma, &p.k_map, tile.hk,
                                                   krow, map_b, gk + (i64)j * BN * p.k_ss, p.k_ss, rows, p.head_dim,
                                                   ptid);
            };
            if constexpr (T::V_LAGS) {
                for (int it = 0; it <= tile.n_blocks; ++it) {  // (one fill of each kind in the loop: fewer registers)
                    if (it < tile.n_blocks) fill_kv(false, it, kr);
                    if (it > 0) fill_kv(true, it - 1, kr.prev());
                    if (it < tile.n_blocks) ++kr;
                }
            } else {
                for (int it = 0; it < tile.n_blocks; ++it, ++kr) {
                    fill_kv(false, it, kr);
                    fill_kv(true, it, kr);
                }
            }
            // The next item, for all four warps: thread 0 claims it and writes it to shared memory
            // (after the Q slots' items), which none of them reads before the barrier below. (Named
            // barrier 6 is the producers' own: QueryTile's search of the id arrays uses it too.)
            // A launch makes n_items claims in all (each block's last one finds no item): the last claim sets the
            // counter back to 0 for the next launch on this stream (launch.sched_counter).
            if (ptid == 0) {
                const int c = atomicAdd(p.sched, 1);
                if (c == n_items - 1) atomicExch(p.sched, 0);
                st_shared_s32(slots + T::CLAIMED, c + (int)gridDim.x);
            }
            bar_wait<6, T::PRODUCERS>();
            item = ld_shared_s32(slots + T::CLAIMED);
            bar_wait<6, T::PRODUCERS>();  // (read by all before thread 0's next write)
        }
        return;
    }

    // ---- consumer warpgroups ----
    setmaxnreg_inc<T::CONSUMER_REGS>();
    const int w = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    // The wgmma turn, round robin from warpgroup 0 (named barrier 4: its turn, 5: warpgroup 1's, 7: warpgroup 2's;
    // 6 is the producer's).
    auto my_turn = [&] {
        if constexpr (!T::PINGPONG) return;
        if (wg == 0)
            bar_wait<4, 256>();
        else if (T::CONSUMER_WGS == 2 || wg == 1)
            bar_wait<5, 256>();
        else
            bar_wait<7, 256>();
    };
    auto their_turn = [&] {
        if constexpr (!T::PINGPONG) return;
        if (wg == 0)
            bar_arrive<5, 256>();
        else if (T::CONSUMER_WGS == 2 || wg == 2)
            bar_arrive<4, 256>();
        else
            bar_arrive<7, 256>();
    };
    if (T::PINGPONG && wg == T::CONSUMER_WGS - 1) bar_arrive<4, 256>();

    Ring<T::Q_SLOTS> qr;  // as the producer's
    Ring<2> kr;
    for (;; ++qr) {
        const u32 qs = qr.slot();
        mbar_wait(bar(T::Q_FULL, qs), qr.parity());
        if (block_uniform(ld_shared_s32(slots + T::SLOT_BYTES * qs)) < 0) break;
        fence_proxy_async();  // the producer's cp.async writes -> visible to wgmma (async proxy)
        // The item as the producer decoded it: its divisions took ~0.5 us of each item's start here (docs/perf-notes.md: Per-item fixed cost).
        const WorkItem wi = ld_shared_item(slots + T::SLOT_BYTES * qs + 16);
        const QueryTile<BM, BN, T::CAUSAL, T::MASK, true> tile(p, wi, tid, T::CONSUMERS, slot_keys(qs));
        const int n_blocks = tile.n_blocks;
        // This warpgroup's 64 query rows of the Q tile (fwd_sm90.cuh: which of them a thread holds).
        const u32 sQw = sQ + qs * T::Q_BYTES + wg * 64 * kSwizzleBytes;
        const int row_base = tile.m0 + 64 * wg + 16 * w + g;
        // (the row maximum in one chain at head_dim 64, where four measured 1-3% slower at 1k: docs/perf-notes.md: The
        // producer, the ring and the epilogue)
        FwdRows<T::DV, BN, T::BF16, true, FRT_FWD_MAX_SLACK, D <= 64 ? 1 : FRT_MAX_CHAINS> r;
        if constexpr (FRT_SOFTCAP) r.cap = Softcap(p.softcap, p.scale_log2);
        if constexpr (FRT_ALIBI) r.alibi = Alibi(p, tile.b, tile.h, tile.vis.shift);
        if constexpr (FRT_SCORE_MOD) r.smod = ScoreMod(p, tile.b, tile.h, tile.vis);
        if constexpr (FRT_DROPOUT) r.drop = Dropout(p, tile.b, tile.h);
        // Key tile it: S = Q K^T of it and O += P V of it - 1 issued, S complete; returns the tile (j) for the softmax.
        auto key_step = [&](int it) {
            const int j = key_tile(tile, it);
            const u32 st = kr.slot(), full = kr.parity();  // (the other stage: st ^ 1)
            // P V of tile it - 2 (issued last iteration) is done: its V stage goes back
            r.template retire_pv<!T::RESCALE_UNDER_S>();
            if (it > 1) mbar_arrive(bar(T::V_EMPTY, st));
            mbar_wait(bar(T::K_FULL, st), full);
            if (!T::V_LAGS && it > 0) mbar_wait(bar(T::V_FULL, st ^ 1), kr.prev().parity());
            fence_proxy_async();

            my_turn();
            wgmma_fence();
            wgmma_abt<BN, BM, T::QK_STEPS, T::BF16>(r.s, sQw, sK + st * T::KV_BYTES);
            wgmma_commit();
            if (it > 0) {
                if constexpr (T::V_LAGS) mbar_wait_for_wgmma(bar(T::V_FULL, st ^ 1), kr.prev().parity());
                if constexpr (T::RESCALE_UNDER_S) {
                    r.rescale_o();
                    wgmma_fence();  // (O's rescaled registers before the P V wgmma reads them)
                }
                wgmma_rs_mn<T::DV, BN, T::BF16>(r.o, r.pa, sV + (st ^ 1) * T::KV_BYTES);
                wgmma_commit();
                their_turn();
                wgmma_wait<1>();  // S is complete; P V may still run
            } else {
                their_turn();
                wgmma_wait<0>();
            }
            fence_operand(r.s);
            mbar_arrive(bar(T::K_EMPTY, st));
            if (T::EARLY_Q && it == n_blocks - 1) mbar_arrive(bar(T::Q_EMPTY, qs));  // (its last read of Q)
            return j;
        };
        int it = 0;
        // Causal without mask bits: the key tiles visible to every row, visited first, take the softmax without a
        // mask test, in a loop of their own (the same tests as branches inside one loop cost 1% at S=1k;
        // docs/perf-notes.md: Causal work items).
        // - BN == BM, where the last key tile's diagonal is the query tile's (the shift between queries and keys a
        //   whole number of tiles, as with Sq = Sk or top-left) and its rows and keys lie inside the sequence: every
        //   tile but that last one; on it each warpgroup compares only its 64 keys of the diagonal (warpgroup 0's
        //   rows, the first 64, see none of the last 64 keys).
        // - BN != BM (head_dim 192 / 256): the tiles wholly below the diagonal (all of the first row's keys, inside
        //   both sequences: Visibility::all_visible in closed form); the diagonal's the loop below. Not at head_dim
        //   64's 192-row tiles: 1-2% slower there, and 12 bytes spilled with 16-bit dropout draws.
        if constexpr (T::CAUSAL && T::MASK == 0 && (BN == BM || (BM != 192 && FRT_FWD_FREE_LOOP))) {
            const bool diagonal = BN == BM && n_blocks > 0 && tile.m0 + BM <= tile.vis.Lq &&
                                  (tile.n_first + n_blocks) * BN <= tile.vis.Lk &&
                                  tile.m0 + tile.vis.shift == (tile.n_first + n_blocks - 1) * BN;
            if (BN != BM || diagonal) {
                const int below = tile.m0 + BM <= tile.vis.Lq ? min(tile.vis.Lk, tile.m0 + tile.vis.shift + 1) : 0;
                const int n_free = diagonal ? n_blocks - 1 : min(max(0, below) / BN - tile.n_first, n_blocks);
                for (; it < n_free; ++it, ++kr) {
                    const int n0 = key_step(it) * BN;
                    r.mod_scores(row_base, n0, t);
                    r.online(p.scale_log2, row_base, n0, t);
                }
                if (diagonal) {
                    const int j = key_step(it);
                    if (wg == 0)
                        r.template softmax_diagonal<0, BN / 16>(tile, j, row_base, t, p.scale_log2);
                    else
                        r.template softmax_diagonal<BN / 16, BN / 8>(tile, j, row_base, t, p.scale_log2);
                    ++it, ++kr;
                }
            }
        }
        for (; it < n_blocks; ++it, ++kr) {
            const int j = key_step(it);
            r.softmax(tile, it, j, row_base, t, p.scale_log2);
        }
        r.retire_pv();
        if (n_blocks > 1) mbar_arrive(bar(T::V_EMPTY, kr.slot()));  // tile n_blocks - 2's
        // P V of the last key tile, and the row sums and LSE while it runs. (The wait outside the branch: with
        // finish_rows in both branches the dense forward ran 1% slower: docs/perf-notes.md, Per-item fixed cost.)
        const bool last_pv = n_blocks > 0;
        const u32 sl = kr.slot() ^ 1;  // the last tile's stage
        if (last_pv) {
            mbar_wait(bar(T::V_FULL, sl), kr.prev().parity());
            fence_proxy_async();
            wgmma_fence();
            wgmma_rs_mn<T::DV, BN, T::BF16>(r.o, r.pa, sV + sl * T::KV_BYTES);
            wgmma_commit();
        }
        r.finish_rows(p, tile, wg, w, g, t);
        wgmma_wait<0>();
        fence_operand(r.o);
        if (last_pv) mbar_arrive(bar(T::V_EMPTY, sl));
        if constexpr (T::EARLY_Q) {
            if (n_blocks == 0) mbar_arrive(bar(T::Q_EMPTY, qs));
            r.store_o_direct(p, tile, wg, w, g, t);
        } else {
            r.template store_o<BM, T::CONSUMER_WGS>(p, tile, sQw, wg, w, g, t);  // O staged in this slot, then stored
            fence_proxy_async();  // this slot's generic reads and writes before the next TMA load into it
            mbar_arrive(bar(T::Q_EMPTY, qs));
        }
    }
    if (T::PINGPONG && wg == 0) bar_wait<4, 256>();  // the last warpgroup's last "your turn"
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(FwdWsTraits, fwd_sm90_ws, FwdParams)
#endif
