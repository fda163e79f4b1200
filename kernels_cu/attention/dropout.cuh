// Attention dropout (FRT_DROPOUT): each probability P[q, k] is kept with probability ~1 - p and scaled by its inverse,
// or dropped, by a mask that every kernel regenerates from a counter-based RNG (Philox-4x32, 7 rounds), whatever its
// fragment layout: the forward's (rows: queries) and the backward's transposed scores (rows: keys) alike. One
// definition for every kernel that computes P; flashrt/reference.py (dropout_mask) is the same function in numpy.
// FRT_DROPOUT is the bits of a draw each element takes, 8 or 16 (flashrt/spec.py: dropout_resolution picks per p);
// an element is kept where its bits are under keep (~(1 - p) 2^bits).
//
// 16 bits: the pairs fall into draws of 8, the query rows {q0, q0 + 8} (q0 = 16 qb + g, g < 8) by the keys {k0, k0 + 1,
// k0 + 8, k0 + 9} (k0 = 16 kb + 2 t, t < 4): the elements one thread of an m16n8 fragment (mma.sync or wgmma) holds of
// a 16 x 16 block. A draw is Philox-4x32-7 of the counter (32 kb + 4 g + t, qb, b H + h, offset) under the key (seed,
// offset's high word xored into the seed's), and element (q0 + 8 a, k0 + 8 c + e) takes half e of word 2 a + c. A
// transposed fragment (rows: keys) holds 4 elements of each of two draws, which the warp's lanes pass on
// (Dropout::transposed_eight): one draw per 8 elements in every kernel.
//
// 8 bits: the draws of 16, queries 16 qb + 8 hq + 2 a + pq by keys 16 kb + 8 hk + 2 b + pk (a, b < 4; hq, pq, hk, pk
// < 2), counter (16 kb + 4 a + b, qb, b H + h, offset), the element taking byte 2 hq + pk of word 2 pq + hk. A
// thread of a fragment holds 8 of a draw's elements in either orientation: the forward's lane (g, t) those of draw
// (a, b) = (g / 2, t) with pq = g & 1, words 2 pq and 2 pq + 1; the transposed lane (g, t) those of (t, g / 2) with
// pk = g & 1. Lanes g and g ^ 1 (lane ^ 4) want the two halves of the same draws, so over two 16-column blocks each
// makes one of them and they swap halves (Dropout::pair_halves): one draw per 16 elements, 2 shuffles.
#pragma once
#include "attention/mask.cuh"
#include "common/common.cuh"

#ifndef FRT_DROPOUT
#define FRT_DROPOUT 0  // 0: none; else the bits of a draw an element takes, 8 or 16
#endif
static_assert(FRT_DROPOUT == 0 || FRT_DROPOUT == 8 || FRT_DROPOUT == 16, "FRT_DROPOUT: 0, 8 or 16");

namespace frt {

// Philox-4x32-R (Salmon et al., SC 2011): R rounds of two 32 x 32 -> 64-bit products, the key bumped by the Weyl
// constants between rounds. Dropout takes R = 7 (kDropoutRounds), which the paper found to pass TestU01's BigCrush
// (10, cuRAND's, adds margin; FlashAttention-2's dropout uses 7). With the forward's keys hoisted, 7 rounds took the
// dropout forward 10-20% faster than 10 (H200, docs/perf-notes.md: Dropout).
constexpr int kDropoutRounds = 7;
template <int R>
FRT_DEVICE uint4 philox4x32(uint4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r > 0) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
        const u32 lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const u32 lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// A call's dropout for one (sequence, query head): FwdParams / BwdParams::drop_rng (2 int64 in device memory, seed and
// offset: read there so that a CUDA graph's replays take fresh ones), drop_keep and drop_scale.
struct Dropout {
    u32 k0 = 0, k1 = 0, off = 0, bh = 0, keep = 0;
    float scale = 1.f;  // 2^bits / keep (~1 / (1 - p)), which the kept probabilities take

    FRT_DEVICE Dropout() {}
    template <class P>
    FRT_DEVICE Dropout(const P& p, int b, int h) {
        const u64 seed = p.drop_rng[0], offset = p.drop_rng[1];
        k0 = (u32)seed, k1 = (u32)(seed >> 32) ^ (u32)(offset >> 32), off = (u32)offset;
        bh = (u32)b * (u32)p.H + (u32)h, keep = (u32)p.drop_keep, scale = p.drop_scale;
    }
    FRT_DEVICE Dropout head(int b, int h, int H) const {  // the same call's, for another (sequence, query head)
        Dropout d = *this;
        d.bh = (u32)b * (u32)H + (u32)h;
        return d;
    }
    // OPAQUE: the key passes through an opaque move, so that ptxas cannot hoist the rounds' keys out of the caller's
    // loop (bits' rolled one: there, held throughout, they spilled the wgmma backward 12-96 bytes, NVRTC 12.9); the
    // forward's unrolled draws keep them hoisted, two adds per round fewer.
    template <bool OPAQUE = false>
    FRT_DEVICE uint4 draw(u32 atom, u32 qb) const {
        u32 a = k0, b = k1;
        if constexpr (OPAQUE) {
            asm volatile("mov.b32 %0, %0;" : "+r"(a));
            asm volatile("mov.b32 %0, %0;" : "+r"(b));
        }
        return philox4x32<kDropoutRounds>(make_uint4(atom, qb, bh, off), a, b);
    }
    FRT_DEVICE u32 dropped(u32 word, int half) const { return ((word >> (16 * half)) & 0xFFFFu) >= keep; }
    FRT_DEVICE u32 byte_dropped(u32 word, int i) const { return ((word >> (8 * i)) & 0xFFu) >= keep; }

    // Each element of a thread's fragment of N8 8-column groups (N8 even; mask.cuh: Fragments), rows queries and columns
    // keys (the forward's), with whether it is dropped: f(4 jj + 2 hh + e, dropped) for element (row + 8 hh,
    // col + 8 jj + e); row = 16 x + g, col = 16 y + 2 t; positions in the sequence. Every lane of the warp calls it
    // together (8 bits: the lanes swap halves of draws).
    template <int N8, class F>
    FRT_DEVICE void each(int row, int col, const F& f) const {
        static_assert(N8 % 2 == 0, "dropout draws cover 16 columns");
        const u32 g = row & 7, t = (col >> 1) & 3, rb = row >> 4, cb = col >> 4;
        if constexpr (FRT_DROPOUT == 8) {
            constexpr int U = N8 / 2;  // 16-column blocks
#pragma unroll
            for (int u = 0; u < U; u += 2) {
                uint2 h[2];
                if (u + 1 < U)
                    pair_halves<false, false>(rb, cb + u, g, t, h[0], h[1]);
                else
                    h[0] = lone_half<false, false>(rb, cb + u, g, t);
#pragma unroll
                for (int v = 0; v < 2; ++v)
#pragma unroll
                    for (int i = 0; i < 8; ++i)  // (element i of a block's 8: byte i of the half)
                        if (u + v < U) f(8 * (u + v) + i, byte_dropped(i < 4 ? h[v].x : h[v].y, i & 3));
            }
        } else {
#pragma unroll
            for (int u = 0; u < N8 / 2; ++u) {
                const uint4 r = draw(32 * (cb + u) + 4 * g + t, rb);
                const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                        for (int e = 0; e < 2; ++e) f(4 * (2 * u + c) + 2 * hh + e, dropped(w[2 * hh + c], e));
            }
        }
    }
    // The same as a word: bit i set where element i is dropped (TRANSPOSED: rows are keys, columns queries, the
    // backward's S^T). One draw at a time, in a rolled loop (the kernels that take the word keep their accumulators
    // live, and ptxas interleaving unrolled draws spilled the wgmma dK / dV kernels 16-156 bytes, NVRTC 12.9). Every
    // lane of the warp calls it together.
    template <int N8, bool TRANSPOSED = false, bool WORDWISE = true>
    FRT_DEVICE typename BitsOf<4 * N8>::type bits(int row, int col) const {
        static_assert(N8 % 2 == 0, "dropout draws cover 16 columns");
        using Bits = typename BitsOf<4 * N8>::type;
        const u32 g = row & 7, t = (col >> 1) & 3, rb = row >> 4, cb = col >> 4;
        Bits out = 0;
        if constexpr (FRT_DROPOUT == 8) {
            constexpr int U = N8 / 2;
#pragma unroll 1
            for (int u = 0; u + 1 < U; u += 2) {
                uint2 h0, h1;
                pair_halves<TRANSPOSED, true>(rb, cb + u, g, t, h0, h1);
                out |= (Bits)(eight<TRANSPOSED, WORDWISE>(h0) | eight<TRANSPOSED, WORDWISE>(h1) << 8) << (8 * u);
            }
            if constexpr (U % 2)
                out |= (Bits)eight<TRANSPOSED, WORDWISE>(lone_half<TRANSPOSED, true>(rb, cb + U - 1, g, t))
                       << (8 * (U - 1));
            return out;
        }
#pragma unroll 1
        for (int u = 0; u < N8 / 2; ++u) {
            if constexpr (!TRANSPOSED) {
                const uint4 r = draw<true>(32 * (cb + u) + 4 * g + t, rb);
                const u32 w[4] = {r.x, r.y, r.z, r.w};
                u32 eight = 0;  // bit 4 c + 2 hh + e of column block u
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                        for (int e = 0; e < 2; ++e) eight |= dropped(w[2 * hh + c], e) << (4 * c + 2 * hh + e);
                out |= (Bits)eight << (8 * u);
            } else {
                out |= (Bits)transposed_eight(rb, cb + u, g, t) << (8 * u);
            }
        }
        return out;
    }

    // 8 bits. The draw of 16-column block cb (row block rb) whose elements lane (g, t) holds: the forward's lanes
    // (rows queries) draw (g / 2, t) of block (rb, cb), the transposed ones (rows keys) draw (t, g / 2) of (cb, rb).
    template <bool TRANSPOSED, bool OPAQUE>
    FRT_DEVICE uint4 block_draw(u32 rb, u32 cb, u32 g, u32 t) const {
        return TRANSPOSED ? draw<OPAQUE>(16 * rb + 4 * t + (g >> 1), cb) : draw<OPAQUE>(16 * cb + 4 * (g >> 1) + t, rb);
    }
    // 8 bits: the half of draw r that lane (g, t) holds, as two words with its element i in byte i (forward: words
    // 2 pq, 2 pq + 1, pq = g & 1, as drawn; TRANSPOSED: bytes pk = g & 1 of words 2 pq + hk, word pq's byte 2 hk + hq,
    // which `eight` reorders), and the other half, lane g ^ 1's, in `give`.
    template <bool TRANSPOSED>
    FRT_DEVICE static void halves(uint4 r, u32 odd, uint2& own, uint2& give) {
        if constexpr (!TRANSPOSED) {
            own = odd ? make_uint2(r.z, r.w) : make_uint2(r.x, r.y);
            give = odd ? make_uint2(r.x, r.y) : make_uint2(r.z, r.w);
        } else {
            const u32 mine = odd ? 0x7531u : 0x6420u, theirs = mine ^ 0x1111u;
            own = make_uint2(__byte_perm(r.x, r.y, mine), __byte_perm(r.z, r.w, mine));
            give = make_uint2(__byte_perm(r.x, r.y, theirs), __byte_perm(r.z, r.w, theirs));
        }
    }
    // 8 bits: lane (g, t)'s halves of blocks cb and cb + 1: it draws block cb + (g & 1), lane g ^ 1 the other, and
    // they swap the halves each wants. Every lane of the warp calls it together.
    template <bool TRANSPOSED, bool OPAQUE>
    FRT_DEVICE void pair_halves(u32 rb, u32 cb, u32 g, u32 t, uint2& first, uint2& second) const {
        const u32 odd = g & 1;
        uint2 own, give;
        halves<TRANSPOSED>(block_draw<TRANSPOSED, OPAQUE>(rb, cb + odd, g, t), odd, own, give);
        const uint2 got = make_uint2(__shfl_xor_sync(0xFFFFFFFFu, give.x, 4), __shfl_xor_sync(0xFFFFFFFFu, give.y, 4));
        first = odd ? got : own;
        second = odd ? own : got;
    }
    // 8 bits: lane (g, t)'s half of block cb, drawn alone (a call's odd last block: one draw per 8 elements there)
    template <bool TRANSPOSED, bool OPAQUE>
    FRT_DEVICE uint2 lone_half(u32 rb, u32 cb, u32 g, u32 t) const {
        uint2 own, give;
        halves<TRANSPOSED>(block_draw<TRANSPOSED, OPAQUE>(rb, cb, g, t), g & 1, own, give);
        return own;
    }
    // 8 bits: a half's 8 elements as bits (bits' order: 4 v + 2 hh + e in a block, byte i of the half; TRANSPOSED:
    // byte 2 hh + v of word e). WORDWISE: compared 4 at a time, a byte in a 16-bit lane plus 0x8000 - keep setting
    // the lane's top bit where it is >= keep (even: bytes 0 and 2, odd: 1 and 3), one byte_perm gathering 4 of those
    // top bits in bit order, which a multiply packs (wgmma backward: fwd+bwd 2-10% less time than one byte at a time,
    // H200, docs/perf-notes.md: Dropout; it spilled the mma.sync fused kernel at head_dim 256 4 bytes).
    template <bool TRANSPOSED, bool WORDWISE>
    FRT_DEVICE u32 eight(uint2 h) const {
        if constexpr (!WORDWISE) {
            u32 out = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                out |= (TRANSPOSED ? byte_dropped((i & 1) ? h.y : h.x, 2 * ((i >> 1) & 1) + (i >> 2))
                                   : byte_dropped(i < 4 ? h.x : h.y, i & 3)) << i;
            return out;
        }
        const u32 bias = (0x8000u - keep) * 0x00010001u;  // (made here: a member's register spilled the dK/dV kernels)
        const u32 ex = (h.x & 0x00FF00FFu) + bias, ox = __byte_perm(h.x, 0, 0x4341) + bias;
        const u32 ey = (h.y & 0x00FF00FFu) + bias, oy = __byte_perm(h.y, 0, 0x4341) + bias;
        const u32 lo = TRANSPOSED ? __byte_perm(ex, ey, 0x7351) : __byte_perm(ex, ox, 0x7351);
        const u32 hi = TRANSPOSED ? __byte_perm(ox, oy, 0x7351) : __byte_perm(ey, oy, 0x7351);
        return top_bits(lo) | top_bits(hi) << 4;
    }
    // bit i: byte i's top bit (the products of bits 7, 15, 23, 31 by 2^21, 2^14, 2^7, 1 land on 28-31, no carries)
    FRT_DEVICE static u32 top_bits(u32 x) { return ((x & 0x80808080u) * 0x00204081u) >> 28; }

    // A transposed fragment's 8 elements of column block qb (keys 16 kb + g + 8 hh, queries 16 qb + 8 v + 2 t + e): bit
    // 4 v + 2 hh + e. They lie in two draws, (query g 2 t + e, key t g / 2) for e = 0, 1, 4 elements in each: each lane
    // makes the draw of its own (g, t) and the warp passes the halves on by shuffles (4 a lane) instead of every lane
    // making two. The two lanes that read a draw want opposite halves of its words (half g & 1 of the reader), so in
    // round one the even-g readers take their e = 0 draw and the odd ones their e = 1 draw, and a lane offers the
    // halves its reader in that round wants (its own g even: the low ones); round two the other way.
    FRT_DEVICE u32 transposed_eight(u32 kb, u32 qb, u32 g, u32 t) const {
        const uint4 r = draw<true>(32 * kb + 4 * g + t, qb);
        // halves (h0 | h1 << 16) and (h2 | h3 << 16) of words 0..3, low or high
        const u32 lo01 = __byte_perm(r.x, r.y, 0x5410), lo23 = __byte_perm(r.z, r.w, 0x5410);
        const u32 hi01 = __byte_perm(r.x, r.y, 0x7632), hi23 = __byte_perm(r.z, r.w, 0x7632);
        const bool odd = g & 1;
        const int first = 4 * (2 * t + odd) + (g >> 1), second = 4 * (2 * t + !odd) + (g >> 1);
        const u32 a01 = __shfl_sync(0xFFFFFFFFu, odd ? hi01 : lo01, first);
        const u32 a23 = __shfl_sync(0xFFFFFFFFu, odd ? hi23 : lo23, first);
        const u32 b01 = __shfl_sync(0xFFFFFFFFu, odd ? lo01 : hi01, second);
        const u32 b23 = __shfl_sync(0xFFFFFFFFu, odd ? lo23 : hi23, second);
        // draw e's halves for (v, hh): word 2 v + hh's, from round one for e = g & 1
        const u32 e0[2] = {odd ? b01 : a01, odd ? b23 : a23}, e1[2] = {odd ? a01 : b01, odd ? a23 : b23};
        u32 eight = 0;
#pragma unroll
        for (int v = 0; v < 2; ++v)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                eight |= dropped(e0[v], hh) << (4 * v + 2 * hh) | dropped(e1[v], hh) << (4 * v + 2 * hh + 1);
        return eight;
    }
};

// dP (or dP^T) of a thread's fragment in the probabilities before dropout: 0 where `dropped` (Dropout::bits) has element
// i's bit, the kept ones times the scale.
template <int N, class Bits>
FRT_DEVICE void kept_dp(float (&dp)[N], Bits dropped, float scale) {
#pragma unroll
    for (int i = 0; i < N; ++i) dp[i] = (dropped >> i & 1) ? 0.f : dp[i] * scale;
}

}  // namespace frt
