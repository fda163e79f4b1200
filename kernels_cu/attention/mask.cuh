// Which keys each query sees: per-sequence lengths (padding, packed varlen), causal
// (bottom-right or top-left aligned), sliding window, block ids, segment ids, and a
// user's mask_mod expression.
// flashrt/reference.py: visible() is the specification this file implements.
//
// Mask features are compile-time bits (FRT_MASK, flashrt/params.py: MASK_BITS), so the
// plain kernels carry none of this code; their run-time parameters are fields of
// FwdParams / BwdParams. Every kernel classifies tiles from cheap bounds, without a
// tile map: a query tile sees a contiguous span of keys and a key tile is seen by a
// contiguous span of queries (block ids and segment ids are non-decreasing within a
// sequence: flashrt/api.py validates them), tiles outside the span are never loaded,
// and the element predicate runs only on tiles that are not entirely visible. With id
// arrays, each row's visible positions are one interval, found once per block
// (TileIntervals), so the element predicate is two compares instead of two id reads.
//
// A mask_mod expression (MASK_MOD) can hide any pair, so the bounds above no longer
// describe which tiles hold visible pairs: mask_classify.cu evaluates every pair once
// per call and lists, for each tile, the tiles of the other axis to visit (ModLists);
// the attention kernels walk those lists instead of the spans.
#pragma once
#include "common/common.cuh"
#include "flashrt_tables.cuh"  // MASK_*, FRT_MASK_* (generated from flashrt/params.py)

#ifndef FRT_MASK
#define FRT_MASK 0
#endif

#if FRT_MASK & FRT_MASK_MOD
// The user's expression over the batch entry, query head, query and key positions in the
// sequence, the sequence's lengths and up to four int32 tensors; flashrt/spec.py writes its
// definition after the kernel source, at global scope, so that the expression sees the same
// names (its own, CUDA's built-ins, the FRT_ macros) in every kernel, none of namespace frt.
FRT_DEVICE bool flashrt_mask_mod(int b, int h, int q, int k, int Lq, int Lk, const int* t0, const int* t1,
                                 const int* t2, const int* t3);
#endif

namespace frt {

// How many elements of the non-decreasing a[0, n) are below x (< x when STRICT, else <= x).
// The group's nthreads threads (common.cuh: WholeBlock, NamedGroup) search together: each round
// every thread tests one probe, so a round shrinks the interval nthreads-fold (3 rounds of loads
// for n = 128k, 128 threads). Every thread of the group must call it with the same arguments.
template <bool STRICT, class Group>
FRT_DEVICE int block_rank(const int* a, int n, int x, int tid, int nthreads, Group group) {
    int lo = 0, hi = n;  // a[0, lo) are below, a[hi] (if hi < n) is not; the answer is in [lo, hi]
    while (lo < hi) {
        const int step = ceil_div(hi - lo, nthreads);
        const int probes = ceil_div(hi - lo, step);
        const int pos = min(lo + (tid + 1) * step - 1, hi - 1);
        const bool below = tid < probes && (STRICT ? a[pos] < x : a[pos] <= x);
        const int c = group.count(below);  // monotone: the probes below are a prefix
        if (c == probes) {
            lo = hi;
        } else {
            const int first_not_below = min(lo + (c + 1) * step - 1, hi - 1);
            lo += c * step;
            hi = first_not_below;
        }
    }
    return lo;
}

// The first index in [lo, hi) of the non-decreasing a[] whose value is >= x (STRICT: > x), or hi.
// One thread's binary search.
template <bool STRICT>
FRT_DEVICE int first_at_least(const int* a, int lo, int hi, int x) {
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (STRICT ? a[mid] > x : a[mid] >= x)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

// mask_mod's inputs besides the positions: its tensors and the batch entry.
template <bool MOD>
struct ModFields {
    const int* t[4];
    int b;
};
template <>
struct ModFields<false> {};

// The visibility rules of one sequence (batch entry b).
template <bool CAUSAL, int MASK>
struct Visibility {
    static constexpr bool LENGTHS = MASK & MASK_LENGTHS, WINDOW = MASK & MASK_WINDOW;
    static constexpr bool BLOCK_IDS = MASK & MASK_BLOCK_IDS, SEGMENTS = MASK & MASK_SEGMENTS;
    static constexpr bool MOD = MASK & MASK_MOD;
    int Lq, Lk;          // queries and keys that take part
    int Eq, Ek;          // rows stored in memory (padding: the tensor's extent; varlen: Lq, Lk)
    i64 q_row0, k_row0;  // the sequence's first row on the seq axis (0 unless varlen)
    int shift;           // query i's diagonal key is i + shift
    int wl, wr;          // window (left, right); -1 = unbounded
    const int *bq, *bk, *sq, *sk;  // this sequence's block / segment ids
    // Last, and empty without mask_mod: the fields above keep the offsets they had before it
    // existed (moving them cost the forward at head_dim 256 a spill).
    ModFields<MOD> mod;

    template <class P>
    FRT_DEVICE void init(const P& p, int b) {
        if constexpr (MOD) {
            mod.b = b;
            mod.t[0] = p.mod_t0, mod.t[1] = p.mod_t1, mod.t[2] = p.mod_t2, mod.t[3] = p.mod_t3;
        }
        Eq = Lq = p.Sq, Ek = Lk = p.Sk;
        q_row0 = k_row0 = 0;
        if constexpr (LENGTHS) {
            if (p.cu_q) {  // packed varlen: the tensors are (total, H, D), batch stride 0; offsets clamped into
                           // them, so that no value of cu_seqlens reaches outside (mask_check.cu reports it)
                const int q0 = max(0, min(p.cu_q[b], p.total_q)), k0 = max(0, min(p.cu_k[b], p.total_k));
                q_row0 = q0, Eq = Lq = max(0, min(min(p.cu_q[b + 1], p.total_q) - q0, p.Sq));
                k_row0 = k0, Ek = Lk = max(0, min(min(p.cu_k[b + 1], p.total_k) - k0, p.Sk));
            } else {  // padding: lengths clamped to the extent, so a bad length cannot fault
                if (p.seqlens_q) Lq = max(0, min(p.seqlens_q[b], p.Sq));
                if (p.seqlens_k) Lk = max(0, min(p.seqlens_k[b], p.Sk));
            }
        }
        shift = p.top_left ? 0 : Lk - Lq;
        wl = WINDOW ? p.win_left : -1, wr = WINDOW ? p.win_right : -1;
        // ids are (B, S) contiguous, or packed (total,) when varlen
        const i64 iq = LENGTHS && p.cu_q ? q_row0 : (i64)b * p.Sq, ik = LENGTHS && p.cu_q ? k_row0 : (i64)b * p.Sk;
        bq = BLOCK_IDS ? p.block_q + iq : nullptr, bk = BLOCK_IDS ? p.block_k + ik : nullptr;
        sq = SEGMENTS ? p.seg_q + iq : nullptr, sk = SEGMENTS ? p.seg_k + ik : nullptr;
    }

    // Whether query i (of query head h) sees key j: the specification, as mask_classify.cu
    // evaluates it (the attention kernels test QueryTile / KeyTile's intervals when there are id
    // arrays). Without id arrays, the tests are combined with non-short-circuit & : as early
    // returns they made the masked tiles' loops a branch per element (fwd_sm90 with a window: 288
    // branches against 27 with the same mask as a mask_mod, and 1.6x its time). With them, early
    // returns guard the reads. mask_mod is evaluated last (mod_visible).
    FRT_DEVICE bool visible(int i, int j, int h) const {
        if constexpr (!(BLOCK_IDS || SEGMENTS)) return (i < Lq) & (j < Lk) & visible_inside(i, j, h, true);
        if (i >= Lq || j >= Lk) return false;
        const int d = j - i - shift;
        if (CAUSAL && d > 0) return false;
        if (WINDOW && ((wl >= 0 && d < -wl) || (wr >= 0 && d > wr))) return false;
        if (BLOCK_IDS && bk[j] > bq[i]) return false;
        if (SEGMENTS && sk[j] != sq[i]) return false;
        return mod_visible(i, j, h);
    }

    // visible(), without id arrays, for a pair inside the sequence (i < Lq, j < Lk: unchecked); clamp:
    // mask_mod's positions clamped all the same (visible() passes it: its pairs may lie outside).
    FRT_DEVICE bool visible_inside(int i, int j, int h, bool clamp = false) const {
        static_assert(!(BLOCK_IDS || SEGMENTS), "visible_inside: no id arrays");
        const int d = j - i - shift;  // the key's offset from the query's diagonal
        bool ok = true;
        if (CAUSAL) ok &= d <= 0;
        if (WINDOW) ok &= ((wl < 0) | (d >= -wl)) & ((wr < 0) | (d <= wr));
        return ok & mod_visible(i, j, h, clamp);
    }

    // Every built-in rule hides all but an interval of keys from a query and all but an interval
    // of queries from a key (ids are non-decreasing: block ids show a prefix of the keys and a
    // suffix of the queries, segment ids a run). keys_of(i) is query i's [lo, hi), queries_of(j)
    // key j's, each found inside a span [lo, hi) that holds it (key_span / query_span of a tile
    // that holds i / j): the id searches stay inside the span and are skipped when the id is that
    // of the span's ends. mask_mod is not part of them (mod_visible).
    FRT_DEVICE int2 keys_of(int i, int lo, int hi) const {
        if (i >= Lq) return make_int2(0, 0);
        const int c = i + shift;  // query i's diagonal key
        if (CAUSAL) hi = min(hi, c + 1);
        if (WINDOW && wr >= 0) hi = min(hi, c + wr + 1);
        if (WINDOW && wl >= 0) lo = max(lo, c - wl);
        if (BLOCK_IDS && lo < hi && bk[hi - 1] > bq[i]) hi = first_at_least<true>(bk, lo, hi, bq[i]);
        if (SEGMENTS) {
            if (lo < hi && sk[lo] < sq[i]) lo = first_at_least<false>(sk, lo, hi, sq[i]);
            if (lo < hi && sk[hi - 1] > sq[i]) hi = first_at_least<true>(sk, lo, hi, sq[i]);
        }
        return make_int2(lo, max(lo, hi));
    }
    FRT_DEVICE int2 queries_of(int j, int lo, int hi) const {
        if (j >= Lk) return make_int2(0, 0);
        const int c = j - shift;  // the query whose diagonal is key j
        if (CAUSAL) lo = max(lo, c);
        if (WINDOW && wr >= 0) lo = max(lo, c - wr);
        if (WINDOW && wl >= 0) hi = min(hi, c + wl + 1);
        if (BLOCK_IDS && lo < hi && bq[lo] < bk[j]) lo = first_at_least<false>(bq, lo, hi, bk[j]);
        if (SEGMENTS) {
            if (lo < hi && sq[lo] < sk[j]) lo = first_at_least<false>(sq, lo, hi, sk[j]);
            if (lo < hi && sq[hi - 1] > sk[j]) hi = first_at_least<true>(sq, lo, hi, sk[j]);
        }
        return make_int2(lo, max(lo, hi));
    }

    // mask_mod's verdict on pair (i, j) (true without mask_mod), for the caller to and with the
    // other rules' with & : the expression runs on every pair, its positions clamped into the
    // sequence (Lq, Lk >= 1 wherever a tile holds a visible pair), so that no branch guards its
    // reads. Guarded (&&), each masked element's reads waited for the previous element's: a
    // documents mask read through a tensor cost ~9 us per masked 128 x 128 tile (docs/perf-notes.md: mask_mod element mask).
    // (clamp = false: the caller knows the pair is inside.)
    FRT_DEVICE bool mod_visible(int i, int j, int h, bool clamp = true) const {
#if FRT_MASK & FRT_MASK_MOD
        if constexpr (MOD) {
            if (clamp) i = max(0, min(i, Lq - 1)), j = max(0, min(j, Lk - 1));
            return flashrt_mask_mod(mod.b, h, i, j, Lq, Lk, mod.t[0], mod.t[1], mod.t[2], mod.t[3]);
        }
#endif
        return true;
    }

    // Every (query, key) pair of rows [m0, m0 + bm) x keys [n0, n0 + bn) is visible. Lengths, causal
    // and window only: with id arrays TileIntervals::covers answers, with mask_mod the tile lists.
    FRT_DEVICE bool all_visible(int m0, int bm, int n0, int bn) const {
        static_assert(!(BLOCK_IDS || SEGMENTS || MOD), "ids: TileIntervals::covers; mask_mod: ModLists");
        const int m1 = m0 + bm - 1, n1 = n0 + bn - 1;
        if (m1 >= Lq || n1 >= Lk) return false;
        const int d_max = n1 - m0 - shift, d_min = n0 - m1 - shift;
        if (CAUSAL && d_max > 0) return false;
        if (WINDOW && ((wl >= 0 && d_min < -wl) || (wr >= 0 && d_max > wr))) return false;
        return true;
    }

    // Keys [lo, hi) outside of which no query of rows [m0, m0 + bm) sees anything (mask_mod
    // aside: it can only narrow the span). A call of the whole group (block_rank).
    template <class Group = WholeBlock>
    FRT_DEVICE void key_span(int m0, int bm, int& lo, int& hi, int tid, int nthreads, Group group = Group()) const {
        lo = 0, hi = Lk;
        const int m1 = min(m0 + bm, Lq) - 1;
        if (m1 < m0) { hi = 0; return; }
        if (CAUSAL) hi = min(hi, m1 + shift + 1);
        if (WINDOW && wr >= 0) hi = min(hi, m1 + shift + wr + 1);
        if (WINDOW && wl >= 0) lo = max(lo, m0 + shift - wl);
        if (BLOCK_IDS) hi = min(hi, block_rank<false>(bk, Lk, bq[m1], tid, nthreads, group));
        if (SEGMENTS) {
            lo = max(lo, block_rank<true>(sk, Lk, sq[m0], tid, nthreads, group));
            hi = min(hi, block_rank<false>(sk, Lk, sq[m1], tid, nthreads, group));
        }
        hi = max(hi, lo);
    }

    // Queries [lo, hi) outside of which no query sees a key of [n0, n0 + bn).
    // Both ends are non-decreasing in n0 (the ordered fused dQ relies on it). Whole-block call.
    FRT_DEVICE void query_span(int n0, int bn, int& lo, int& hi, int tid, int nthreads) const {
        lo = 0, hi = Lq;
        const int n1 = min(n0 + bn, Lk) - 1;
        if (n1 < n0) { hi = 0; return; }
        if (CAUSAL) lo = max(lo, n0 - shift);
        if (WINDOW && wr >= 0) lo = max(lo, n0 - shift - wr);
        if (WINDOW && wl >= 0) hi = min(hi, n1 - shift + wl + 1);
        if (BLOCK_IDS) lo = max(lo, block_rank<true>(bq, Lq, bk[n0], tid, nthreads, WholeBlock()));
        if (SEGMENTS) {
            lo = max(lo, block_rank<true>(sq, Lq, sk[n0], tid, nthreads, WholeBlock()));
            hi = min(hi, block_rank<false>(sq, Lq, sk[n1], tid, nthreads, WholeBlock()));
        }
        hi = max(hi, lo);
    }

    // The first key tile (of bn keys) whose query_span reaches query tile m (of bm rows):
    // with query_span's ends non-decreasing, the key tiles that visit m are this one and
    // the ones after it, up to the last whose span starts at or before m's rows.
    FRT_DEVICE int first_key_tile_of(int m, int bm, int bn) const {
        if (!(WINDOW && wl >= 0)) return 0;
        // query_span's hi > m * bm  <=>  n1 - shift + wl + 1 > m * bm  <=>  n1 >= m * bm + shift - wl
        const int need = m * bm + shift - wl;  // the smallest n1 that reaches
        return need <= 0 ? 0 : max(0, ceil_div(need - (bn - 1), bn));
    }
};

// Each of a tile's N rows' interval of visible positions on the other axis (QueryTile: a query's
// keys, Visibility::keys_of; KeyTile: a key's queries, queries_of), and their intersection: the
// positions that every row of the tile sees, so a tile of the other axis inside it needs no
// element mask. In shared memory; `of(r)` gives row r's interval; span: the [lo, hi) they were found in
// (key_span / query_span). A call of the whole group (fill_tile_intervals: `group`; tile_intervals: the
// block).
template <int N>
struct TileIntervals {
    int2 row[N];
    int2 all, span;
    FRT_DEVICE bool covers(int lo, int n) const { return all.x <= lo && lo + n <= all.y; }
    FRT_DEVICE bool holds(int r, int x) const { return (x >= row[r].x) & (x < row[r].y); }  // row r sees x
};

template <int N, class Of, class Group>
FRT_DEVICE void fill_tile_intervals(TileIntervals<N>& iv, int lo, int hi, Of of, int tid, int nthreads, Group group) {
    if (tid == 0) iv.all = make_int2(0, 0x7fffffff), iv.span = make_int2(lo, hi);  // intervals start at >= 0
    group.sync();
    for (int r = tid; r < N; r += nthreads) {
        const int2 x = of(r);
        iv.row[r] = x;
        atomicMax(&iv.all.x, x.x);
        atomicMin(&iv.all.y, x.y);
    }
    group.sync();
}

template <int N, class Of>
FRT_DEVICE const TileIntervals<N>& tile_intervals(int lo, int hi, Of of, int tid, int nthreads) {
    __shared__ TileIntervals<N> iv;
    fill_tile_intervals(iv, lo, hi, of, tid, nthreads, WholeBlock());
    return iv;
}

// The block's Visibility for batch entry b. With mask features it lives in shared memory:
// the kernels read it where they need it, so its fields do not hold registers that the
// accumulators need (kept in registers, they made the D >= 128 masked variants spill).
// Without them (MASK == 0) it is a value made of run-time constants (Sq, Sk), which the
// compiler folds into the index arithmetic as before masks existed (the shared copy cost
// the dense kernels 5-12%). Whole-block call.
template <bool CAUSAL, int MASK>
struct VisibilityOf {
    using type = const Visibility<CAUSAL, MASK>&;
};
template <bool CAUSAL>
struct VisibilityOf<CAUSAL, 0> {
    using type = Visibility<CAUSAL, 0>;
};

template <bool CAUSAL, int MASK, class P>
FRT_DEVICE typename VisibilityOf<CAUSAL, MASK>::type block_visibility(const P& p, int b) {
    if constexpr (MASK == 0) {
        Visibility<CAUSAL, 0> vis;
        vis.init(p, b);
        return vis;
    } else {
        __shared__ Visibility<CAUSAL, MASK> vis;
        if (threadIdx.x == 0) vis.init(p, b);
        __syncthreads();
        return vis;
    }
}

// The visibility a QueryTile holds: the block's shared copy (block_visibility), or with OWN a copy of
// each thread's own, for a kernel whose warpgroups reach a tile at different times (fwd_sm90_ws; with id
// arrays its producer warpgroup searches each tile's keys for the consumers: QueryTile).
template <bool CAUSAL, int MASK, bool OWN>
struct TileVisibility {
    using type = typename VisibilityOf<CAUSAL, MASK>::type;
};
template <bool CAUSAL, int MASK>
struct TileVisibility<CAUSAL, MASK, true> {
    using type = Visibility<CAUSAL, MASK>;
};

template <bool CAUSAL, int MASK, bool OWN, class P>
FRT_DEVICE typename TileVisibility<CAUSAL, MASK, OWN>::type tile_visibility(const P& p, int b) {
    if constexpr (OWN) {
        Visibility<CAUSAL, MASK> vis;
        vis.init(p, b);
        return vis;
    } else {
        return block_visibility<CAUSAL, MASK>(p, b);
    }
}

// mask_mod's tile lists (mask_classify.cu), one per tile of the outer axis: the tiles of the
// inner axis that hold a visible pair, last to first; entry j when every pair of the two
// tiles is visible, ~j when the element mask must run. Lists exist per batch entry and per
// query head only where the mask differs along that axis (mod_batches, mod_heads are 1 or B, H).
// Rows: outer = query tiles (BM), inner = key tiles (BN); cols: the other way round.
struct ModLists {
    const int* list;   // [mod_batches][mod_heads][n_outer][n_inner]
    const int* count;  // [mod_batches][mod_heads][n_outer]
    int n_outer, n_inner;

    template <class P>
    FRT_DEVICE static ModLists rows(const P& p, int bm, int bn) {
        return {p.mod_rows, p.mod_rows_count, ceil_div(p.Sq, bm), ceil_div(p.Sk, bn)};
    }
    template <class P>
    FRT_DEVICE static ModLists cols(const P& p, int bm, int bn) {
        return {p.mod_cols, p.mod_cols_count, ceil_div(p.Sk, bn), ceil_div(p.Sq, bm)};
    }
    template <class P>
    FRT_DEVICE i64 index(const P& p, int b, int h, int outer) const {
        return ((i64)(p.mod_batches > 1 ? b : 0) * p.mod_heads + (p.mod_heads > 1 ? h : 0)) * n_outer + outer;
    }
    FRT_DEVICE static int tile(int entry) { return entry < 0 ? ~entry : entry; }
};

// ---------------------------------------------------------------------------------------
// The element mask on accumulator fragments, one definition for every kernel family.
//
// mma.sync m16n8k16 and each warp of a wgmma m64nNk16 share one accumulator layout: with g = lane / 4 and
// t = lane % 4, a thread's element c (0-3) of n-group jj of m-tile mt lies at
//     row  row0 + 16 mt + 8 (c >> 1),     column  col0 + 8 jj + (c & 1),
// where row0 holds the thread's first row (the warp's + g) and col0 its first column (the tile's + 2 t).
// A forward or dQ tile holds S (rows: queries, columns: keys); a dK / dV tile holds S^T (TRANSPOSED: rows are
// keys, columns queries). Each kernel picks its test `visible(query, key)` (QueryTile::visible, an interval
// compare, Visibility::visible_inside, ...); these apply it, unrolled, so that a mask_mod's reads are in flight
// together.
struct Fragments {
    int row0, col0;
    FRT_DEVICE int row(int mt, int c) const { return row0 + 16 * mt + 8 * (c >> 1); }
    FRT_DEVICE int col(int jj, int c) const { return col0 + 8 * jj + (c & 1); }
    // Whether element (mt, jj, c) is a visible pair.
    template <bool TRANSPOSED, class Visible>
    FRT_DEVICE bool visible(int mt, int jj, int c, const Visible& test) const {
        return TRANSPOSED ? test(col(jj, c), row(mt, c)) : test(row(mt, c), col(jj, c));
    }
};

// The element test of the rules whose visible pairs are one interval per row (QueryTile / KeyTile::INTERVALS): a
// row sees the columns [lo, hi) of `iv`, kept relative to the thread's first column (tile + lane: the tile's first
// column and the lane's offset 2 t from it), so that each element is two compares against offsets known at compile
// time: column tile + lane + x is visible where visible<LO>(x) (LO: the interval may start after the tile's first
// column, else the lower compare is left out). The forward, the wgmma dQ and the wgmma dK / dV kernels (transposed:
// rows are keys, intervals of queries) test their interval rules with it.
struct RowInterval {
    int lo, hi;
    RowInterval() = default;
    FRT_DEVICE RowInterval(int2 iv, int tile, int lane) : lo(iv.x - tile - lane), hi(iv.y - tile - lane) {}
    template <bool LO = true>
    FRT_DEVICE bool visible(int x) const { return !((LO && x < lo) | (x >= hi)); }
};

// Elements x(mt, jj, c) (a float&) of MT m-tiles by N8 n-groups whose pair is hidden become `hidden` (-inf
// before the softmax, 0 for P).
template <int MT, int N8, bool TRANSPOSED = false, class Elem, class Visible>
FRT_DEVICE void mask_fragments(Fragments at, float hidden, const Elem& x, const Visible& test) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int jj = 0; jj < N8; ++jj)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (!at.visible<TRANSPOSED>(mt, jj, c, test)) x(mt, jj, c) = hidden;
}

// A word of N bits (N <= 64): u32 up to 32, else u64.
template <int N, bool LONG = (N > 32)>
struct BitsOf {
    using type = u32;
};
template <int N>
struct BitsOf<N, true> {
    static_assert(N <= 64, "at most 64 bits");
    using type = u64;
};

// One bit per element of one m-tile's N8 n-groups (bit 4 jj + c) whose pair is hidden: a mask made before the
// accumulators it applies to are live (the sm90 backward's kernels), N8 <= 16 (N8 = 16: a u64).
template <int N8, bool TRANSPOSED = false, class Visible>
FRT_DEVICE typename BitsOf<4 * N8>::type hidden_bits_of(Fragments at, const Visible& test) {
    using Bits = typename BitsOf<4 * N8>::type;
    Bits hidden = 0;
#pragma unroll
    for (int i = 0; i < 4 * N8; ++i)
        if (!at.visible<TRANSPOSED>(0, i >> 2, i & 3, test)) hidden |= Bits(1) << i;
    return hidden;
}

}  // namespace frt
