// The forward's online softmax (base 2, the scale folded into the exponent), one definition for every
// forward kernel (sm80/fwd.cu, sm90/fwd_sm90.cuh) whatever its accumulator layout: a query row is held by
// the 4 threads of a quad, each with N8 pairs of its scores (columns 8 jj + 2 t + e of an m16n8 mma.sync
// or wgmma accumulator), which the caller names through `x(jj, e)` (a float&).
#pragma once
#include "attention/score_mod.cuh"
#include "common/common.cuh"

namespace frt {

// One key tile's update of a row: its scores become P (unnormalised), row_max / row_sum take in the tile, and
// the return value is alpha, the rescale of what the row accumulated before (O). A row that has seen only masked
// keys keeps row_max = -inf, and subtracts 0 then. (With FRT_SOFTCAP the callers pass tanh(s / cap) as the scores
// and Softcap::scale_of(scale_log2) as the scale: score_mod.cuh.) POLY of every 8 key groups jj take their
// exponentials on the FMA units (common.cuh: poly_exp2), the rest on MUFU: where the MUFU unit bounds the loop
// (head_dim 64, softcap's tanh; docs/perf-notes.md: Exponentials on the FMA units).
// OFF: the thread's scores of the row are x + off (off: one value for all of them, raw units; ALiBi off the
// diagonal, score_mod.cuh: Alibi::add_split), the offset added to the row's maximum and exponent, not to each score.
// SLACK > 0: the row keeps its maximum while a tile's rises above it by at most SLACK (log2 units), so that alpha is
// exactly 1 and the caller may skip O's rescale (FlashAttention-4's rescale threshold): P then reaches 2^SLACK, which
// the fp32 sums and 16-bit P hold (bf16 / fp16 range), and the row's LSE stays exact (max and sum move together).
// MAX_CHAINS: the thread's maximum in that many independent chains (a power of two), merged at the end (a shorter
// dependent chain before the first exponential; max is exact, so the result is the same bits in any order).
template <int N8, int POLY = 0, bool OFF = false, int SLACK = 0, int MAX_CHAINS = 1, class Scores>
FRT_DEVICE float online_row(float& row_max, float& row_sum, float scale_log2, Scores x, float off = 0.f) {
    constexpr int CHAINS = N8 >= 2 * MAX_CHAINS ? MAX_CHAINS : 1;
    float part[CHAINS];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) part[c] = -FRT_INF;  // (as one chain seeded with -inf: NaN scores alike)
#pragma unroll
    for (int jj = 0; jj < N8; ++jj) part[jj % CHAINS] = fmaxf(part[jj % CHAINS], fmaxf(x(jj, 0), x(jj, 1)));
#pragma unroll
    for (int w = CHAINS / 2; w > 0; w /= 2)
#pragma unroll
        for (int c = 0; c < w; ++c) part[c] = fmaxf(part[c], part[c + w]);
    float mx = part[0];
    if constexpr (OFF) mx += off;
    float m_new = fmaxf(row_max, warp_max4(mx) * scale_log2);
    if constexpr (SLACK > 0) {
        if (m_new - row_max <= (float)SLACK) m_new = row_max;  // (-inf - -inf is NaN: a row with no key moves on)
    }
    const float base = m_new == -FRT_INF ? 0.f : m_new;
    const float alpha = fast_exp2(row_max - base);
    row_max = m_new;
    const float shift = OFF ? fmaf(off, scale_log2, -base) : -base;
    float sum = 0.f;
#pragma unroll
    for (int jj = 0; jj < N8; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float& v = x(jj, e);
            const float arg = fmaf(v, scale_log2, shift);
            v = (jj & 7) < POLY ? poly_exp2(arg) : fast_exp2(arg);
            sum += v;
        }
    row_sum = row_sum * alpha + sum;
    return alpha;
}

// An attention sink (FwdParams::sinks): one more logit per head, in the scaled scores' units, that joins every
// row's softmax denominator and has no value. At the end of a row, (row_max, sum) move onto max(row_max, sink)
// with the sink's term added; the return value is what the row's O accumulator (relative to the old row_max) is
// multiplied by besides 1 / sum. A row that saw no key gets O = 0 and LSE = the sink; with no sink (-inf) nothing
// changes (1 is returned). `sum` stays 0 or at least 1 (the largest term), as the callers' fast paths assume.
FRT_DEVICE float add_sink(float& row_max, float& sum, float sink) {
    const float s = sink * kLog2e, m = fmaxf(row_max, s);
    if (m == -FRT_INF) return 1.f;
    const float keep = fast_exp2(row_max - m);
    sum = fmaf(sum, keep, fast_exp2(s - m));
    row_max = m;
    return keep;
}

}  // namespace frt
