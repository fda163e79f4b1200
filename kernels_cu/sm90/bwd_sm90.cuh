// Pieces the Hopper backward kernels share (bwd_dkdv_sm90.cu, bwd_fused_sm90_ws.cu): a pair's query stage, the
// hidden bits of S^T, ALiBi, P^T and dS^T on the accumulator fragments, the dV / dK wgmmas, fp32 partials, and the
// fused kernel's dQ staging and ordered counters.
#pragma once
#include "attention/dropout.cuh"
#include "attention/params.cuh"
#include "attention/score_mod.cuh"
#include "common/wgmma.cuh"

namespace frt {

// Pair `it`'s query tile (Q, dO) and its lse2 / delta into one pipeline stage: the tiles at sQ (dO
// QT_BYTES after it), the statistics at sStat; rows past the sequence (or its length) are zeros. NT threads copy
// (tid < NT), by cp.async: the caller commits or arrives.
// NT = 32 (bwd_fused_sm90_ws.cu's loader warp) completes the mbarrier `full` (33 arrivals) itself: the tiles by TMA
// where all their rows exist (p.use_tma; lane 0 announces their bytes with one arrival, made with none otherwise),
// else by loads and shared stores (copy_tile_sw128_warp), as the statistics; then every lane arrives (release: its
// stores are seen by the consumers after their wait).
template <class T, int NT, class Tile>
FRT_DEVICE void load_query_stage(const BwdParams& p, const Tile& tile, int it, u32 sQ, u32 sStat, int tid,
                                 u32 full = 0) {
    using namespace sm90;
    constexpr int BM = T::BM, D = T::D;
    const auto pr = tile.pair(p, it);
    const int m0 = pr.m * BM, rows = min(BM, tile.vis.Lq - m0), b = tile.b;
    const i64 row0 = tile.vis.q_row0 + m0;
    const u16* q = p.q + b * p.q_sb + row0 * p.q_ss + pr.h * p.q_sh;
    const u16* dout = p.dout + b * p.do_sb + row0 * p.do_ss + pr.h * p.do_sh;
    // lse2 and delta of the tile's rows (zeros past the sequence: with Q and dO rows of zeros they
    // add nothing): 2 BM floats, element i = tid + k NT (lse2, then delta).
    const i64 at = (i64)b * p.st_sb + (i64)pr.h * p.st_sh + row0;
    if constexpr (NT == 32) {
        const bool by_tma = p.use_tma && rows == BM;
        if (tid == 0) mbar_arrive_expect_tx(full, by_tma ? 2 * T::QT_BYTES : 0);
        if (by_tma) {
            if (tid == 0) {
                const int mb = (T::MASK & MASK_LENGTHS) && p.cu_q ? 0 : b;  // packed varlen: one batch entry
                load_tile_tma<BM, D>(sQ, &p.q_map, full, pr.h, (int)row0, mb);
                load_tile_tma<BM, D>(sQ + T::QT_BYTES, &p.do_map, full, pr.h, (int)row0, mb);
            }
        } else {
            copy_tile_sw128_warp<BM, D>(sQ, q, p.q_ss, rows, p.head_dim, tid);
            copy_tile_sw128_warp<BM, D>(sQ + T::QT_BYTES, dout, p.do_ss, rows, p.head_dim_v, tid);
        }
        float* stat = reinterpret_cast<float*>(__cvta_shared_to_generic(sStat));
#pragma unroll
        for (int k = 0; k < 2 * BM / 32; ++k) {
            const int i = tid + 32 * k, r = i % BM;
            stat[i] = r < rows ? (i >= BM ? p.delta : p.lse2)[at + r] : 0.f;
        }
        mbar_arrive(full);
    } else {
        load_tile_sw128<BM, D, NT>(sQ, q, p.q_ss, rows, p.head_dim, tid);
        load_tile_sw128<BM, D, NT>(sQ + T::QT_BYTES, dout, p.do_ss, rows, p.head_dim_v, tid);
#pragma unroll
        for (int k = 0; k < (2 * BM + NT - 1) / NT; ++k) {
            const int i = tid + k * NT, r = i % BM;
            if (i < 2 * BM) cp_async4(sStat + i * 4, (i >= BM ? p.delta : p.lse2) + at + (r < rows ? r : 0), r < rows);
        }
    }
}

// The bits of a thread's BM / 2 S^T elements (rows: keys from key_base, columns: queries from q0; mask.cuh: the
// fragments) whose pair visible(query, key) hides.
template <int BM>
using HiddenWord = typename BitsOf<BM / 2>::type;  // one bit per S^T element of a thread (BM = 64: u32, 128: u64)

template <int BM, class Visible>
FRT_DEVICE HiddenWord<BM> hidden_where(int q0, int key_base, Visible visible) {
    return hidden_bits_of<BM / 8, true>(Fragments{key_base, q0}, visible);
}

// Partial pairs: which of a thread's BM / 2 S^T elements (keys key_base + 8 hh, queries of the
// m-th tile) the mask hides, one bit each, evaluated before the wgmmas hold their accumulators
// (inside the exponential loop, the predicate made the head_dim 128 variants with block / segment
// ids spill 16-56 bytes, NVRTC 12.9). Unrolled, so that a mask_mod's reads are in flight together:
// one at a time, a documents mask read through a tensor took 1.22x its built-in twin (docs/perf-notes.md: mask_mod element mask).
// INTERVALS (with KeyTile::INTERVALS): from each key's query interval, two compares per pair. With mask_mod
// and no id arrays, where the thread's keys and the query tile lie inside the sequence, without the length
// tests and clamps (Visibility::visible_inside).
template <int BM, bool INTERVALS, class Tile>
FRT_DEVICE HiddenWord<BM> hidden_bits(const Tile& tile, int h, int m, int key_base, int t) {
    static_assert(BM == 64 || BM == 128, "one bit per S^T element of a thread, in a u32 or a u64");
    HiddenWord<BM> hidden = 0;
    const int q0 = m * BM + 2 * t;
    if constexpr (Tile::INTERVALS && INTERVALS) {  // each key's queries [lo, hi) of the tile, two compares per pair
        RowInterval queries[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) queries[hh] = RowInterval(tile.query_interval(key_base + 8 * hh, m * BM, BM), q0, 0);
        hidden = hidden_where<BM>(0, 0, [&](int x, int key) { return queries[key >> 3].visible(x); });
    } else {
        auto general = [&](int i, int j) { return tile.visible(i, j, h); };
        if constexpr (Tile::MOD && !Tile::IDS) {  // inside the sequence: no length tests or clamps
            if ((key_base + 8 < tile.vis.Lk) & (m * BM + BM <= tile.vis.Lq))
                hidden = hidden_where<BM>(q0, key_base, [&](int i, int j) { return tile.vis.visible_inside(i, j, h); });
            else
                hidden = hidden_where<BM>(q0, key_base, general);
        } else {
            hidden = hidden_where<BM>(q0, key_base, general);
        }
    }
    return hidden;
}

// FRT_ALIBI: S^T (rows: keys from key_base, columns: the queries of query tile m, of query head h) gains each
// pair's bias (score_mod.cuh: Alibi), before probabilities.
template <int BM, class Tile>
FRT_DEVICE void add_alibi(float (&s)[BM / 2], const BwdParams& p, const Tile& tile, int h, int m, int key_base, int t) {
    if constexpr (FRT_ALIBI)
        Alibi(p, tile.b, h, tile.vis.shift).add<1, BM / 8, true>(Fragments{key_base, m * BM + 2 * t},
                                                                 [&](int, int jj, int c) -> float& { return s[4 * jj + c]; });
}

// The thread's values of a stage's per-query lse2 (s: BM floats): those of accumulator columns 8j + 2t and 8j + 2t +
// 1. The fused kernel reads them before it waits for S^T, so that their shared-memory latency does not follow the wait
// (docs/perf-notes.md, Per-pair fixed cost; delta too spilled 8-32 bytes in masked, dropout and softcap variants).
template <int BM>
FRT_DEVICE void load_row_stats(float2 (&v)[BM / 8], const float* s, int t) {
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) v[j] = *reinterpret_cast<const float2*>(s + 8 * j + 2 * t);
}

// P^T = exp2(S^T * scale_log2 - lse2[query]) on the accumulator fragment (accumulator column = query; lse:
// load_row_stats), 0 where `hidden` says so.
template <int BM>
FRT_DEVICE void exponentials(float (&s)[BM / 2], const float2 (&lse)[BM / 8], float scale_log2, HiddenWord<BM> hidden) {
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
        const float2 l = lse[j];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            s[4 * j + 2 * hh] = fast_exp2(fmaf(s[4 * j + 2 * hh], scale_log2, -l.x));
            s[4 * j + 2 * hh + 1] = fast_exp2(fmaf(s[4 * j + 2 * hh + 1], scale_log2, -l.y));
        }
    }
#pragma unroll
    for (int i = 0; i < BM / 2; ++i)
        if (hidden >> i & 1) s[i] = 0.f;
}
// ... with FRT_SOFTCAP, S^T capped first
template <int BM>
FRT_DEVICE void probabilities(float (&s)[BM / 2], const float2 (&lse)[BM / 8], float scale_log2,
                              HiddenWord<BM> hidden, const Softcap& cap) {
    if constexpr (FRT_SOFTCAP) {
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) s[i] = cap.apply(s[i]);
    }
    exponentials<BM>(s, lse, scale_log2, hidden);
}
// FRT_SOFTCAP, and the cap's derivative 1 - tanh^2 of each element too, two to a word in the kernel's 16-bit type
// (the precision dS^T is rounded to anyway), for ds_from_dp: none recovered from P^T by an lg2 then (one MUFU op of
// three an element; docs/perf-notes.md: Softcap).
template <int BM, bool BF16>
FRT_DEVICE void probabilities(float (&s)[BM / 2], const float2 (&lse)[BM / 8], float scale_log2,
                              HiddenWord<BM> hidden, const Softcap& cap, u32 (&grads)[BM / 4]) {
    static_assert(FRT_SOFTCAP, "probabilities: the cap's derivative is for softcap variants");
#pragma unroll
    for (int i = 0; i < BM / 4; ++i) {
        const float t0 = cap.tanh_of(s[2 * i]), t1 = cap.tanh_of(s[2 * i + 1]);
        grads[i] = Elem<BF16>::pack(fmaf(-t0, t0, 1.f), fmaf(-t1, t1, 1.f));
        s[2 * i] = cap.of_tanh(s[2 * i], t0);
        s[2 * i + 1] = cap.of_tanh(s[2 * i + 1], t1);
    }
    exponentials<BM>(s, lse, scale_log2, hidden);
}
template <int BM>
FRT_DEVICE void probabilities(float (&s)[BM / 2], const float* s_lse2, float scale_log2, HiddenWord<BM> hidden, int t,
                              const Softcap& cap) {
    float2 lse[BM / 8];
    load_row_stats<BM>(lse, s_lse2, t);
    probabilities<BM>(s, lse, scale_log2, hidden, cap);
}

// FRT_SCORE_MOD: P^T = exp2(f(S^T) log2 e - lse2[query]) on the accumulator fragment (f: the user's score_mod,
// mod for the pair's query head; key_base: the thread's first key, q0 the tile's first query, positions in the
// sequence), 0 where `hidden` says so, and pg(i, P^T f') for each element i, 0 where P^T is (any f' there): the
// factor of dS^T, which the caller takes at once (mod_ds) or hands on (bwd_dkdv_sm90.cu's ROLES).
template <int BM, class PG>
FRT_DEVICE void mod_probabilities(float (&s)[BM / 2], const float* s_lse2, HiddenWord<BM> hidden, const ScoreMod& mod,
                                  int key_base, int q0, int t, const PG& pg) {
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
        const float2 l = *reinterpret_cast<const float2*>(s_lse2 + 8 * j + 2 * t);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = 4 * j + 2 * hh + e;
                float grad;
                const float x = mod.value_grad<true>(s[i], Fragments{key_base, q0 + 2 * t}, 0, j, 2 * hh + e, grad);
                const float pr = (hidden >> i & 1) ? 0.f : fast_exp2(fmaf(x, kLog2e, -(e ? l.y : l.x)));  // (exp_scale)
                s[i] = pr;
                pg(i, pr > 0.f ? pr * grad : 0.f);
            }
    }
}

// FRT_SCORE_MOD, with dP^T still in flight: P^T packed into the A fragments pa as acc_to_a_frag packs them, and
// P^T f' left in s, from which ds_from_dp makes dS^T = P^T f' (dP^T - delta[query]): the registers of probabilities
// and a plain pair's packing (f' cannot be recovered from P^T later, as ds_from_dp does the softcap's). (With dP^T
// complete and mod_ds instead, the head_dim 128 causal dK / dV kernel spilled 16-32 bytes, NVRTC 12.9.)
template <int BM, bool BF16>
FRT_DEVICE void mod_probabilities_packed(float (&s)[BM / 2], u32 (&pa)[BM / 16][4], const float* s_lse2,
                                         HiddenWord<BM> hidden, const ScoreMod& mod, int key_base, int q0, int t) {
    float pair[2];
    mod_probabilities<BM>(s, s_lse2, hidden, mod, key_base, q0, t, [&](int i, float pg) {
        pair[i & 1] = s[i];  // (P^T, which mod_probabilities set)
        s[i] = pg;
        if (i & 1) pa[i >> 3][(i >> 1) & 3] = Elem<BF16>::pack(pair[0], pair[1]);
    });
}

// FRT_SCORE_MOD, with dP^T complete: P^T in s (mod_probabilities) and dS^T = P^T f' (dP^T - delta[query]) in dp at
// once (the pipelined head_dim 64 kernel, whose A fragments hold the previous pair's until its wgmmas are done).
template <int BM>
FRT_DEVICE void mod_ds(float (&s)[BM / 2], float (&dp)[BM / 2], const float* s_lse2, const float* s_delta,
                       HiddenWord<BM> hidden, const ScoreMod& mod, int key_base, int q0, int t) {
    mod_probabilities<BM>(s, s_lse2, hidden, mod, key_base, q0, t, [&](int i, float pg) {
        dp[i] = pg * (dp[i] - s_delta[8 * (i >> 2) + 2 * t + (i & 1)]);
    });
}

// FRT_DROPOUT: which of a thread's BM / 2 S^T elements (keys from key_base, queries from q0, the pair's query head's
// dropout d) the mask drops (dropout.cuh), made while the S^T / dP^T wgmmas run.
template <int BM>
FRT_DEVICE HiddenWord<BM> dropped_bits(const Dropout& d, int key_base, int q0, int t) {
    return d.bits<BM / 8, true>(key_base, q0 + 2 * t);
}

// FRT_DROPOUT: P^T as the A fragments of dV's wgmma (acc_to_a_frag's layout) with the dropped elements 0 and the kept
// ones times the scale; s keeps P^T for dS^T.
template <int BM, bool BF16>
FRT_DEVICE void pack_kept(const float (&s)[BM / 2], u32 (&pa)[BM / 16][4], HiddenWord<BM> dropped, float scale) {
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j = 8 * kk + 2 * i;
            pa[kk][i] = Elem<BF16>::pack((dropped >> j & 1) ? 0.f : s[j] * scale,
                                         (dropped >> (j + 1) & 1) ? 0.f : s[j + 1] * scale);
        }
}

// Unscaled fp32 partials of a split (bwd_dkdv_reduce.cu sums them in split order): the rows < rows
// of a warpgroup's 64 x D accumulator into dst (row stride D).
template <int D>
FRT_DEVICE void acc_to_partial(float* dst, const float (&acc)[D / 2], int rows, int w, int g, int t) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = 16 * w + g + 8 * hh;
            if (r < rows)
                *reinterpret_cast<float2*>(dst + (i64)r * D + 8 * j + 2 * t) =
                    make_float2(acc[4 * j + 2 * hh], acc[4 * j + 2 * hh + 1]);
        }
}

// dS^T = P^T o (dP^T - delta[query]) in dp, with P^T (s) in fp32, elements 4 j + 2 hh + (0, 1) of P^T taken times
// factor(j, hh)'s (x, y): their score modification's derivative (1 without one).
template <int BM, class F>
FRT_DEVICE void ds_from_dp(float (&dp)[BM / 2], const float (&s)[BM / 2], const float* s_delta, int t, const F& factor) {
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
        const float2 dl = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * t);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float2 f = factor(j, hh);
            dp[4 * j + 2 * hh] = s[4 * j + 2 * hh] * f.x * (dp[4 * j + 2 * hh] - dl.x);
            dp[4 * j + 2 * hh + 1] = s[4 * j + 2 * hh + 1] * f.y * (dp[4 * j + 2 * hh + 1] - dl.y);
        }
    }
}
// ... with FRT_SOFTCAP, times the cap's derivative, recovered from P^T and lse2 (s_lse2; no copy of the scores is kept)
template <int BM>
FRT_DEVICE void ds_from_dp(float (&dp)[BM / 2], const float (&s)[BM / 2], const float* s_delta, int t,
                           const float* s_lse2, const Softcap& cap) {
    ds_from_dp<BM>(dp, s, s_delta, t, [&](int j, int hh) {
        if constexpr (!FRT_SOFTCAP) return make_float2(1.f, 1.f);
        const float2 gl = *reinterpret_cast<const float2*>(s_lse2 + 8 * j + 2 * t);
        return make_float2(cap.grad_from_p(s[4 * j + 2 * hh], gl.x), cap.grad_from_p(s[4 * j + 2 * hh + 1], gl.y));
    });
}
// ... or from its 16-bit copies (probabilities' grads)
template <int BM, bool BF16>
FRT_DEVICE void ds_from_dp(float (&dp)[BM / 2], const float (&s)[BM / 2], const float* s_delta, int t,
                           const u32 (&grads)[BM / 4]) {
    ds_from_dp<BM>(dp, s, s_delta, t, [&](int j, int hh) {
        const u32 w = grads[2 * j + hh];
        return make_float2(Elem<BF16>::to_float((u16)(w & 0xFFFFu)), Elem<BF16>::to_float((u16)(w >> 16)));
    });
}

// dV_w += P^T dO and dK_w += dS^T Q (64 x D, k = the BM queries of the stage at sQ, dO after it): A from
// registers, B MN-major (the [query][head_dim] tiles read as K x N). Issued, not committed.
template <class T>
FRT_DEVICE void mma_dv_dk(float (&acc)[2][T::D / 2], const u32 (&pa)[T::BM / 16][4], const u32 (&dsa)[T::BM / 16][4],
                          u32 sQ) {
    sm90::wgmma_rs_mn<T::D, T::BM, T::BF16>(acc[1], pa, sQ + T::QT_BYTES);
    sm90::wgmma_rs_mn<T::D, T::BM, T::BF16>(acc[0], dsa, sQ);
}

// After the wait for mma_dv_dk: its accumulators are final and its A fragments free (their registers
// stay reserved until here: the compiler does not know the wgmmas read them after the issue).
template <int R, int F>
FRT_DEVICE void fence_acc_and_frags(float (&acc)[2][R], u32 (&pa)[F][4], u32 (&dsa)[F][4]) {
    sm90::fence_operand(acc[0]);
    sm90::fence_operand(acc[1]);
#pragma unroll
    for (int kk = 0; kk < F; ++kk) sm90::fence_operand(pa[kk]), sm90::fence_operand(dsa[kk]);
}

// Fused: a warpgroup's 64 x DQ_N block of a pair's dQ (fp32, in the accumulator dq; its first row r0 and column c0 in
// the tile) into the staging tile at s_tile, laid out as its rows are in dq_accum (row-major, D floats a row; the
// tile's row 0 is dq_accum row row0) but with each row's 16-byte chunks permuted as dq_slot says (params.cuh), so that
// the float2 stores meet no bank conflict. Fenced for the bulk copy that reads it (async proxy).
template <int D, int DQ_N>
FRT_DEVICE void stage_dq(u32 s_tile, const float (&dq)[DQ_N / 2], i64 row0, int r0, int c0, int w, int g, int t) {
    static_assert(D >= 64, "stage_dq: dq_slot permutes 16 chunks of a row");
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = r0 + 16 * w + g + 8 * hh;
#pragma unroll
        for (int j = 0; j < DQ_N / 8; ++j) {
            const int slot = dq_slot((c0 + 8 * j + 2 * t) >> 2, row0 + r);
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                         :: "r"(s_tile + r * D * 4 + (slot << 4) + (t & 1) * 8), "f"(dq[4 * j + 2 * hh]),
                         "f"(dq[4 * j + 2 * hh + 1]) : "memory");
        }
    }
    sm90::fence_proxy_async();  // the staged rows -> visible to the bulk copy (async proxy)
}

}  // namespace frt
