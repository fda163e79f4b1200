// Attention backward on Hopper (sm_90a), dQ = scale * dS K with dS = P o (dO V^T - delta), wgmma.
//
// The problem, grid and masks of bwd_dq.cu (QueryTile: grid (ceil(Sq / 128), H, B), one block
// owns a query tile and every dQ element is written by one thread: no atomics, bitwise
// deterministic), with the structure of fwd_sm90.cu: 256 threads = two warpgroups of 64 query
// rows; Q and dO (128 x D) loaded once, K / V tiles double-buffered by cp.async into
// 128-byte-swizzled tiles (wgmma.cuh). Per key tile and warpgroup: S = Q K^T and dP = dO V^T are
// wgmmas with both operands in shared memory, issued as two groups (P's exponentials run while
// dP is in flight); dS is formed on the fp32 fragments and feeds dQ += dS K as the register A
// operand, K being the MN-major B operand. head_dim 64, 128, 192 or 256; at 256 (64-key tiles) two
// stages of V do not fit next to Q, dO and two of K: V has one buffer, refilled as soon as both
// warpgroups' dP wgmmas are done (dP is issued before S for that), while S, P, dS and dQ += dS K of
// the same tile run. Each block also computes its rows' delta and lse2 (bwd_preprocess.cu's work:
// row_stats) and writes them for the dK/dV pass, launched after it.
#include "attention/dropout.cuh"
#include "attention/params.cuh"
#include "attention/score_mod.cuh"
#include "common/wgmma.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct DqSm90Traits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int MASK = FRT_MASK, NTHREADS = NW * 32;
    // Masked tiles test each row's key interval (QueryTile::INTERVALS) with masks, and causal alone at head_dim
    // 64; causal alone at 128 ran 1-3% slower so (H200, docs/perf-notes.md: Tile skipping and element tests).
    static constexpr bool INTERVALS = MASK != 0 || D <= 64;
    static_assert(D == 64 || D == 128 || D == 192 || D == 256, "bwd_dq_sm90: head_dim 64, 128, 192 or 256");
    static_assert(BM == 128 && NW == 8, "bwd_dq_sm90: 128 query rows, two warpgroups");
    static_assert(BN == 64 || (BN == 128 && D <= 128), "bwd_dq_sm90: key tiles of 64, or 128 up to head_dim 128");
    static constexpr bool ONE_V = D > 192;  // one V buffer (see the top of the file)
    // Warpgroups skip key tiles their rows do not see; not with ONE_V (a block barrier follows the
    // dP wgmmas), nor at head_dim 64 (two blocks per SM: 12% slower dense, docs/perf-notes.md: The dQ kernel).
    static constexpr bool SKIP = !ONE_V && D > 64;
    static constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;  // Q or dO; one K or one V tile
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;                     // K, then V
    static constexpr int SMEM =  // + alignment slack
        2 * Q_BYTES + (ONE_V ? 3 * KV_BYTES : 2 * STAGE_BYTES) + sm90::kAtomBytes;
};

// What bwd_preprocess.cu computes for a query row, here for the two rows of a thread (r0 and r0 + 8
// of the tile; the four threads t of a quad share them): delta = rowsum(dO o O), lse2 = lse * log2(e)
// (+inf where lse = -inf: the row saw no key), in registers and written out for the dK/dV pass that
// runs next. The loads run beside the tile's cp.async copies. The separate pass, which read O and dO
// once more, took ~6% of the backward at S = 1k; the O read costs this kernel's prologue less than
// that, except dense at head_dim 256 (+1% of the backward; docs/perf-notes.md: The dQ kernel).
template <int D, bool BF16, class Tile>
FRT_DEVICE void row_stats(const BwdParams& p, const Tile& tile, int r0, int t, float (&lse2)[2], float (&delta)[2]) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = r0 + 8 * hh;
        float acc = 0.f;
        if (r < tile.live) {  // (delta 0 past the sequence's length, whatever O and dO hold there)
            const i64 row = tile.row0 + r;
            const u16* o = p.o + tile.b * p.o_sb + row * p.o_ss + tile.h * p.o_sh;
            const u16* d = p.dout + tile.b * p.do_sb + row * p.do_ss + tile.h * p.do_sh;
#pragma unroll
            for (int c = 8 * t; c < D; c += 32) {
                if (c < p.head_dim_v)  // (O and dO: v's head_dim, params.cuh)
                    acc = dot8<BF16>(*reinterpret_cast<const uint4*>(o + c), *reinterpret_cast<const uint4*>(d + c),
                                     acc);
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        delta[hh] = acc;
        lse2[hh] = FRT_INF;
        if (r < tile.rows) {
            lse2[hh] = lse2_of(p.lse[tile.stat0 + r]);
            if (t == 0) p.delta[tile.stat0 + r] = delta[hh], p.lse2[tile.stat0 + r] = lse2[hh];
        }
    }
}

// Calls op with the element test of a thread's rows on key tile n0..: whether row hh (row_base + 8 hh) sees
// key n0 + 2 t + x (x: a column offset known at compile time). IV (QueryTile::INTERVALS, Traits::INTERVALS):
// one or two compares against the row's keys, found once per tile; with mask_mod and no id arrays, where the
// thread's rows and the tile's keys lie inside the sequence, without the length tests and clamps
// (Visibility::visible_inside); else QueryTile::visible.
template <int BN, bool IV, class Tile, class Op>
FRT_DEVICE void with_element_test(const Tile& tile, int row_base, int n0, int t, int h, Op op) {
    if constexpr (IV) {
        RowInterval keys[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) keys[hh] = RowInterval(tile.key_interval(row_base + 8 * hh, n0, BN), n0, 2 * t);
        op([&](int hh, int x) { return keys[hh].visible<Tile::KEY_LO>(x); });
    } else {
        auto general = [&](int hh, int x) { return tile.visible(row_base + 8 * hh, n0 + 2 * t + x, h); };
        if constexpr (Tile::MOD && !Tile::IDS) {
            if ((row_base + 8 < tile.vis.Lq) & (n0 + BN <= tile.vis.Lk))
                op([&](int hh, int x) { return tile.vis.visible_inside(row_base + 8 * hh, n0 + 2 * t + x, h); });
            else
                op(general);
        } else {
            op(general);
        }
    }
}

// with_element_test's ops: one bit per S element that the test hides (before the wgmmas, ONE_V), or S
// elements zeroed (mask.cuh: the fragments, here relative to the thread's first row and column).
template <int BN>
struct HiddenBits {
    u32& hidden;
    template <class Visible>
    FRT_DEVICE void operator()(Visible visible) const {
        hidden |= hidden_bits_of<BN / 8>(Fragments{0, 0}, [&](int row, int x) { return visible(row >> 3, x); });
    }
};
template <int BN>
struct ZeroHidden {
    float (&s)[BN / 2];
    template <class Visible>
    FRT_DEVICE void operator()(Visible visible) const {
        mask_fragments<1, BN / 8>(Fragments{0, 0}, 0.f, [&](int, int jj, int c) -> float& { return s[4 * jj + c]; },
                                  [&](int row, int x) { return visible(row >> 3, x); });
    }
};

template <class T>
__device__ void bwd_dq_sm90(const BwdParams& p) {
    using namespace sm90;
    constexpr int BM = T::BM, BN = T::BN, D = T::D, NT = T::NTHREADS;
    extern __shared__ __align__(16) unsigned char smem[];
    const u32 sQ = align_atom(smem_u32(smem)), sdO = sQ + T::Q_BYTES;
    // Stage s: K at sKV + s * STAGE_BYTES, V KV_BYTES after it; ONE_V: K at sKV + s * KV_BYTES, the
    // one V buffer after both.
    const u32 sKV = sdO + T::Q_BYTES;
    constexpr int K_STRIDE = T::ONE_V ? T::KV_BYTES : T::STAGE_BYTES;
    const u32 sV1 = sKV + 2 * T::KV_BYTES;  // ONE_V's V buffer

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, w = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    using Tile = QueryTile<BM, BN, T::CAUSAL, T::MASK>;
    const Tile tile(p, query_block<T::CAUSAL, FRT_MIN_BLOCKS == 1>(p), tid, NT);
    if (tile.rows <= 0) return;
    const int n_blocks = tile.n_blocks, b = tile.b, h = tile.h;

    load_tile_sw128<BM, D, NT>(sQ, p.q + b * p.q_sb + tile.row0 * p.q_ss + h * p.q_sh, p.q_ss, tile.live, p.head_dim,
                               tid);
    load_tile_sw128<BM, D, NT>(sdO, p.dout + b * p.do_sb + tile.row0 * p.do_ss + h * p.do_sh, p.do_ss, tile.live,
                               p.head_dim_v, tid);
    const u16* gk = p.k + b * p.k_sb + tile.vis.k_row0 * p.k_ss + tile.hk * p.k_sh;
    const u16* gv = p.v + b * p.v_sb + tile.vis.k_row0 * p.v_ss + tile.hk * p.v_sh;
    auto load_k = [&](int stage, int j) {
        load_tile_sw128<BN, D, NT>(sKV + stage * K_STRIDE, gk + (i64)j * BN * p.k_ss, p.k_ss, tile.vis.Lk - j * BN,
                                   p.head_dim, tid);
    };
    auto load_v = [&](u32 sV, int j) {
        load_tile_sw128<BN, D, NT>(sV, gv + (i64)j * BN * p.v_ss, p.v_ss, tile.vis.Lk - j * BN, p.head_dim_v, tid);
    };
    if (n_blocks > 0) {
        load_k(0, tile.key_tile(0));
        load_v(T::ONE_V ? sV1 : sKV + T::KV_BYTES, tile.key_tile(0));
    }
    cp_async_commit();

    // This warpgroup's 64 query rows (rows 64 wg.. of the Q and dO tiles); a thread holds rows
    // 16 w + g (hh = 0) and 16 w + g + 8 (hh = 1) of them, accumulator element [4 j + 2 hh + e]
    // being column 8 j + 2 t + e (wgmma.cuh). Their lse2 and delta: +inf / 0 past the tile's rows.
    const u32 sQw = sQ + wg * 64 * kSwizzleBytes, sdOw = sdO + wg * 64 * kSwizzleBytes;
    const int row_wg = 16 * w + g, row_base = tile.m0 + 64 * wg + row_wg;
    float lse2[2], delta[2];
    row_stats<D, T::BF16>(p, tile, 64 * wg + row_wg, t, lse2, delta);
    const Softcap cap = FRT_SOFTCAP ? Softcap(p.softcap, p.scale_log2) : Softcap();
    const Alibi alibi = FRT_ALIBI ? Alibi(p, tile.b, h, tile.vis.shift) : Alibi();
    const ScoreMod smod = FRT_SCORE_MOD ? ScoreMod(p, tile.b, h, tile.vis) : ScoreMod();
    const Dropout drop = FRT_DROPOUT ? Dropout(p, tile.b, h) : Dropout();

    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;

    for (int it = 0; it < n_blocks; ++it) {
        const int j = tile.key_tile(it), stage = it & 1, n0 = j * BN;
        cp_async_wait<0>();
        fence_proxy_async();  // this thread's cp.async writes -> visible to wgmma (async proxy)
        __syncthreads();      // every thread's writes landed; every warpgroup is done with the other stage
        const int j_next = it + 1 < n_blocks ? tile.next_key_tile(it, j) : -1;
        if (j_next >= 0) {
            load_k(stage ^ 1, j_next);
            if constexpr (!T::ONE_V) load_v(sKV + (stage ^ 1) * T::STAGE_BYTES + T::KV_BYTES, j_next);
        }
        cp_async_commit();
        const u32 sK = sKV + stage * K_STRIDE, sV = T::ONE_V ? sV1 : sK + T::KV_BYTES;
        // A key tile that none of this warpgroup's rows sees (causal: the last one, for the upper
        // 64 rows) adds nothing to them: the other warpgroup has the tensor cores to itself (SKIP).
        if constexpr (T::SKIP) {
            if (tile.needs_mask(it, j)) {
                const bool none = tile.sees_no_key(row_base, j) & tile.sees_no_key(row_base + 8, j);
                if (wg == 0 ? warpgroup_all<1>(none) : warpgroup_all<2>(none)) continue;
            }
        }

        constexpr bool IV = Tile::INTERVALS && T::INTERVALS;
        float s[BN / 2], dp[BN / 2];
        auto issue_s = [&] {
            wgmma_abt<BN, BM, D / 16, T::BF16>(s, sQw, sK);
            wgmma_commit();
        };
        auto issue_dp = [&] {
            wgmma_abt<BN, BM, D / 16, T::BF16>(dp, sdOw, sV);
            wgmma_commit();
        };
        // ONE_V (head_dim 256, 255 registers unmasked): the element mask is evaluated into one bit per
        // S element before the wgmmas hold their accumulators (evaluated on the fragment afterwards, a
        // mask_mod expression spilled 84 bytes, NVRTC 12.9). Window and block / segment ids spill
        // either way (40-64 bytes): tiles._SM90_MASK_LIMITS sends those to bwd_dq.cu.
        static_assert(!T::ONE_V || BN / 2 == 32, "one bit per S element of a thread");
        u32 hidden = 0;
        if constexpr (T::ONE_V) {
            if (tile.needs_mask(it, j)) with_element_test<BN, IV>(tile, row_base, n0, t, h, HiddenBits<BN>{hidden});
        }
        wgmma_fence();  // orders the dQ accumulator writes (zeroing, last tile) before the wgmmas
        typename BitsOf<BN / 2>::type dropped = 0;  // (FRT_DROPOUT, under the wgmmas)
        if constexpr (T::ONE_V) {
            issue_dp();
            issue_s();
            if constexpr (FRT_DROPOUT) dropped = drop.bits<BN / 8>(row_base, n0 + 2 * t);
            wgmma_wait<1>();  // dP is complete (S may not be)
            fence_operand(dp);
            __syncthreads();  // both warpgroups' dP wgmmas have read V: refill it with the next tile's
            if (j_next >= 0) load_v(sV1, j_next);
            cp_async_commit();
            wgmma_wait<0>();
        } else {
            issue_s();
            issue_dp();
            if constexpr (FRT_DROPOUT) dropped = drop.bits<BN / 8>(row_base, n0 + 2 * t);
            wgmma_wait<1>();  // S is complete (dP may not be)
        }
        fence_operand(s);
        if constexpr (FRT_ALIBI)
            alibi.add<1, BN / 8>(Fragments{row_base, n0 + 2 * t}, [&](int, int jj, int c) -> float& { return s[4 * jj + c]; });
        // P = exp2(S * scale_log2 - lse2[row]), 0 where the mask hides the pair. With FRT_SOFTCAP (FRT_SCORE_MOD),
        // S capped (modified) first and P times the derivative (P is only read for dS here).
#pragma unroll
        for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if constexpr (FRT_SCORE_MOD) {
                    float grad;
                    const float x = smod.value_grad(s[4 * jj + c], Fragments{row_base, n0 + 2 * t}, 0, jj, c, grad);
                    const float pr = fast_exp2(fmaf(x, kLog2e, -lse2[c >> 1]));  // (ScoreMod::exp_scale)
                    s[4 * jj + c] = pr > 0.f ? pr * grad : 0.f;  // (any f' where P is 0)
                } else if constexpr (FRT_SOFTCAP) {
                    const float th = cap.tanh_of(s[4 * jj + c]);
                    s[4 * jj + c] = fast_exp2(fmaf(cap.cap * th, p.scale_log2, -lse2[c >> 1])) * (1.f - th * th);
                } else {
                    s[4 * jj + c] = fast_exp2(fmaf(s[4 * jj + c], p.scale_log2, -lse2[c >> 1]));
                }
            }
        if constexpr (T::ONE_V) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i)
                if (hidden >> i & 1) s[i] = 0.f;
        } else if (tile.needs_mask(it, j)) {
            with_element_test<BN, IV>(tile, row_base, n0, t, h, ZeroHidden<BN>{s});
        }

        if constexpr (!T::ONE_V) {
            wgmma_wait<0>();
            fence_operand(dp);
        }
        // dS = P o (dP - delta[row]) (FRT_DROPOUT: dP of the probabilities before dropout).
        if constexpr (FRT_DROPOUT) kept_dp(dp, dropped, drop.scale);
#pragma unroll
        for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
            for (int c = 0; c < 4; ++c) dp[4 * jj + c] = s[4 * jj + c] * (dp[4 * jj + c] - delta[c >> 1]);
        u32 dsa[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) acc_to_a_frag<BN / 2, T::BF16>(dp, kk, dsa[kk]);

        // dQ_w += dS K (64 x D, k = the BN keys): A from registers, K the MN-major B operand.
        wgmma_rs_wait<D, BN, T::BF16>(dq, dsa, sK);
    }
    cp_async_wait<0>();  // the last (empty) group
    // Every thread's Q copies have landed before a warpgroup overwrites its rows with dQ (with no
    // key tile to visit, the loop's barrier never ran).
    __syncthreads();

    // Epilogue: stage scale * dQ into this warpgroup's own 64 rows of the Q tile (only it read
    // them, and its wgmmas are complete), then 16-byte stores of the rows that exist.
    const int rows_wg = tile.rows - 64 * wg;
    acc_to_sw128<BM, D, T::BF16>(sQw, dq, p.scale, w, g, t);
    if (wg == 0)
        warpgroup_bar<1>();
    else
        warpgroup_bar<2>();
    sw128_rows_to_global<BM, D>(p.dq + b * p.dq_sb + (tile.row0 + 64 * wg) * p.dq_ss + h * p.dq_sh, p.dq_ss, sQw,
                                rows_wg, p.head_dim, tid & 127);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(DqSm90Traits, bwd_dq_sm90, BwdParams)
#endif
