// What the two wgmma forwards (fwd_sm90.cu, fwd_sm90_ws.cu) do per warpgroup: 64 query rows' O
// accumulator and online softmax (base 2, scale folded in) over the key tiles they visit, and the
// epilogue. The kernels differ in how tiles reach shared memory and when wgmmas are issued.
//
// A thread holds rows 16 w + g (hh = 0) and 16 w + g + 8 (hh = 1) of its warpgroup's rows; its
// accumulator element [4 j + 2 hh + e] is column 8 j + 2 t + e (wgmma.cuh: the accumulator layout).
#pragma once
#include "attention/dropout.cuh"
#include "attention/params.cuh"
#include "attention/softmax.cuh"
#include "common/wgmma.cuh"

#ifndef FRT_EXP_POLY  // (an A/B's count of FwdRows::EXP_POLY; -1: the kernel's own)
#define FRT_EXP_POLY -1
#endif

namespace frt {
namespace sm90 {

// MOD_FENCED: mask_mod's element mask is evaluated in fenced groups of columns (mod_mask), for a kernel whose
// registers cannot hold the unrolled loop's verdicts and reads (fwd_sm90_ws).
// SLACK: MAX_SLACK below (fwd_sm90_ws; fwd_sm90 at two blocks an SM has no registers for it: a score_mod spilled).
// CHAINS: MAX_CHAINS below (fwd_sm90_ws; the plain fwd_sm90 keeps one chain, never measured with more).
template <int D, int BN, bool BF16, bool MOD_FENCED = false, int SLACK = 0, int CHAINS = 1>
struct FwdRows {
    // Of every 8 key groups of a row, those whose exponentials run on the FMA units (softmax.cuh: online_row): 2 with
    // softcap (whose tanh is a second MUFU op per score), else none (docs/perf-notes.md: Exponentials on the FMA
    // units).
    static constexpr int EXP_POLY = FRT_EXP_POLY >= 0 ? FRT_EXP_POLY : FRT_SOFTCAP ? 2 : 0;
    // A row keeps its maximum while a tile raises it by at most MAX_SLACK (log2 units; softmax.cuh: online_row), and a
    // warp whose rows all kept theirs skips O's rescale at the top of the next iteration (retire_pv)
    static constexpr int MAX_SLACK = SLACK;
    // softmax.cuh: online_row's chains of the row maximum (16-bit dropout draws: one; four spilled 16-20 bytes)
    static constexpr int MAX_CHAINS = FRT_DROPOUT == 16 ? 1 : CHAINS;
    float o[D / 2];
    float row_max[2] = {-FRT_INF, -FRT_INF}, row_sum[2] = {0.f, 0.f};
    // Across iterations: s holds the last tile's P (fp32) and alpha its rescale of O, until both are
    // applied at the top of the next iteration (retire_pv); pa is P packed as the A operand of its
    // P V wgmma.
    float s[BN / 2], alpha[2] = {1.f, 1.f};
    u32 pa[BN / 16][4];
    Softcap cap;   // FRT_SOFTCAP: set by the kernel (score_mod.cuh)
    Alibi alibi;  // FRT_ALIBI: set by the kernel
    float alibi_off[2] = {0.f, 0.f};  // FRT_ALIBI: the last tile's per-row part of the bias (Alibi::add_split)
    ScoreMod smod;  // FRT_SCORE_MOD: set by the kernel
    Dropout drop;   // FRT_DROPOUT: set by the kernel

    FRT_DEVICE FwdRows() {
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    }

    // O's rescale and P's packing, once the P V wgmma issued last iteration is done. (At the top of
    // an iteration: written at its end, the wait was hoisted by ptxas above the softmax, whatever
    // kept P's registers live: docs/perf-notes.md: Forward: wgmma (fwd_sm90).)
    // RESCALE false: O's rescale left to rescale_o (fwd_sm90_ws.cu runs it under the next S wgmma).
    template <bool RESCALE = true>
    FRT_DEVICE void retire_pv() {
        wgmma_wait<0>();
        fence_operand(o);
        if constexpr (RESCALE) rescale_o();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) acc_to_a_frag<BN / 2, BF16>(s, kk, pa[kk]);
    }
    // O *= alpha, skipped by a warp whose rows all kept their maximum (MAX_SLACK: alpha exactly 1)
    FRT_DEVICE void rescale_o() {
        if (MAX_SLACK > 0 && __all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
        for (int jj = 0; jj < D / 8; ++jj)
#pragma unroll
            for (int c = 0; c < 4; ++c) o[4 * jj + c] *= alpha[c >> 1];
    }

    // mask_mod's element mask of key tile n0.. on the thread's elements of s (MOD_FENCED). Where the
    // thread's rows and the tile's keys lie inside the sequence, without the length tests and clamps, each
    // verdict applied as it is made, 8 key columns (16 elements) at a time with a compiler fence after
    // each, so that the next columns' reads are not all hoisted above this group's verdicts (unfenced, the
    // 64 verdicts and their reads spilled fwd_sm90_ws's consumers). At the sequence's ends, the full test
    // into bits in a rolled loop, then applied (fenced, with groups of 1, 2, 4 or 8 jj, that spilled 128
    // bytes with a window and lengths at head_dim 128, NVRTC 12.9). Bits everywhere cost documents-mod at
    // S=1k 212-214 us against 185-190 fenced: their packing and unpacking were ~3 of ~7 instructions per
    // element (docs/perf-notes.md: mask_mod element mask).
    template <class Tile>
    FRT_DEVICE void mod_mask(const Tile& tile, int n0, int row_base, int t) {
        static_assert(BN % 64 == 0, "mod_mask: key tiles of 64 or 128 (its groups of 4 jj and 64-key bit words)");
        const auto& vis = tile.vis;
        // (With a window too, the fenced form spilled 8-16 bytes with lengths at head_dim 64 and 128.)
        constexpr bool FENCED = !Tile::WINDOW;
        if (FENCED && (row_base + 8 < vis.Lq) & (n0 + BN <= vis.Lk))
            mask_fenced(n0, row_base, t, [&](int i, int j) { return vis.visible_inside(i, j, tile.h); });
        else
            mask_rolled(n0, row_base, t, [&](int i, int j) { return tile.visible(i, j, tile.h); });
    }
    template <class Visible>
    FRT_DEVICE void mask_fenced(int n0, int row_base, int t, Visible visible) {
        constexpr int GROUP = 4;  // jj per fence: 8 key columns, 16 elements (the only size timed)
#pragma unroll
        const Fragments at{row_base, n0 + 2 * t};
#pragma unroll
        for (int jb = 0; jb < BN / 8; jb += GROUP) {
#pragma unroll
            for (int jj = jb; jj < jb + GROUP; ++jj)
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    if (!at.visible<false>(0, jj, c, visible)) s[4 * jj + c] = -FRT_INF;
            asm volatile("" ::: "memory");
        }
    }
    // Bit 4 (jj % 8) + c of bits[jj / 8] for s[4 jj + c], 16 verdicts per turn of a rolled loop, then applied.
    template <class Visible>
    FRT_DEVICE void mask_rolled(int n0, int row_base, int t, Visible visible) {
        const Fragments at{row_base, n0 + 2 * t};
        u32 bits[BN / 64];
#pragma unroll
        for (int w = 0; w < BN / 64; ++w) {
            u32 acc = 0;
#pragma unroll 1
            for (int jb = 0; jb < 8; jb += 4) {
                u32 nib = 0;
#pragma unroll
                for (int u = 0; u < 4; ++u)
#pragma unroll
                    for (int c = 0; c < 4; ++c) nib |= (u32)at.visible<false>(0, 8 * w + jb + u, c, visible) << (4 * u + c);
                acc |= nib << (4 * jb);
            }
            bits[w] = acc;
        }
#pragma unroll
        for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (!((bits[jj / 8] >> (4 * (jj % 8) + c)) & 1u)) s[4 * jj + c] = -FRT_INF;
    }

    // Key tile it (j) of `tile`, scores in s: the element mask where the tile needs it, then the online
    // softmax (s becomes P, unnormalised; alpha the rescale of O). row_base: the thread's first row.
    template <class Tile>
    FRT_DEVICE void softmax(const Tile& tile, int it, int j, int row_base, int t, float scale_log2) {
        mod_scores(row_base, j * BN, t);
        if (tile.needs_mask(it, j)) {
            const int n0 = j * BN;
            if constexpr (Tile::INTERVALS) {  // keys [lo, hi) of the tile per row
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const RowInterval keys(tile.key_interval(row_base + 8 * hh, n0, BN), n0, 2 * t);
#pragma unroll
                    for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (!keys.visible<Tile::KEY_LO>(8 * jj + e)) s[4 * jj + 2 * hh + e] = -FRT_INF;
                }
            } else if constexpr (MOD_FENCED && Tile::MOD) {
                mod_mask(tile, n0, row_base, t);
            } else {
                mask_fragments<1, BN / 8>(Fragments{row_base, n0 + 2 * t}, -FRT_INF,
                                          [&](int, int jj, int c) -> float& { return s[4 * jj + c]; },
                                          [&](int q, int k) { return tile.visible(q, k, tile.h); });
            }
        }
        online(scale_log2, row_base, j * BN, t);
    }

    // Causal without mask bits, on key tile j whose diagonal is this warpgroup's: its rows see the thread's key
    // groups jj < JLO whole and none from JHI on (fwd_sm90_ws: the aligned diagonal tile), so only the groups
    // [JLO, JHI) are compared, and the masked ones' P is 0 without their exponentials.
    template <int JLO, int JHI, class Tile>
    FRT_DEVICE void softmax_diagonal(const Tile& tile, int j, int row_base, int t, float scale_log2) {
        static_assert(Tile::ROW_LIMIT && 0 <= JLO && JLO <= JHI && JHI <= BN / 8, "softmax_diagonal: causal key groups");
        mod_scores<JHI>(row_base, j * BN, t);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int hi = tile.key_limit(row_base + 8 * hh) - j * BN - 2 * t;  // in columns 8 jj + e
#pragma unroll
            for (int jj = JLO; jj < JHI; ++jj)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (8 * jj + e >= hi) s[4 * jj + 2 * hh + e] = -FRT_INF;
        }
        online<JHI>(scale_log2, row_base, j * BN, t);
    }

    // The score modifications (score_mod.cuh) on the key groups jj < JHI of key tile n0.. (row_base: the thread's
    // first row), before any mask. FRT_SOFTCAP: the scores become tanh(s / cap) (online folds the cap into the scale:
    // Softcap::scale_of); FRT_ALIBI: each gains its pair's bias; FRT_SCORE_MOD: each becomes the user's expression's
    // value. Every caller of online runs it first.
    template <int JHI = BN / 8>
    FRT_DEVICE void mod_scores(int row_base, int n0, int t) {
        if constexpr (FRT_SOFTCAP) {
#pragma unroll
            for (int i = 0; i < 4 * JHI; ++i) s[i] = cap.tanh_of(s[i]);
        }
        if constexpr (FRT_ALIBI)
            alibi.add_split<JHI>(Fragments{row_base, n0 + 2 * t}, n0, alibi_off,
                                 [&](int, int jj, int c) -> float& { return s[4 * jj + c]; });
        if constexpr (FRT_SCORE_MOD)
            smod.apply<1, JHI>(Fragments{row_base, n0 + 2 * t},
                               [&](int, int jj, int c) -> float& { return s[4 * jj + c]; });
    }

    // The online softmax of the scores in s, the key groups jj < JHI (s becomes P, unnormalised; alpha the rescale
    // of O); the groups from JHI on are masked for every row here, and their P is 0. FRT_DROPOUT: then the dropped
    // elements of P become 0 (key tile n0.., row_base: the thread's first row; the rows' sums took them).
    template <int JHI = BN / 8>
    FRT_DEVICE void online(float scale_log2, int row_base, int n0, int t) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            alpha[hh] = online_row<JHI, EXP_POLY, (bool)FRT_ALIBI, MAX_SLACK, MAX_CHAINS>(
                row_max[hh], row_sum[hh], ScoreMod::exp_scale(cap.scale_of(scale_log2)),
                [&](int jj, int e) -> float& { return s[4 * jj + 2 * hh + e]; }, alibi_off[hh]);
#pragma unroll
            for (int jj = JHI; jj < BN / 8; ++jj) s[4 * jj + 2 * hh] = s[4 * jj + 2 * hh + 1] = 0.f;
        }
        if constexpr (FRT_DROPOUT) {
            constexpr int J = (JHI + 1) / 2 * 2;  // (draws cover 16 columns)
            drop.each<J>(row_base, n0 + 2 * t, [&](int i, u32 dropped) {
                if (dropped) s[i] = 0.f;
            });
        }
    }

    // Epilogue, part 1 (no wgmma needed; fwd_sm90_ws runs it under the last P V): the row sums over the
    // quad (with the head's sink: add_sink), the LSE of the rows that exist, and row_sum becomes the factor of O,
    // 1 / sum (0 for a row that saw no key). A row's sum is 0 or at least 1 (its maximum's term): the
    // approximate reciprocal and log2, without the slow-path tests of 1.f / sum and __log2f. wg, w, g, t: the
    // thread's warpgroup, warp in it, and lane's row / column.
    template <class Tile>
    FRT_DEVICE void finish_rows(const FwdParams& p, const Tile& tile, int wg, int w, int g, int t) {
        float* glse = p.lse + tile.stat0 + 64 * wg;
        const float sink = p.sinks ? p.sinks[tile.h] : -FRT_INF;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float sum = warp_sum4(row_sum[hh]), mx = row_max[hh];
            const float keep = add_sink(mx, sum, sink);
            const int r = 16 * w + g + 8 * hh;
            if (t == 0 && r < tile.rows - 64 * wg) glse[r] = sum > 0.f ? (mx + fast_log2(sum)) * kLn2 : -FRT_INF;
            row_sum[hh] = sum > 0.f ? keep * fast_rcp(sum) * drop.scale : 0.f;
        }
    }

    // Epilogue, part 2 (after finish_rows, every wgmma complete): O normalised and staged into this
    // warpgroup's own 64 rows (of WGS warpgroups) of the BM-row sw128 tile at sQw (only it read them), then 16-byte stores of
    // the rows that exist (indexed by threadIdx.x & 127 instead of 32 w + 4 g + t: 3 registers fewer at
    // head_dim 128).
    template <int BM, int WGS = 2, class Tile>
    FRT_DEVICE void store_o(const FwdParams& p, const Tile& tile, u32 sQw, int wg, int w, int g, int t) {
#pragma unroll
        for (int jj = 0; jj < D / 8; ++jj)
#pragma unroll
            for (int c = 0; c < 4; ++c) o[4 * jj + c] *= row_sum[c >> 1];
        acc_to_sw128<BM, D, BF16>(sQw, o, 1.f, w, g, t);
        if (wg == 0)
            warpgroup_bar<1>();
        else if (WGS == 2 || wg == 1)
            warpgroup_bar<2>();
        else
            warpgroup_bar<3>();
        sw128_rows_to_global<BM, D>(p.o + tile.b * p.o_sb + (tile.row0 + 64 * wg) * p.o_ss + tile.h * p.o_sh, p.o_ss,
                                    sQw, tile.rows - 64 * wg, p.head_dim_v, threadIdx.x & 127);
    }
    // Epilogue, part 2 without shared memory (fwd_sm90_ws with one Q slot: the slot went back before the epilogue):
    // O normalised, from registers to global memory (wgmma.cuh: acc_to_global).
    template <class Tile>
    FRT_DEVICE void store_o_direct(const FwdParams& p, const Tile& tile, int wg, int w, int g, int t) {
        acc_to_global<D, BF16>(p.o + tile.b * p.o_sb + (tile.row0 + 64 * wg) * p.o_ss + tile.h * p.o_sh, p.o_ss, o,
                               row_sum, tile.rows - 64 * wg, p.head_dim_v, w, g, t);
    }
    template <int BM, class Tile>
    FRT_DEVICE void store(const FwdParams& p, const Tile& tile, u32 sQw, int wg, int w, int g, int t) {
        finish_rows(p, tile, wg, w, g, t);
        store_o<BM>(p, tile, sQw, wg, w, g, t);
    }
};

}  // namespace sm90
}  // namespace frt
