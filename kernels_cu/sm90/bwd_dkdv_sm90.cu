// Attention backward on Hopper (sm_90a), dK and dV with wgmma:
//   P^T = exp2(scale_log2 * K Q^T - lse2),  dS^T = P^T o (V dO^T - delta),
//   dV = sum_h P_h^T dO_h,  dK = scale * sum_h dS_h^T Q_h
// summed over the query heads h of one KV head's group (GQA/MQA), as bwd_dkdv.cu computes them
// and with the same grid, pairs, splits and fp32 partials (KeyTile): no atomics, bitwise
// deterministic.
//
// Key-major: 256 threads = two warpgroups of 64 keys each own the block's 128 keys; K and V
// (128 x D) are loaded once, Q / dO tiles of BM = 64 query rows and their lse2 / delta stream
// through a two-stage cp.async pipeline into 128-byte-swizzled tiles (wgmma.cuh). Per pair and
// warpgroup: S^T and dP^T (64 x BM, k = head_dim) are wgmmas with both operands in shared
// memory, issued as two groups so that P^T's exponentials run while dP^T is in flight; P^T and
// dS^T are formed on the fp32 accumulator fragments (accumulator column = query row) and feed
// dV += P^T dO and dK += dS^T Q as register A operands (dO and Q are the MN-major B operand):
// no shared-memory round trip for P or dS. At head_dim 64 or 128 each warpgroup keeps its keys' dK
// and dV (64 x D fp32 each) in registers (254 registers at 128).
//
// head_dim 64 ("pipelined"): a pair's dV / dK wgmmas are issued in the next pair's iteration, between
// that pair's S^T and dP^T, so that the tensor cores run them and dP^T while the warpgroup computes
// the exponentials of P^T (at head_dim 64 those cost about half as long as the four matmuls, which
// ran one after the other before). The previous pair's Q / dO are still read then: three stages.
// The warpgroup's K and V rows, fixed for the block, are the register A operands of S^T and dP^T
// (32 registers), so those wgmmas read only Q / dO from shared memory.
//
// head_dim 192 or 256 ("roles": 64 x D of both gradients would not fit one warpgroup's registers):
// 64 keys per block, and the warpgroups split the work by gradient instead of by key. Warpgroup 0
// computes S^T and P^T and accumulates dV += P^T dO; warpgroup 1 computes dP^T, takes P^T from
// warpgroup 0 through shared memory (fp32, in its own fragment order: each thread reads the values
// of the thread with its index in warpgroup 0, which holds the same elements), forms dS^T and
// accumulates dK += dS^T Q. Both halves are two of the four matmuls, and warpgroup 0's dV wgmma
// runs while warpgroup 1 forms dS^T.
//
// The fused backward (dQ added as well) is bwd_fused_sm90_ws.cu, warp-specialised.
#include "sm90/bwd_sm90.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct DkdvSm90Traits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int MASK = FRT_MASK, NTHREADS = NW * 32;
    // Partial pairs test each key's query interval (KeyTile::INTERVALS, hidden_bits) with masks, and causal
    // alone at head_dim 64; causal alone at 128 ran 3-5% slower so (H200, docs/perf-notes.md: Tile skipping and element tests).
    static constexpr bool INTERVALS = MASK != 0 || D <= 64;
    static constexpr bool ROLES = D > 128;  // one warpgroup per gradient (see the top of the file)
    static constexpr bool PIPELINED = D == 64;  // dV / dK of a pair under the next's exponentials (top)
    // Query stages (Q, dO, lse2, delta), loaded one pair ahead (two gained nothing: docs/perf-notes.md: Backward: fused
    // wgmma); PIPELINED reads the previous pair's stage as well.
    static constexpr int LOOKAHEAD = 1;
    static constexpr int STAGES = LOOKAHEAD + 1 + (PIPELINED ? 1 : 0);
    static_assert(D == 64 || D == 128 || D == 192 || D == 256, "bwd_dkdv_sm90: head_dim 64, 128, 192 or 256");
    static_assert(BM == 64, "bwd_dkdv_sm90: query tiles of 64 rows (S^T is one m64n64 accumulator)");
    static_assert(NW == 8 && BN == (ROLES ? 64 : 128),
                  "bwd_dkdv_sm90: two warpgroups; 128 keys at head_dim <= 128 (64 each), else 64");
    static constexpr int KV_BYTES = BN * D * 2;           // the K tile, or the V tile
    static constexpr int QT_BYTES = BM * D * 2;           // one Q or dO tile
    static constexpr int STAGE_BYTES = 2 * QT_BYTES;      // Q, then dO (both stay 1024-byte aligned)
    static constexpr int STAT_STAGE_BYTES = 2 * BM * 4;   // lse2[BM], then delta[BM]
    static constexpr int XCH_BYTES = ROLES ? 128 * (BM / 2) * 4 : 0;  // P^T from warpgroup 0 to 1, fp32
    static_assert((2 * KV_BYTES + STAGES * STAGE_BYTES) % sm90::kAtomBytes == 0,
                  "bwd_dkdv_sm90: the swizzled tiles (K, V, the stages) start on 1024-byte boundaries");
    static constexpr int SMEM = 2 * KV_BYTES + STAGES * (STAGE_BYTES + STAT_STAGE_BYTES) + XCH_BYTES + sm90::kAtomBytes;
};


template <class T>
__device__ void bwd_dkdv_sm90(const BwdParams& p) {
    using namespace sm90;
    constexpr int BM = T::BM, BN = T::BN, D = T::D, NT = T::NTHREADS;
    extern __shared__ __align__(16) unsigned char smem[];
    const u32 smem_base = smem_u32(smem);
    const u32 sK = align_atom(smem_base), sV = sK + T::KV_BYTES;
    const u32 sQdO = sV + T::KV_BYTES;  // stage s: Q at sQdO + s * STAGE_BYTES, dO QT_BYTES after
    const u32 sStat = sQdO + T::STAGES * T::STAGE_BYTES;  // stage s: lse2[BM], delta[BM] at sStat + s * STAT_STAGE_BYTES
    const u32 sXch = sStat + T::STAGES * T::STAT_STAGE_BYTES;  // ROLES: P^T, float4 q of thread i at (q * 128 + i) * 16
    const float* stat_base = reinterpret_cast<const float*>(smem + (sStat - smem_base));

    const int tid = threadIdx.x, lane = tid & 31, wtid = tid & 127;
    const int wg = tid >> 7, w = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const KeyTile<BM, BN, T::CAUSAL, T::MASK> tile(p, key_block<T::CAUSAL>(p.sched_key_pairs), tid, NT);
    if (tile.rows <= 0) return;
    const int b = tile.b, hk = tile.hk, n0 = tile.n0;
    // (with id masks these come from shared memory; PIPELINED keeps wgmmas in flight across pairs)
    const int it_begin = block_uniform(tile.it_begin), it_end = block_uniform(tile.it_end);
    const Softcap cap = FRT_SOFTCAP ? Softcap(p.softcap, p.scale_log2) : Softcap();
    const ScoreMod smod = FRT_SCORE_MOD ? ScoreMod(p, b, 0, tile.vis) : ScoreMod();  // (the head: each pair's)
    const Dropout drop = FRT_DROPOUT ? Dropout(p, b, 0) : Dropout();             // (the head: each pair's)
    static_assert(!(FRT_DROPOUT && FRT_SCORE_MOD), "bwd_dkdv_sm90: no variant with dropout and score_mod");
    // (nor at head_dim 128, whose bits spilled causal wherever they were made: tiles._DROPOUT_MASK_LIMITS)
    static_assert(!FRT_DROPOUT || T::ROLES || T::PIPELINED, "bwd_dkdv_sm90: no dropout variant at head_dim 128");

    const i64 krow0 = tile.vis.k_row0 + n0;
    load_tile_sw128<BN, D, NT>(sK, p.k + b * p.k_sb + krow0 * p.k_ss + hk * p.k_sh, p.k_ss, tile.live, p.head_dim,
                               tid);
    load_tile_sw128<BN, D, NT>(sV, p.v + b * p.v_sb + krow0 * p.v_ss + hk * p.v_sh, p.v_ss, tile.live, p.head_dim_v,
                               tid);
    if (it_begin < it_end) load_query_stage<T, T::NTHREADS>(p, tile, it_begin, sQdO, sStat, tid);
    cp_async_commit();  // one group: K, V and the first query tile
#pragma unroll
    for (int a = 1; a < T::LOOKAHEAD; ++a) {  // and one for each of the next LOOKAHEAD - 1
        if (it_begin + a < it_end)
            load_query_stage<T, T::NTHREADS>(p, tile, it_begin + a, sQdO + a * T::STAGE_BYTES,
                                             sStat + a * T::STAT_STAGE_BYTES, tid);
        cp_async_commit();
    }

    // This warpgroup's 64 keys: rows 64 wg.. of every column block of the K and V tiles (ROLES: all
    // 64 of them). Its accumulators (wgmma.cuh layout): S^T / dP^T element [4 j + 2 hh + e] is key
    // 16 w + g + 8 hh, query 8 j + 2 t + e of the tile; dK / dV element [4 j + 2 hh + e] is key
    // 16 w + g + 8 hh, head_dim column 8 j + 2 t + e.
    constexpr int KEYS_WG = T::ROLES ? 0 : 64;  // key offset per warpgroup
    const u32 sKw = sK + wg * KEYS_WG * kSwizzleBytes, sVw = sV + wg * KEYS_WG * kSwizzleBytes;
    const int key_base = n0 + KEYS_WG * wg + 16 * w + g;
    // dK and dV of this warpgroup's keys; ROLES: acc is dV on warpgroup 0, dK on warpgroup 1.
    constexpr int NACC = T::ROLES ? 1 : 2;
    float acc[NACC][D / 2];
#pragma unroll
    for (int a = 0; a < NACC; ++a)
#pragma unroll
        for (int i = 0; i < D / 2; ++i) acc[a][i] = 0.f;

    // P^T and dS^T as A fragments (PIPELINED: the previous pair's, and its stage, for its dV / dK wgmmas).
    u32 pa[BM / 16][4], dsa[BM / 16][4];
    u32 sQ_prev = 0;
    // PIPELINED: this warpgroup's K and V rows as A fragments, once K / V have landed.
    u32 ka[T::PIPELINED ? D / 16 : 1][4], va[T::PIPELINED ? D / 16 : 1][4];
    for (int it = it_begin, stage = 0; it < it_end; ++it, stage = stage + 1 == T::STAGES ? 0 : stage + 1) {
        cp_async_wait<T::LOOKAHEAD - 1>();  // this pair's stage (not the next one's)
        fence_proxy_async();  // this thread's cp.async writes -> visible to wgmma (async proxy)
        // Every thread's writes landed; both warpgroups finished the wgmmas that read the next stage
        // (the previous pair's; PIPELINED: the one before, its dV / dK waited for in the previous
        // iteration; ROLES: P^T was read as well), so that stage, Q / dO / lse2 / delta alike, may be
        // refilled, and P^T rewritten.
        __syncthreads();
        // the stage LOOKAHEAD after this one (the pair before this one's; PIPELINED, the one before that)
        const int next =
            T::LOOKAHEAD == 1 ? (stage + 1 == T::STAGES ? 0 : stage + 1) : (stage + T::LOOKAHEAD) % T::STAGES;
        if (it + T::LOOKAHEAD < it_end)
            load_query_stage<T, T::NTHREADS>(p, tile, it + T::LOOKAHEAD, sQdO + next * T::STAGE_BYTES,
                                             sStat + next * T::STAT_STAGE_BYTES, tid);
        cp_async_commit();
        const u32 sQ = sQdO + stage * T::STAGE_BYTES, sdO = sQ + T::QT_BYTES;
        const float* s_lse2 = stat_base + stage * (T::STAT_STAGE_BYTES / 4);
        const float* s_delta = s_lse2 + BM;

        if constexpr (T::ROLES) {
            float x[BM / 2];  // S^T on warpgroup 0, dP^T on warpgroup 1
            u32 hidden = 0;
            if (wg == 0) {
                const auto pr = tile.pair(p, it);
                if (pr.partial) hidden = hidden_bits<BM, T::INTERVALS>(tile, pr.h, pr.m, key_base, t);
            }
            wgmma_fence();  // orders the accumulator writes (zeroing, last pair) before the wgmmas
            const u32 sA = wg == 0 ? sK : sV, sB = wg == 0 ? sQ : sdO;
            wgmma_abt<BM, BN, D / 16, T::BF16>(x, sA, sB);
            wgmma_commit();
            u32 dropped = 0;  // (FRT_DROPOUT, under the wgmma: both warpgroups hold the same elements)
            if constexpr (FRT_DROPOUT) {
                const auto pr = tile.pair(p, it);
                dropped = dropped_bits<BM>(drop.head(b, pr.h, p.H), key_base, pr.m * BM, t);
            }
            wgmma_wait<0>();
            fence_operand(x);
            float4* xch = reinterpret_cast<float4*>(smem + (sXch - smem_base)) + wtid;
            u32 a[BM / 16][4];
            if (wg == 0) {
                if constexpr (FRT_SCORE_MOD) {  // warpgroup 1 gets P^T f', the factor of dS^T
                    const auto pr = tile.pair(p, it);
                    float pg[BM / 2];
                    mod_probabilities<BM>(x, s_lse2, hidden, smod.head(pr.h), key_base, pr.m * BM, t,
                                          [&](int i, float v) { pg[i] = v; });
#pragma unroll
                    for (int q = 0; q < BM / 8; ++q)
                        xch[q * 128] = make_float4(pg[4 * q], pg[4 * q + 1], pg[4 * q + 2], pg[4 * q + 3]);
                } else {
                    if constexpr (FRT_ALIBI) {
                        const auto pr = tile.pair(p, it);
                        add_alibi<BM>(x, p, tile, pr.h, pr.m, key_base, t);
                    }
                    probabilities<BM>(x, s_lse2, p.scale_log2, hidden, t, cap);
#pragma unroll
                    for (int q = 0; q < BM / 8; ++q)
                        xch[q * 128] = make_float4(x[4 * q], x[4 * q + 1], x[4 * q + 2], x[4 * q + 3]);
                }
                bar_arrive<3, 256>();  // P^T -> warpgroup 1
                if constexpr (FRT_DROPOUT) {
                    pack_kept<BM, T::BF16>(x, a, dropped, drop.scale);
                } else {
#pragma unroll
                    for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2, T::BF16>(x, kk, a[kk]);
                }
            } else {
                if constexpr (FRT_DROPOUT) kept_dp(x, dropped, drop.scale);
                bar_wait<3, 256>();
                // dS^T = P^T o (dP^T - delta[query]), with P^T in fp32 (and the softcap's derivative: ds_from_dp;
                // FRT_SCORE_MOD: warpgroup 0 sent P^T f').
#pragma unroll
                for (int q = 0; q < BM / 8; ++q) {
                    float4 pt = xch[q * 128];
                    const float2 dl = *reinterpret_cast<const float2*>(s_delta + 8 * q + 2 * t);
                    if constexpr (FRT_SOFTCAP) {
                        const float2 l = *reinterpret_cast<const float2*>(s_lse2 + 8 * q + 2 * t);
                        pt.x *= cap.grad_from_p(pt.x, l.x), pt.y *= cap.grad_from_p(pt.y, l.y);
                        pt.z *= cap.grad_from_p(pt.z, l.x), pt.w *= cap.grad_from_p(pt.w, l.y);
                    }
                    x[4 * q] = pt.x * (x[4 * q] - dl.x);
                    x[4 * q + 1] = pt.y * (x[4 * q + 1] - dl.y);
                    x[4 * q + 2] = pt.z * (x[4 * q + 2] - dl.x);
                    x[4 * q + 3] = pt.w * (x[4 * q + 3] - dl.y);
                }
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2, T::BF16>(x, kk, a[kk]);
            }
            // dV += P^T dO (warpgroup 0) or dK += dS^T Q (warpgroup 1), 64 x D, k = the BM queries:
            // A from registers, B MN-major (the [query][head_dim] tile read as K x N).
            wgmma_rs_wait<D, BM, T::BF16>(acc[0], a, wg == 0 ? sdO : sQ);
        } else if constexpr (T::PIPELINED) {
            if (it == it_begin) {  // K and V landed with the first pair's group
                sw128_to_a_frags<BN, D>(sKw, ka, w, g, t);
                sw128_to_a_frags<BN, D>(sVw, va, w, g, t);
            }
            const auto pr = tile.pair(p, it);
            u32 dropped = 0;  // (FRT_DROPOUT)
            if constexpr (FRT_DROPOUT) dropped = dropped_bits<BM>(drop.head(b, pr.h, p.H), key_base, pr.m * BM, t);
            float s[BM / 2], dp[BM / 2];
            wgmma_fence();  // orders the accumulator and fragment writes before the wgmmas
            wgmma_abt<BM, D / 16, T::BF16>(s, ka, sQ);
            wgmma_commit();
            if (it > it_begin) mma_dv_dk<T>(acc, pa, dsa, sQ_prev);
            wgmma_commit();  // (empty for the first pair: three groups in every iteration)
            wgmma_abt<BM, D / 16, T::BF16>(dp, va, sdO);
            wgmma_commit();
            const u32 hidden = pr.partial ? hidden_bits<BM, T::INTERVALS>(tile, pr.h, pr.m, key_base, t) : 0u;

            if constexpr (FRT_SCORE_MOD) {  // (P^T and dS^T at once: mod_ds)
                wgmma_wait<0>();
                fence_operand(s);
                fence_operand(dp);
                fence_acc_and_frags(acc, pa, dsa);  // the previous pair's wgmmas are done with them
                mod_ds<BM>(s, dp, s_lse2, s_delta, hidden, smod.head(pr.h), key_base, pr.m * BM, t);
            } else {
                wgmma_wait<2>();  // S^T is complete (the previous dV / dK and dP^T may not be)
                fence_operand(s);
                add_alibi<BM>(s, p, tile, pr.h, pr.m, key_base, t);
                probabilities<BM>(s, s_lse2, p.scale_log2, hidden, t, cap);
                wgmma_wait<0>();
                fence_operand(dp);
                fence_acc_and_frags(acc, pa, dsa);  // the previous pair's wgmmas are done with them
                if constexpr (FRT_DROPOUT) kept_dp(dp, dropped, drop.scale);
                ds_from_dp<BM>(dp, s, s_delta, t, s_lse2, cap);
            }
            if constexpr (FRT_DROPOUT) pack_kept<BM, T::BF16>(s, pa, dropped, drop.scale);
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                if constexpr (!FRT_DROPOUT) acc_to_a_frag<BM / 2, T::BF16>(s, kk, pa[kk]);
                acc_to_a_frag<BM / 2, T::BF16>(dp, kk, dsa[kk]);
            }
            sQ_prev = sQ;
        } else {
            const auto pr = tile.pair(p, it);
            const u32 hidden = pr.partial ? hidden_bits<BM, T::INTERVALS>(tile, pr.h, pr.m, key_base, t) : 0u;
            // A pair that hides every one of this warpgroup's keys (causal: the diagonal's first query
            // tile, for the upper 64 keys) adds nothing to them: the other warpgroup has the tensor
            // cores to itself. (No block barrier follows in this iteration.)
            if (pr.partial && (wg == 0 ? warpgroup_all<1>(hidden == ~0u) : warpgroup_all<2>(hidden == ~0u))) continue;
            float s[BM / 2], dp[BM / 2];
            wgmma_fence();  // orders the dK / dV accumulator writes (zeroing, last pair) before the wgmmas
            wgmma_abt<BM, BN, D / 16, T::BF16>(s, sKw, sQ);
            wgmma_commit();
            wgmma_abt<BM, BN, D / 16, T::BF16>(dp, sVw, sdO);
            wgmma_commit();

            wgmma_wait<1>();  // S^T is complete (dP^T may not be: its registers are not touched yet)
            fence_operand(s);
            if constexpr (FRT_SCORE_MOD) {  // (P^T packed, P^T f' left in s: mod_probabilities_packed)
                mod_probabilities_packed<BM, T::BF16>(s, pa, s_lse2, hidden, smod.head(pr.h), key_base,
                                                      pr.m * BM, t);
            } else {
                add_alibi<BM>(s, p, tile, pr.h, pr.m, key_base, t);
                probabilities<BM>(s, s_lse2, p.scale_log2, hidden, t, cap);
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2, T::BF16>(s, kk, pa[kk]);
            }
            // dV += P^T dO now, under dS^T's arithmetic (fused: 1.03-1.05x, docs/perf-notes.md: Backward: fused wgmma)
            wgmma_fence();
            wgmma_rs_mn<D, BM, T::BF16>(acc[1], pa, sdO);
            wgmma_commit();
            wgmma_wait<1>();  // dP^T is complete (dV may not be)
            fence_operand(dp);
            ds_from_dp<BM>(dp, s, s_delta, t, s_lse2, cap);
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) acc_to_a_frag<BM / 2, T::BF16>(dp, kk, dsa[kk]);

            wgmma_fence();  // orders the dsa writes before the wgmma that reads them
            wgmma_rs_mn<D, BM, T::BF16>(acc[0], dsa, sQ);  // dK += dS^T Q
            wgmma_commit();
            wgmma_wait<0>();
            fence_acc_and_frags(acc, pa, dsa);
        }
    }
    if constexpr (T::PIPELINED) {
        if (it_begin < it_end) {  // the last pair's dV / dK
            wgmma_fence();
            mma_dv_dk<T>(acc, pa, dsa, sQ_prev);
            wgmma_commit();
            wgmma_wait<0>();
            fence_acc_and_frags(acc, pa, dsa);
        }
    }
    cp_async_wait<0>();  // the last (empty) group
    const int rows_wg = tile.rows - KEYS_WG * wg;

    if (p.splits > 1) {
        // Unscaled fp32 partials of this split; every key of the tile is written, zeros when the
        // chunk was empty. dV's partials follow all of dK's.
        const i64 per_split = (i64)p.B * p.Hkv * p.Sk * D;
        float* part =
            p.dkv_partial + tile.split * per_split + (((i64)b * p.Hkv + hk) * p.Sk + n0 + KEYS_WG * wg) * D;
        if constexpr (T::ROLES) {
            acc_to_partial<D>(part + (wg == 0 ? p.splits * per_split : 0), acc[0], rows_wg, w, g, t);
        } else {
            acc_to_partial<D>(part, acc[0], rows_wg, w, g, t);
            acc_to_partial<D>(part + p.splits * per_split, acc[1], rows_wg, w, g, t);
        }
        return;
    }
    __syncthreads();  // all copies landed and every wgmma is complete before K / V are overwritten

    // Epilogue: stage scale * dK into this warpgroup's rows of the K tile and dV into its rows of
    // the V tile (only it read them; ROLES: warpgroup 0 dV into the V tile, 1 dK into the K tile),
    // then 16-byte stores of the keys that exist.
    const i64 row0 = krow0 + KEYS_WG * wg;
    u16* const dk = p.dk + b * p.dk_sb + row0 * p.dk_ss + hk * p.dk_sh;
    u16* const dv = p.dv + b * p.dv_sb + row0 * p.dv_ss + hk * p.dv_sh;
    if constexpr (T::ROLES) {
        acc_to_sw128<BN, D, T::BF16>(wg == 0 ? sV : sK, acc[0], wg == 0 ? 1.f : p.scale, w, g, t);
    } else {
        acc_to_sw128<BN, D, T::BF16>(sKw, acc[0], p.scale, w, g, t);
        acc_to_sw128<BN, D, T::BF16>(sVw, acc[1], 1.f, w, g, t);
    }
    if (wg == 0)
        warpgroup_bar<1>();
    else
        warpgroup_bar<2>();
    if constexpr (T::ROLES) {
        if (wg == 0)
            sw128_rows_to_global<BN, D>(dv, p.dv_ss, sV, rows_wg, p.head_dim_v, wtid);
        else
            sw128_rows_to_global<BN, D>(dk, p.dk_ss, sK, rows_wg, p.head_dim, wtid);
    } else {
        sw128_rows_to_global<BN, D>(dk, p.dk_ss, sKw, rows_wg, p.head_dim, wtid);
        sw128_rows_to_global<BN, D>(dv, p.dv_ss, sVw, rows_wg, p.head_dim_v, wtid);
    }
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(DkdvSm90Traits, bwd_dkdv_sm90, BwdParams)
#endif
