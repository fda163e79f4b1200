// Fused attention backward on Hopper (sm_90a), warp-specialised: dK and dV of one key tile, and the tile's dQ
// contributions added into the fp32 buffer dq_accum, in one kernel of five wgmmas per (query head, query tile) pair
// where the split pair (bwd_dkdv_sm90.cu, whose math and grid this kernel shares, and bwd_dq_sm90.cu) runs seven.
// Each consumer warpgroup stores its dS^T fragments (16-bit, the A operands of dK) by stmatrix into its 64 rows of a
// [key][query] sw128 tile; both then compute their share of the pair's dQ = dS K (half its columns, or with 128-query
// tiles half its rows) with an SS wgmma (A = that tile read MN-major, i.e. transposed: dS; B = the K tile's columns,
// MN-major) and stage it in fp32; one thread adds the
// staged tile into dq_accum with one TMA bulk reduce-add (cp.reduce.async.bulk .add.f32: atomic per element; one op per
// pair: an op per row ran the backward at 0.72x the speed, docs/perf-notes.md: Backward: fused wgmma). bwd_preprocess
// zeroes the buffer, bwd_dq_convert un-permutes, scales and casts it (bwd_sm90.cuh: stage_dq, the permutation).
// Ordered (dq_sem set, deterministic=True): the key tiles that see a query tile add into it in key-tile order, as
// bwd_dkdv.cu's fused variant orders them: a counter per (batch, head, query tile).
//
// The roles, which take the loads, the adds and their waits off the warpgroups that compute:
//
// 384 threads. Warpgroups 0 and 1 compute (64 of the block's 128 keys each, dK and dV in registers); warp 8 loads,
// lane 0 of warp 9 adds dQ, the rest of the producer warpgroup leaves at once. setmaxnreg moves registers from the
// producer warpgroup to the consumers (PRODUCER_REGS, CONSUMER_REGS). Every handoff between roles is an mbarrier.
//   - The loader fills K and V once (KV_FULL), then each pair's Q, dO, lse2 and delta into a ring of STAGES stages
//     (FULL / EMPTY, common/wgmma.cuh: Ring): tiles whose rows all exist by TMA (one lane issues, the barrier
//     completes on the bytes), others and the statistics by loads and shared stores (bwd_sm90.cuh: load_query_stage).
//     The consumers hand a stage back once their dV and dK wgmmas, the last to read it, are complete.
//   - Per pair each consumer warpgroup computes S^T and dP^T (SS wgmma), P^T and dS^T on the fragments, dV += P^T dO
//     (RS), writes its dS^T rows into one of two dS^T tiles, meets the other at named barrier 4 (the pair's whole
//     dS^T is there; with two tiles no barrier guards a tile's reuse: a tile's readers of two pairs ago have passed
//     this barrier since), issues its share of dQ = dS K (SS), then dK += dS^T Q (RS), and stages dQ in fp32 while
//     dK runs (bwd_sm90.cuh: stage_dq) once the writer has read the previous pair's (DQ_EMPTY; ordered causal, it waits
//     for dK and hands the stage back first), then tells the writer (DQ_FULL).
//   - At head_dim 64 the query tiles are 128 rows (WIDE; docs/perf-notes.md: head_dim 64: 128-query tiles): S^T and
//     dP^T are 64 x 128 a warpgroup, K and V stay in shared memory, dV is issued once dS^T is formed, and each
//     warpgroup's share of dQ is its 64 queries (all columns) rather than half the columns of all 64.
//   - The writer adds the staged tile with one bulk reduce-add and hands the tile back once the add has read it.
//     Ordered (dq_sem set, deterministic=True), it first waits for its key tile's turn on the query tile's counter
//     (key tiles in order; causal or split, the grid key-tile-major: key_block_tile_major; else a row's key tiles
//     together, whose blocks share its Q and dO in L2: docs/perf-notes.md, Ordered grid; with p.dq_rotate, in the
//     order they reach the query tile: params.cuh, dq_turn) and releases the next once its add is performed: the
//     consumers never wait for a turn.
#include "sm90/bwd_sm90.cuh"

#ifndef FRT_EARLY_PAIR  // (0: an A/B of the early pair)
#define FRT_EARLY_PAIR 1
#endif
#ifndef FRT_PAIR_RECORD  // (0: an A/B of the pair record)
#define FRT_PAIR_RECORD 1
#endif
#ifndef FRT_CAP_GRADS  // (0: an A/B of the softcap derivative's copies)
#define FRT_CAP_GRADS 1
#endif

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct FusedWsTraits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int MASK = FRT_MASK, NTHREADS = NW * 32, CONSUMERS = 256;
    static_assert(D == 64 || D == 128, "bwd_fused_sm90_ws: head_dim 64 or 128");
    static_assert((BM == 64 || (BM == 128 && D == 64)) && BN == 128 && NW == 12,
                  "bwd_fused_sm90_ws: 64-row query tiles (128 at head_dim 64), 128 keys (64 per consumer warpgroup), "
                  "12 warps");
    // 2 * 128 * CONSUMER_REGS + 128 * PRODUCER_REGS = 168 * 384, the launch's count. The consumers spill below 240
    // registers at head_dim 128 (16 bytes at 232), 232 at 64 (either tile); the producers' 24 at 128 spill 24-48
    // bytes, by mask (tiles.SPILL_ALLOWANCE).
    static constexpr bool WIDE = BM == 128;  // 128 queries a pair: S^T, dP^T 64 x 128 a warpgroup
    static constexpr int CONSUMER_REGS = D == 64 ? 232 : 240;
    static constexpr int PRODUCER_REGS = (168 * 384 - 2 * 128 * CONSUMER_REGS) / 128;
    static constexpr bool INTERVALS = MASK != 0 || D <= 64;  // as bwd_dkdv_sm90.cu's
    static constexpr bool ORDERED = !(MASK & (MASK_SEGMENTS | MASK_MOD));  // (flashrt/masks.py: ordered_dq_ok)
    // K and V rows as the A operands of S^T and dP^T (bwd_dkdv_sm90.cu); not with 128-query tiles (the registers),
    // nor with a score_mod (beside its expression's registers they spilled 4-16 bytes, NVRTC 12.9)
    static constexpr bool KV_REGS = D == 64 && !WIDE && !FRT_SCORE_MOD;
    static constexpr int STAGES = D == 64 && !WIDE ? 4 : 2;  // (spec.py's smem formula: the same)
    // dQ per consumer warpgroup: half its columns (64-query tiles) or its 64 rows (128-query tiles)
    static constexpr int DQ_N = WIDE ? D : D / 2;
    static constexpr int KV_BYTES = BN * D * 2, QT_BYTES = BM * D * 2, STAGE_BYTES = 2 * QT_BYTES;
    // Each pair's (query head, query tile, partial) reaches the consumers under the wgmmas of the pair before it
    // (docs/perf-notes.md: Per-pair fixed cost, Early pair): found by them there (EARLY_PAIR), or else by the loader,
    // which leaves it beside the stage's statistics (RECORD). Early, not with 128-query tiles, id arrays or mask_mod:
    // beside their fragments or lists it spilled (6-68 bytes).
    static constexpr bool EARLY_PAIR = FRT_EARLY_PAIR && !WIDE && !(MASK & (MASK_MOD | MASK_BLOCK_IDS | MASK_SEGMENTS));
    static constexpr bool RECORD = FRT_PAIR_RECORD && !EARLY_PAIR;
    // Softcap: 1 - tanh^2 kept beside P^T in 16 bits, BM / 4 registers (bwd_sm90.cuh: probabilities), not recovered
    // from P^T by an lg2 (docs/perf-notes.md: Softcap); not with 128-query tiles (those spill already)
    static constexpr bool CAP_GRADS = FRT_SOFTCAP && FRT_CAP_GRADS && !WIDE;
    // a stage's lse2[BM], delta[BM], then the pair record at RECORD_AT (int4: h, m, partial; spec.py's smem formula:
    // the same)
    static constexpr int RECORD_AT = 2 * BM * 4, STAT_STAGE_BYTES = RECORD_AT + 16;
    static constexpr int DS_BYTES = BN * BM * 2, DQ_BYTES = BM * D * 4;
    enum : int { KV_FULL = 0, DQ_FULL = 1, DQ_EMPTY = 2, FULL = 3, EMPTY = 3 + STAGES, N_BARS = 3 + 2 * STAGES };
    static constexpr int JOB_BYTES = 32;  // the writer's job: dq_accum offset (i64), bytes, counter, turn
    static constexpr int SMEM = 2 * KV_BYTES + STAGES * (STAGE_BYTES + STAT_STAGE_BYTES) + 2 * DS_BYTES + DQ_BYTES +
                                8 * N_BARS + JOB_BYTES + sm90::kAtomBytes;
};

template <class T>
__device__ void bwd_fused_sm90_ws(const BwdParams& p) {
    using namespace sm90;
    constexpr int BM = T::BM, BN = T::BN, D = T::D, S = T::STAGES;
    extern __shared__ __align__(16) unsigned char smem[];
    const u32 smem_base = smem_u32(smem);
    const u32 sK = align_atom(smem_base), sV = sK + T::KV_BYTES;
    const u32 sQdO = sV + T::KV_BYTES;             // stage s: Q at sQdO + s * STAGE_BYTES, dO QT_BYTES after
    const u32 sdS = sQdO + S * T::STAGE_BYTES;      // two dS^T tiles [key][query]
    const u32 sDQ = sdS + 2 * T::DS_BYTES;          // the dQ staging tile
    const u32 sStat = sDQ + T::DQ_BYTES;  // stage s: lse2[BM], delta[BM], the pair record (STAT_STAGE_BYTES)
    const u32 bars = sStat + S * T::STAT_STAGE_BYTES;
    const u32 sJob = bars + 8 * T::N_BARS;  // the staged dQ tile's add (the consumers' thread 0 writes it)
    auto bar = [&](int which, int s) { return bars + 8 * (which + s); };

    const int tid = threadIdx.x, lane = tid & 31;
    const bool ordered = T::ORDERED && p.dq_sem;
    if (tid == 0) {
        mbar_init(bar(T::KV_FULL, 0), 32);
        mbar_init(bar(T::DQ_FULL, 0), T::CONSUMERS);
        mbar_init(bar(T::DQ_EMPTY, 0), 1);
        for (int s = 0; s < S; ++s) mbar_init(bar(T::FULL, s), 33), mbar_init(bar(T::EMPTY, s), T::CONSUMERS);
    }
    __syncthreads();
    KeyTile<BM, BN, T::CAUSAL, T::MASK, rotatable(T::CAUSAL, T::MASK)> tile(
        p, ordered && (T::CAUSAL || p.splits > 1) ? key_block_tile_major(p.sched_key_pairs)
                                                : key_block<T::CAUSAL>(p.sched_key_pairs),
        tid, T::NTHREADS);
    if (ordered) tile.rotate_if_asked(p);
    if (tile.rows <= 0) {  // (a programmatic dependent ends after the grid before it: spec.PROGRAMMATIC)
        wait_previous_grid();
        return;
    }
    const int it_begin = block_uniform(tile.it_begin), it_end = block_uniform(tile.it_end);

    const int wg = block_uniform(tid >> 7);
    if (wg == 2) {
        setmaxnreg_dec<T::PRODUCER_REGS>();
        const int warp = (tid >> 5) & 3;
        if (warp == 0) {  // ---- the loader ----
            // K and V by TMA where all of the tile's keys exist, else by loads and stores
            const u32 kv_full = bar(T::KV_FULL, 0);
            const i64 krow0 = tile.vis.k_row0 + tile.n0;
            if (p.use_tma && lane == 0) {
                prefetch_tensormap(&p.q_map);
                prefetch_tensormap(&p.do_map);
            }
            if (p.use_tma && tile.live == BN) {
                if (lane == 0) {
                    const int kb = (T::MASK & MASK_LENGTHS) && p.cu_k ? 0 : tile.b;  // packed varlen: one entry
                    mbar_arrive_expect_tx(kv_full, 2 * T::KV_BYTES);
                    load_tile_tma<BN, D>(sK, &p.k_map, kv_full, tile.hk, (int)krow0, kb);
                    load_tile_tma<BN, D>(sV, &p.v_map, kv_full, tile.hk, (int)krow0, kb);
                } else {
                    mbar_arrive(kv_full);
                }
            } else {
                copy_tile_sw128_warp<BN, D>(sK, p.k + tile.b * p.k_sb + krow0 * p.k_ss + tile.hk * p.k_sh, p.k_ss,
                                            tile.live, p.head_dim, lane);
                copy_tile_sw128_warp<BN, D>(sV, p.v + tile.b * p.v_sb + krow0 * p.v_ss + tile.hk * p.v_sh, p.v_ss,
                                            tile.live, p.head_dim_v, lane);
                mbar_arrive(kv_full);
            }
            // Launched as bwd_preprocess's programmatic dependent (spec.KernelSpec.programmatic), this block may have
            // started while the preprocess runs: K and V (the caller's) are on their way, lse2 and delta (its) are
            // read once it has finished, its writes visible (docs/perf-notes.md: Per-block fixed cost).
            wait_previous_grid();
            Ring<S> r;
            for (int it = it_begin; it < it_end; ++it, ++r) {
                const int s = (int)r.slot();
                const u32 full = bar(T::FULL, s);
                mbar_wait(bar(T::EMPTY, s), r.free_parity());
                if (T::RECORD && lane == 0) {  // (before load_query_stage's arrival)
                    const auto pr = tile.pair(p, it);
                    st_shared_v4(sStat + s * T::STAT_STAGE_BYTES + T::RECORD_AT, pr.h, pr.m, pr.partial, 0);
                }
                load_query_stage<T, 32>(p, tile, it, sQdO + s * T::STAGE_BYTES, sStat + s * T::STAT_STAGE_BYTES,
                                        lane, full);  // (its 33 arrivals)
            }
        } else if (warp == 1 && lane == 0) {  // ---- the dQ writer ----
            const int* job = reinterpret_cast<const int*>(smem + (sJob - smem_base));
            wait_previous_grid();  // (dq_accum zeroed by bwd_preprocess: above)
            Ring<1> staged;  // the dQ stage's fills so far (one slot)
            for (int it = it_begin; it < it_end; ++it, ++staged) {
                mbar_wait(bar(T::DQ_FULL, 0), staged.parity());  // both warpgroups have staged the pair's dQ and job
                const int sem_at = job[3], turn = job[4], bytes = job[2];
                const i64 at = *reinterpret_cast<const i64*>(job);
                if (sem_at >= 0)
                    while (ld_acquire(p.dq_sem + sem_at) != turn) {
                    }
                if (bytes > 0) {  // (a query tile's first turn stores where every row has one: p.dq_first_store)
                    if (sem_at >= 0 && turn == 0 && p.dq_first_store)
                        bulk_store(p.dq_accum + at, sDQ, bytes);
                    else
                        bulk_reduce_add_f32(p.dq_accum + at, sDQ, bytes);
                }
                bulk_commit();
                bulk_wait_read<0>();
                if (it + 1 < it_end) mbar_arrive(bar(T::DQ_EMPTY, 0));  // the staging tile (and job) is free
                if (sem_at >= 0) {
                    // The add is performed, then released to the next key tile's acquire by the store alone: a
                    // __threadfence() before it cost 0-9% of the ordered backward (docs/perf-notes.md: The writer's
                    // fence).
                    bulk_wait<0>();
                    st_release(p.dq_sem + sem_at, turn + 1);
                }
            }
            bulk_wait<0>();
        }
        return;
    }

    // ---- consumer warpgroups ----
    setmaxnreg_inc<T::CONSUMER_REGS>();
    const int wtid = tid & 127, w = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const int b = tile.b, hk = tile.hk, n0 = tile.n0;
    const Softcap cap = FRT_SOFTCAP ? Softcap(p.softcap, p.scale_log2) : Softcap();
    const ScoreMod smod = FRT_SCORE_MOD ? ScoreMod(p, tile.b, 0, tile.vis) : ScoreMod();  // (the head: each pair's)
    const Dropout drop = FRT_DROPOUT ? Dropout(p, tile.b, 0) : Dropout();             // (the head: each pair's)
    static_assert(!(FRT_DROPOUT && FRT_SCORE_MOD), "bwd_fused_sm90: no variant with dropout and score_mod");
    const float* stat_base = reinterpret_cast<const float*>(smem + (sStat - smem_base));
    // This warpgroup's 64 keys: rows 64 wg.. of every column block of the K and V tiles; accumulator layouts as in
    // bwd_dkdv_sm90.cu (S^T / dP^T element [4 j + 2 hh + e]: key 16 w + g + 8 hh, query 8 j + 2 t + e).
    const u32 sKw = sK + wg * 64 * kSwizzleBytes, sVw = sV + wg * 64 * kSwizzleBytes;
    const int key_base = n0 + 64 * wg + 16 * w + g;
    float acc[2][D / 2];  // dK, dV
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int i = 0; i < D / 2; ++i) acc[a][i] = 0.f;
    u32 pa[BM / 16][4], dsa[BM / 16][4];
    u32 ka[T::KV_REGS ? D / 16 : 1][4], va[T::KV_REGS ? D / 16 : 1][4];
    mbar_wait(bar(T::KV_FULL, 0), 0);
    fence_proxy_async();  // the loader's cp.async writes -> visible to wgmma (async proxy)
    if constexpr (T::KV_REGS) {
        sw128_to_a_frags<BN, D>(sKw, ka, w, g, t);
        sw128_to_a_frags<BN, D>(sVw, va, w, g, t);
    }
    // EARLY_PAIR: pair it + 1 and its hidden bits are found under pair it's dQ and dK wgmmas (at the loop's head
    // they held both warpgroups, with the tensor pipe idle); RECORD: the pair is read from its stage.
    using Tile = decltype(tile);
    constexpr bool EARLY_PAIR = T::EARLY_PAIR;
    auto hidden_of = [&](const typename Tile::Pair& q) -> HiddenWord<BM> {
        return q.partial ? hidden_bits<BM, T::INTERVALS>(tile, q.h, q.m, key_base, t) : 0;
    };
    typename Tile::Pair pr_next{};
    HiddenWord<BM> hidden_next = 0;
    if (EARLY_PAIR && it_begin < it_end) {
        pr_next = tile.pair(p, it_begin);
        hidden_next = hidden_of(pr_next);
    }
    Ring<S> r;
    for (int it = it_begin; it < it_end; ++it, ++r) {
        const int s_ = (int)r.slot();
        const u32 sQ = sQdO + s_ * T::STAGE_BYTES, sdO = sQ + T::QT_BYTES;
        const float* s_lse2 = stat_base + s_ * (T::STAT_STAGE_BYTES / 4);
        const float* s_delta = s_lse2 + BM;
        mbar_wait(bar(T::FULL, s_), r.parity());
        auto stage_pair = [&] {
            const int4 rec = *reinterpret_cast<const int4*>(s_lse2 + T::RECORD_AT / 4);
            return typename Tile::Pair{rec.x, rec.y, rec.z != 0};
        };
        const auto pr = EARLY_PAIR ? pr_next : T::RECORD ? stage_pair() : tile.pair(p, it);
        const HiddenWord<BM> hidden = EARLY_PAIR ? hidden_next : hidden_of(pr);
        fence_proxy_async();
        float sc[BM / 2], dp[BM / 2];
        u32 capg[T::CAP_GRADS ? BM / 4 : 1];  // (CAP_GRADS)
        wgmma_fence();  // orders the dK / dV accumulator and fragment writes before the wgmmas
        if constexpr (T::KV_REGS) {
            wgmma_abt<BM, D / 16, T::BF16>(sc, ka, sQ);
            wgmma_commit();
            wgmma_abt<BM, D / 16, T::BF16>(dp, va, sdO);
        } else {
            wgmma_abt<BM, BN, D / 16, T::BF16>(sc, sKw, sQ);
            wgmma_commit();
            wgmma_abt<BM, BN, D / 16, T::BF16>(dp, sVw, sdO);
        }
        wgmma_commit();
        // lse2 read under the wgmmas (load_row_stats); with dropout, after them (beside its draws 32 bytes spilled)
        constexpr bool EARLY_LSE = !FRT_SCORE_MOD && !FRT_DROPOUT;
        float2 lse[BM / 8];
        if constexpr (EARLY_LSE) load_row_stats<BM>(lse, s_lse2, t);
        HiddenWord<BM> dropped = 0;  // (FRT_DROPOUT, under the wgmmas)
        if constexpr (FRT_DROPOUT) dropped = dropped_bits<BM>(drop.head(b, pr.h, p.H), key_base, pr.m * BM, t);
        wgmma_wait<1>();  // S^T is complete
        fence_operand(sc);
        // (FRT_SCORE_MOD: P^T packed here and P^T f' left in sc for ds_from_dp: mod_probabilities_packed)
        static_assert(!(FRT_SCORE_MOD && T::WIDE), "bwd_fused_sm90: score_mod variants have 64-query tiles");
        if constexpr (FRT_SCORE_MOD) {
            mod_probabilities_packed<BM, T::BF16>(sc, pa, s_lse2, hidden, smod.head(pr.h), key_base,
                                                  pr.m * BM, t);
        } else {
            add_alibi<BM>(sc, p, tile, pr.h, pr.m, key_base, t);
            if constexpr (!EARLY_LSE) load_row_stats<BM>(lse, s_lse2, t);
            if constexpr (T::CAP_GRADS)
                probabilities<BM, T::BF16>(sc, lse, p.scale_log2, hidden, cap, capg);
            else
                probabilities<BM>(sc, lse, p.scale_log2, hidden, cap);
        }
        auto pack_p = [&] {
            if constexpr (FRT_DROPOUT) {
                pack_kept<BM, T::BF16>(sc, pa, dropped, drop.scale);
            } else if constexpr (!FRT_SCORE_MOD) {
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2, T::BF16>(sc, kk, pa[kk]);
            }
        };
        auto mma_dv = [&] {  // dV += P^T dO
            wgmma_fence();
            wgmma_rs_mn<D, BM, T::BF16>(acc[1], pa, sdO);
            wgmma_commit();
        };
        if constexpr (!T::WIDE) {
            pack_p();
            mma_dv();  // under dS^T's arithmetic
            wgmma_wait<1>();  // dP^T is complete
        } else {
            wgmma_wait<0>();  // dP^T is complete; dV after dS^T (P^T's fragments beside S^T and dP^T spilled)
        }
        fence_operand(dp);
        if constexpr (FRT_DROPOUT) kept_dp(dp, dropped, drop.scale);
        if constexpr (T::CAP_GRADS)
            ds_from_dp<BM, T::BF16>(dp, sc, s_delta, t, capg);
        else
            ds_from_dp<BM>(dp, sc, s_delta, t, s_lse2, cap);
        if constexpr (T::WIDE) pack_p();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2, T::BF16>(dp, kk, dsa[kk]);
        const u32 sdSp = sdS + (it & 1) * T::DS_BYTES;  // this pair's dS^T tile
        a_frags_to_sw128<BN, BM>(sdSp + wg * 64 * kSwizzleBytes, dsa, w, g, t);
        fence_proxy_async();
        if constexpr (T::WIDE) mma_dv();
        bar_wait<4, T::CONSUMERS>();  // both warpgroups' dS^T rows are in the tile
        // This warpgroup's block of dS K (its DQ_N columns, or with 128-query tiles its 64 queries): A = dS^T read
        // MN-major (dS), B = the K tile's columns (MN-major); then dK (RS).
        float dq[T::DQ_N / 2];
        const u32 sKcols = sK + (T::WIDE ? 0 : D == 128 ? wg * BN * kSwizzleBytes : wg * T::DQ_N * 2);
        const u32 sdSrows = sdSp + (T::WIDE ? wg * BN * kSwizzleBytes : 0);  // (the tile's query column block)
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_ss<T::DQ_N, 1, T::BF16, 1>(dq, desc_mn_major<BN>(sdSrows, kk), desc_mn_major<BN>(sKcols, kk), kk > 0);
        wgmma_commit();
        wgmma_rs_mn<D, BM, T::BF16>(acc[0], dsa, sQ);  // dK += dS^T Q
        wgmma_commit();
        if (EARLY_PAIR && it + 1 < it_end) {
            pr_next = tile.pair(p, it + 1);
            hidden_next = hidden_of(pr_next);
        }
        wgmma_wait<1>();  // dV and dQ are complete
        fence_operand(dq);
        // dQ is staged while dK runs, once the writer has read the last tile. Ordered causal (the writer may wait for
        // its turn), dK is waited for first and the stage handed back, so that the loader is not held up as well
        // (docs/perf-notes.md: Order of a pair's wgmmas, The writer's fence).
        const bool dk_first = T::CAUSAL && ordered;
        if (dk_first) {
            wgmma_wait<0>();  // dK is complete: the stage goes back
            fence_acc_and_frags(acc, pa, dsa);
            mbar_arrive(bar(T::EMPTY, s_));
        }
        // the writer has read the stage's last fill (this loop's fills so far, one slot)
        if (it > it_begin) mbar_wait(bar(T::DQ_EMPTY, 0), Ring<1>{(u32)(it - it_begin)}.prev().parity());
        const i64 row0 = (i64)b * p.st_sb + (i64)pr.h * p.st_sh + tile.vis.q_row0 + pr.m * BM;
        stage_dq<D, T::DQ_N>(sDQ, dq, row0, T::WIDE ? 64 * wg : 0, T::WIDE ? 0 : wg * T::DQ_N, w, g, t);
        if (tid == 0) {  // the writer's job: where the tile goes, its bytes, the counter and its turn (ordered)
            int* job = reinterpret_cast<int*>(smem + (sJob - smem_base));
            *reinterpret_cast<i64*>(job) = row0 * D;
            job[2] = max(0, min(BM, tile.vis.Lq - pr.m * BM)) * D * 4;
            job[3] = ordered ? (int)(dq_counter<BM>(p, tile, pr.h, pr.m) - p.dq_sem) : -1;
            job[4] = ordered ? dq_turn<BM, BN>(tile, pr.m, it) : 0;
        }
        mbar_arrive(bar(T::DQ_FULL, 0));
        if (!dk_first) {
            wgmma_wait<0>();  // dK is complete: the stage goes back
            fence_acc_and_frags(acc, pa, dsa);
            mbar_arrive(bar(T::EMPTY, s_));
        }
    }
    const int rows_wg = tile.rows - 64 * wg;
    if (p.splits > 1) {  // unscaled fp32 partials of this split (bwd_dkdv_sm90.cu)
        const i64 per_split = (i64)p.B * p.Hkv * p.Sk * D;
        float* part = p.dkv_partial + tile.split * per_split + (((i64)b * p.Hkv + hk) * p.Sk + n0 + 64 * wg) * D;
        acc_to_partial<D>(part, acc[0], rows_wg, w, g, t);
        acc_to_partial<D>(part + p.splits * per_split, acc[1], rows_wg, w, g, t);
        return;
    }
    bar_wait<4, T::CONSUMERS>();  // every dQ wgmma (they read all of K) is complete before K is overwritten
    // scale * dK staged into this warpgroup's rows of the K tile, dV into its rows of the V tile, then stored
    const i64 row0 = tile.vis.k_row0 + n0 + 64 * wg;
    acc_to_sw128<BN, D, T::BF16>(sKw, acc[0], p.scale, w, g, t);
    acc_to_sw128<BN, D, T::BF16>(sVw, acc[1], 1.f, w, g, t);
    if (wg == 0)
        warpgroup_bar<1>();
    else
        warpgroup_bar<2>();
    sw128_rows_to_global<BN, D>(p.dk + b * p.dk_sb + row0 * p.dk_ss + hk * p.dk_sh, p.dk_ss, sKw, rows_wg, p.head_dim,
                                wtid);
    sw128_rows_to_global<BN, D>(p.dv + b * p.dv_sb + row0 * p.dv_ss + hk * p.dv_sh, p.dv_ss, sVw, rows_wg, p.head_dim_v,
                                wtid);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(FusedWsTraits, bwd_fused_sm90_ws, BwdParams)
#endif
