// Score modifications on the raw scores s = q . k (before the softmax's scale), one definition for every kernel
// that computes scores (spec.SOFTCAP_FAMILIES). Softcap is elementwise; ALiBi and a user's score_mod read each
// element's (query, key) through mask.cuh's Fragments, the backward's transposed scores included.
//
// Softcap (FRT_SOFTCAP; FwdParams / BwdParams::softcap = c / softmax_scale): s becomes cap tanh(s / cap), so that
// the scaled score x = scale s becomes c tanh(x / c). The forward applies it before the online softmax; the
// backward recomputes it before P and multiplies dS by its derivative, 1 - tanh^2.
#pragma once
#include "attention/mask.cuh"
#include "common/common.cuh"

#ifndef FRT_SOFTCAP
#define FRT_SOFTCAP 0
#endif
#ifndef FRT_ALIBI
#define FRT_ALIBI 0
#endif
#if FRT_ALIBI && FRT_SOFTCAP
#error "softcap with ALiBi: no such variant (flashrt/api.py refuses the pair)"
#endif
#ifndef FRT_TANH_EXACT
#define FRT_TANH_EXACT 0
#endif
#ifndef FRT_SCORE_MOD
#define FRT_SCORE_MOD 0
#endif
#if FRT_SCORE_MOD && (FRT_SOFTCAP || FRT_ALIBI)
#error "score_mod with softcap or ALiBi: no such variant (flashrt/spec.py refuses it; the expression can hold them)"
#endif

#if FRT_SCORE_MOD
#include "attention/dual.cuh"
// The user's expression f over the scaled score s (softmax_scale q . k), the batch entry, query head, query and key
// positions in the sequence, the sequence's lengths, the positions as floats (qf, kf) and up to four tensors (float
// or int, as the user's names declare them), and its derivative in s (the value in *value as well): the user's
// score_mod_grad, or the expression once more over dual numbers (dual.cuh). flashrt/spec.py (score_mod_source)
// writes their definitions after the kernel source, in the expression's environment (dual.cuh: namespace
// flashrt_expr); the forward kernels call only the first.
namespace flashrt_expr {
FRT_DEVICE float flashrt_score_mod(float s, int b, int h, int q, int k, int Lq, int Lk, float qf, float kf,
                                   const void* t0, const void* t1, const void* t2, const void* t3);
FRT_DEVICE float flashrt_score_mod_grad(float s, int b, int h, int q, int k, int Lq, int Lk, float qf, float kf,
                                        const void* t0, const void* t1, const void* t2, const void* t3, float* value);
#if FRT_SCORE_TGRAD
// dz (the loss's derivative in the pair's modified score) times the expression's derivative in each element of the
// "float_grad" tensors it reads (of n0..n3 elements), added into their gradients g0..g3 (dual.cuh: Reads, Seeded;
// frt::tensor_grad_add).
FRT_DEVICE void flashrt_score_mod_tgrad(float s, int b, int h, int q, int k, int Lq, int Lk, float qf, float kf,
                                        const void* t0, const void* t1, const void* t2, const void* t3, float dz,
                                        void* g0, void* g1, void* g2, void* g3, long long n0, long long n1,
                                        long long n2, long long n3);
#endif
}  // namespace flashrt_expr
#endif
#ifndef FRT_SCORE_TGRAD
#define FRT_SCORE_TGRAD 0
#endif

#ifndef FRT_ALIBI_SPLIT  // (0: an A/B of Alibi::add_split)
#define FRT_ALIBI_SPLIT 1
#endif

namespace frt {

#if FRT_SCORE_TGRAD
// A score tensor's gradient element `i` gains v. FRT_SCORE_TGRAD 1: an fp32 atomic add (in no fixed order).
// FRT_SCORE_TGRAD 2 (deterministic): the element is kTgradLimbs int64 limbs of an exact fixed-point sum, limb l
// holding units of 2^(24 l - 96) (the window [2^-96, 2^72)), and the last one a count of values it cannot hold
// (non-finite, or of magnitude 2^71 and up): v's 24-bit mantissa, shifted into place, spans at most two limbs, added
// as integers, so the sum is exact and the same in any order (each limb takes adds under 2^24 in magnitude: exact for
// up to 2^39 of them: flashrt/api.py's _backward_plan bounds the adds). The bits of a value under 2^-96 (a value
// under 2^-73 has some) are rounded to that unit (to nearest, ties up). flashrt/api.py (_add_exact_sums) turns the
// limbs into the float sum.
constexpr int kTgradLimbs = 8;
FRT_DEVICE void tensor_grad_add(void* grad, long long i, float v) {
    if constexpr (FRT_SCORE_TGRAD == 1) {
        if (v != 0.f) atomicAdd(static_cast<float*>(grad) + i, v);
    } else {
        unsigned long long* limbs = static_cast<unsigned long long*>(grad) + i * kTgradLimbs;
        if (v == 0.f) return;
        int e;
        const float fr = frexpf(v, &e);  // v = fr 2^e, 1/2 <= |fr| < 1 (or not finite)
        int pos = e - 24 + 96;           // the bit of the window the mantissa's unit lands on
        if (!isfinite(v) || pos >= 6 * 24) {  // (the top limb takes the last carry)
            atomicAdd(limbs + kTgradLimbs - 1, 1ull);
            return;
        }
        long long m = (long long)(fr * 16777216.f);  // exact: a signed 24-bit integer, v = m 2^(e - 24)
        if (pos < 0) {  // (|m| < 2^24: nothing rounds to a unit from 25 places down)
            m = pos < -24 ? 0 : (m + (1ll << (-pos - 1))) >> -pos;
            pos = 0;
            if (m == 0) return;
        }
        const long long x = m * (1ll << (pos % 24));
        const long long hi = x >> 24, lo = x - hi * (1ll << 24);  // x = hi 2^24 + lo, 0 <= lo < 2^24
        if (lo) atomicAdd(limbs + pos / 24, (unsigned long long)lo);
        if (hi) atomicAdd(limbs + pos / 24 + 1, (unsigned long long)hi);  // (two's complement: a signed add)
    }
}
#endif

// tanh.approx.f32: one MUFU op, relative error <= 2^-10.99, as FlashAttention-2/3 take it (cutlass fast_tanh;
// perf-notes.md, "Softcap": the cost and accuracy measured). FRT_TANH_EXACT=1 (an A/B of scripts/probes/score_mod_cost.py
// --tanh-exact, not a variant of its own): 1 - 2 / (2^(2 x log2 e) + 1), two MUFU ops, absolute error ~1e-7.
FRT_DEVICE float tanh_fast(float x) {
    if constexpr (FRT_TANH_EXACT) {
        return 1.f - 2.f * fast_rcp(fast_exp2(x * (2.f * kLog2e)) + 1.f);
    } else {
        float r;
        asm("tanh.approx.f32 %0, %1;\n" : "=f"(r) : "f"(x));
        return r;
    }
}

struct Softcap {
    float cap = 0.f, inv = 0.f, per_log2 = 0.f;  // cap, 1 / cap, 1 / (scale_log2 cap)
    Softcap() = default;
    FRT_DEVICE Softcap(float c, float scale_log2) : cap(c), inv(1.f / c), per_log2(1.f / (scale_log2 * c)) {}

    FRT_DEVICE float tanh_of(float s) const { return tanh_fast(s * inv); }
    // The forward keeps tanh(s / cap) as its scores (taken before the mask: no -inf test) and folds cap into the
    // exponent's scale: exp2(cap tanh * scale_log2 - m) with one multiply fewer per score.
    FRT_DEVICE float scale_of(float scale_log2) const { return FRT_SOFTCAP ? cap * scale_log2 : scale_log2; }
    // The capped score; a hidden pair's -inf stays -inf.
    FRT_DEVICE float apply(float s) const { return s == -FRT_INF ? s : cap * tanh_of(s); }
    // ... with tanh_of(s) at hand
    FRT_DEVICE float of_tanh(float s, float th) const { return s == -FRT_INF ? s : cap * th; }
    // 1 - tanh^2 of the pair whose P = exp2(capped * scale_log2 - lse2) is `prob` (recovered from P, for a kernel
    // that keeps no copy of the scores until dS): any finite value where P = 0 (dS is 0 there), never NaN.
    FRT_DEVICE float grad_from_p(float prob, float lse2) const {
        const float th = (fast_log2(fmaxf(prob, 1e-30f)) + lse2) * per_log2;
        return prob > 0.f ? 1.f - th * th : 0.f;
    }
};

// ALiBi (FRT_ALIBI; FwdParams / BwdParams::alibi, alibi_bstride): the scaled score of query i and key j gains
// -slope |j - i - shift|, shift the sequence's causal alignment (Visibility::shift, used causal or not), so the raw
// score gains -(slope / scale) |j - i - shift|. Additive and not learned: the backward recomputes P with it, and dS
// needs nothing more. Per element one FADD (the distance, from one conversion per call and constant offsets: no
// I2F per element, which would share the MUFU ops' issue rate) and one FFMA with |d|.
struct Alibi {
    float slope = 0.f;  // per raw-score unit: slope / softmax_scale
    int shift = 0;
    Alibi() = default;
    template <class P>
    FRT_DEVICE Alibi(const P& p, int b, int h, int shift_)
        : slope(p.alibi[(i64)b * p.alibi_bstride + h] * (kLog2e / p.scale_log2)), shift(shift_) {}

    // x(mt, jj, c) (a float&) of MT m-tiles by N8 n-groups at `at` gain their pair's bias (TRANSPOSED: rows are keys).
    template <int MT, int N8, bool TRANSPOSED = false, class Elem>
    FRT_DEVICE void add(Fragments at, const Elem& x) const {
        const float base = (float)(TRANSPOSED ? at.row0 - at.col0 - shift : at.col0 - at.row0 - shift);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int jj = 0; jj < N8; ++jj)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int rows = 16 * mt + 8 * (c >> 1), cols = 8 * jj + (c & 1);  // the element's offsets
                    const float d = base + (float)(TRANSPOSED ? rows - cols : cols - rows);  // key - query - shift
                    x(mt, jj, c) = fmaf(-slope, fabsf(d), x(mt, jj, c));
                }
    }
    // The same on the forward's fragment of N8 key groups (rows queries; at.row0 the thread's first row, at.col0 its
    // first key, in key tile n0..): where the thread's two rows see the tile's keys on one side of the diagonal only,
    // each score gains one FFMA's share, k (8 jj + e) with k = -slope right of the diagonal, slope left, and
    // off[hh] = k (col0 - row - shift) is the rest, one value for a row's elements (softmax.cuh: online_row's OFF):
    // one FP op a score, not two. Elsewhere (the diagonal's tiles) `add`, and off 0.
    template <int N8, class Elem>
    FRT_DEVICE void add_split(Fragments at, int n0, float (&off)[2], const Elem& x) const {
        const int lo = n0 - (at.row0 + 8) - shift, hi = n0 + 8 * N8 - 1 - at.row0 - shift;  // key - query - shift
        if (!FRT_ALIBI_SPLIT || (lo < 0 && hi > 0)) {
            add<1, N8>(at, x);
            off[0] = off[1] = 0.f;
            return;
        }
        const float k = lo >= 0 ? -slope : slope;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) off[hh] = k * (float)(at.col0 - at.row0 - 8 * hh - shift);
#pragma unroll
        for (int jj = 0; jj < N8; ++jj)
#pragma unroll
            for (int c = 0; c < 4; ++c) x(0, jj, c) = fmaf((float)(8 * jj + (c & 1)), k, x(0, jj, c));
    }
};

// A user's score_mod (FRT_SCORE_MOD; FwdParams / BwdParams::score_t0..3 its tensors): the raw score s of query i
// and key j of query head h becomes f(scale s, ...), a scaled score (the exponentials take it times log2 e:
// exp_scale), before the mask (a hidden pair's value is never read: masks assign, and the backward zeroes P and dS
// there by selection, not by a product). The positions are clamped to the sequence's last (they are never negative,
// and a tile that holds rows or keys has Lq, Lk >= 1), as mask_mod's are, so that a tile's rows and columns past its
// ends read the tensors where the expression reads them for a pair inside it. The backward takes P from f's value
// and multiplies dS by f'.
struct ScoreMod {
    float scale = 0.f;  // softmax_scale (from scale_log2, the same in both passes)
    int b = 0, h = 0, Lq = 1, Lk = 1;
    const void* t[4] = {};
    ScoreMod() = default;
    template <class P, class Vis>
    FRT_DEVICE ScoreMod(const P& p, int b_, int h_, const Vis& vis)
        : scale(p.scale_log2 * (1.f / kLog2e)), b(b_), h(h_), Lq(vis.Lq), Lk(vis.Lk) {
        t[0] = p.score_t0, t[1] = p.score_t1, t[2] = p.score_t2, t[3] = p.score_t3;
    }
    // The factor of a score in the base-2 exponentials (scale_log2 of a raw score; log2 e of a modified one, which
    // is scaled already: one multiply per score fewer than a raw value).
    FRT_DEVICE static float exp_scale(float scale_log2) { return FRT_SCORE_MOD ? kLog2e : scale_log2; }
    // This modification for query head h_ (the backward's key-parallel kernels visit several).
    FRT_DEVICE ScoreMod head(int h_) const {
        ScoreMod m = *this;
        m.h = h_;
        return m;
    }

    // Element (mt, jj, c) of the fragments at `at` (mask.cuh: Fragments; TRANSPOSED: rows are keys): its query and
    // key positions, clamped, as ints and as floats. The floats come from one conversion of the fragments' first row
    // and column and exact offsets, not one per score (a quarter-rate op, as the exponential; an ALiBi-like expression
    // took about the same time either way, H200: docs/perf-notes.md, score_mod).
    template <bool TRANSPOSED>
    FRT_DEVICE void positions(Fragments at, int mt, int jj, int c, int& i, int& j, float& fi, float& fj) const {
        const int dr = 16 * mt + 8 * (c >> 1), dc = 8 * jj + (c & 1);
        const int r = at.row0 + dr, col = at.col0 + dc;
        const float rf = (float)at.row0 + (float)dr, cf = (float)at.col0 + (float)dc;
        i = min(TRANSPOSED ? col : r, Lq - 1), j = min(TRANSPOSED ? r : col, Lk - 1);
        fi = fminf(TRANSPOSED ? cf : rf, (float)(Lq - 1)), fj = fminf(TRANSPOSED ? rf : cf, (float)(Lk - 1));
    }

    // The modified score of element (mt, jj, c) (scaled: exp_scale).
    template <bool TRANSPOSED = false>
    FRT_DEVICE float value(float s, Fragments at, int mt, int jj, int c) const {
#if FRT_SCORE_MOD
        int i, j;
        float fi, fj;
        positions<TRANSPOSED>(at, mt, jj, c, i, j, fi, fj);
        return flashrt_expr::flashrt_score_mod(s * scale, b, h, i, j, Lq, Lk, fi, fj, t[0], t[1], t[2], t[3]);
#else
        return s;
#endif
    }
    // ... and in g its derivative in the scaled score (dS's factor). (A template, so that the forward kernels, whose
    // sources define no derivative, never instantiate it.)
    template <bool TRANSPOSED = false>
    FRT_DEVICE float value_grad(float s, Fragments at, int mt, int jj, int c, float& g) const {
#if FRT_SCORE_MOD
        int i, j;
        float fi, fj, f;
        positions<TRANSPOSED>(at, mt, jj, c, i, j, fi, fj);
        g = flashrt_expr::flashrt_score_mod_grad(s * scale, b, h, i, j, Lq, Lk, fi, fj, t[0], t[1], t[2], t[3], &f);
        return f;
#else
        g = 1.f;
        return s;
#endif
    }

    // The gradients of the "float_grad" tensors (FRT_SCORE_TGRAD; BwdParams::score_g0..3) gain dz times the
    // expression's derivative in each element read for element (mt, jj, c) of raw score s.
    template <class P>
    FRT_DEVICE void tensor_grads(const P& p, float s, Fragments at, int mt, int jj, int c, float dz) const {
#if FRT_SCORE_TGRAD
        int i, j;
        float fi, fj;
        positions<false>(at, mt, jj, c, i, j, fi, fj);
        flashrt_expr::flashrt_score_mod_tgrad(s * scale, b, h, i, j, Lq, Lk, fi, fj, t[0], t[1], t[2], t[3], dz,
                                              p.score_g0, p.score_g1, p.score_g2, p.score_g3, p.score_n0, p.score_n1,
                                              p.score_n2, p.score_n3);
#endif
    }

    // x(mt, jj, c) (a float&) of MT m-tiles by N8 n-groups at `at` replaced by value() (TRANSPOSED: rows are keys).
    template <int MT, int N8, bool TRANSPOSED = false, class Elem>
    FRT_DEVICE void apply(Fragments at, const Elem& x) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int jj = 0; jj < N8; ++jj)
#pragma unroll
                for (int c = 0; c < 4; ++c) x(mt, jj, c) = value<TRANSPOSED>(x(mt, jj, c), at, mt, jj, c);
    }
};

}  // namespace frt
