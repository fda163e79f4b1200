// Kernel argument structs, passed by value. flashrt/params.py mirrors each field
// in order: every compiled variant static_asserts the struct size against it,
// and a CPU test compares the field lists, so the two sides cannot drift apart.
//
// Tensors are (batch, seq, heads, head_dim) with arbitrary strides in elements
// for the first three axes and a contiguous last axis (packed varlen: batch
// stride 0, each sequence's rows start at cu_q[b] / cu_k[b]). lse/lse2/delta
// are contiguous fp32 (batch, heads, seq_q), or (heads, total_q) when varlen.
#pragma once
#include "attention/mask.cuh"

// The columns of q / k and of v (out, dout, dv) an mma.sync kernel loads and stores (common.cuh: load_tile): both its
// head_dim unless compiled for a v of a head_dim of its own (spec.KernelSpec.head_dims), the larger being FRT_HEAD_DIM.
#ifndef FRT_QK_DIM
#define FRT_QK_DIM FRT_HEAD_DIM
#endif
#ifndef FRT_V_DIM
#define FRT_V_DIM FRT_HEAD_DIM
#endif
// The mma.sync kernels' tiles swizzled (RowTraits; spec.KernelSpec.swizzled sets it for spec.SWIZZLED_FAMILIES).
#ifndef FRT_SWIZZLE
#define FRT_SWIZZLE 0
#endif

namespace frt {

// A CUtensorMap (cuTensorMapEncodeTiled), encoded by the host for each call (flashrt/tma.py).
struct alignas(64) TmaMap {
    unsigned char bytes[128];
};

struct FwdParams {
    // fwd_sm90_ws: q, k and v as TMA maps (wgmma.cuh: load_tile_tma), first so that they sit 64-byte
    // aligned without padding; zero (unused) for the other forwards.
    TmaMap q_map, k_map, v_map;
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;
    // Masks (kernels_cu/attention/mask.cuh); null / 0 when unused. (B,) lengths, (B+1,) varlen
    // offsets, (B, S) or packed (total,) non-decreasing ids.
    const int* seqlens_q;
    const int* seqlens_k;
    const int* cu_q;
    const int* cu_k;
    const int* block_q;
    const int* block_k;
    const int* seg_q;
    const int* seg_k;
    i64 q_sb, q_ss, q_sh;
    i64 k_sb, k_ss, k_sh;
    i64 v_sb, v_ss, v_sh;
    i64 o_sb, o_ss, o_sh;
    i64 st_sb, st_sh;  // lse of (b, h, row): b * st_sb + h * st_sh + row
    int B, H, Hkv, Sq, Sk;  // Sq, Sk: the longest sequences when varlen
    int win_left, win_right, top_left;
    int total_q, total_k;  // varlen: rows of the packed q and k (mask.cuh clamps cu_q / cu_k to them)
    float scale_log2;  // softmax_scale * log2(e)
    // mask_mod (MASK_MOD), last so that the other fields keep their offsets: the tile map and
    // lists written by mask_classify.cu (ModLists in mask.cuh), the int32 tensors the expression reads, and the
    // lists' extents: 1, or H / B when the mask differs per head / batch entry.
    u8* mod_map;  // mask_classify.cu's per-tile bytes, from which the lists are made
    int* mod_rows;
    int* mod_rows_count;
    int* mod_cols;
    int* mod_cols_count;
    const int* mod_t0;
    const int* mod_t1;
    const int* mod_t2;
    const int* mod_t3;
    int mod_heads, mod_batches;
    int sched_pairs;  // fwd_sm90, fwd_sm90_ws: (batch entry, head) pairs per chunk of work items (work_item)
    int* sched;       // fwd_sm90_ws: work items claimed so far beyond the first wave (0 at the start and the end)
    int use_tma;      // fwd_sm90_ws: 1 when the maps are set (0: FLASHRT_NO_TMA, every tile by cp.async)
    const float* sinks;  // (H,) fp32 attention-sink logits (softmax.cuh: add_sink), or null
    float softcap;       // FRT_SOFTCAP: the cap in raw-score units, c / softmax_scale (score_mod.cuh: Softcap)
    const float* alibi;  // FRT_ALIBI: slopes, alibi[b * alibi_bstride + h] (score_mod.cuh: Alibi)
    int alibi_bstride;   // H for (B, H) slopes, 0 for (H,)
    // FRT_SCORE_MOD: the tensors a score_mod expression reads (score_mod.cuh: ScoreMod), null when unused
    const void* score_t0;
    const void* score_t1;
    const void* score_t2;
    const void* score_t3;
    // FRT_DROPOUT (dropout.cuh): the call's seed and offset (2 int64 in device memory), the keep threshold of an
    // element's FRT_DROPOUT bits and the kept probabilities' scale (2^bits / threshold)
    const u64* drop_rng;
    int drop_keep;
    float drop_scale;
    // The tensors' head_dims, q's and k's and v's (and o's), each the kernel's D or less: D is the larger, or the wgmma
    // instance above it (tiles.sm90_head_dim). A tile's columns from its tensor's head_dim on are zeros in shared
    // memory (wgmma.cuh: load_tile_sw128, the TMA maps' bounds) and are not stored. (The mma.sync kernels take them
    // at compile time: FRT_QK_DIM, FRT_V_DIM.)
    int head_dim, head_dim_v;
};

struct BwdParams {
    // bwd_fused_sm90's warp-specialised form: q, dout, k and v as TMA maps (wgmma.cuh: load_tile_tma), first as in
    // FwdParams; zero (unused) for the other kernels.
    TmaMap q_map, do_map, k_map, v_map;
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* o;
    const u16* dout;
    const float* lse;  // natural-log LSE from the forward pass
    float* lse2;       // scratch: lse * log2(e); +inf for rows that saw no key (bwd_preprocess or bwd_dq_sm90)
    float* delta;      // scratch: rowsum(dout * o) (the same)
    u16* dq;
    u16* dk;
    u16* dv;
    float* dkv_partial;  // splits > 1: fp32 (2, splits, B, Hkv, Sk, D) dK then dV partials
    float* dq_accum;     // fused backward: fp32 (B, H, Sq, D) unscaled dQ, zeroed by bwd_preprocess (dq_swizzle; or not: dq_first_store)
    int* dq_sem;         // fused + deterministic: (B, H, ceil(Sq/BM)) key tiles added so far, zeroed
    int splits;          // blocks that share one key tile's (query head, query tile) pairs
    int sched_pairs;     // causal bwd_dq: (batch entry, head) pairs per chunk of blocks (query_block); 0: none
    int sched_key_pairs; // causal key-parallel kernels: (batch entry, grid row) pairs per chunk (key_block); 0: none
    int dq_swizzle;      // bwd_fused_sm90: dq_accum rows hold their 16-byte chunks permuted (bwd_sm90.cuh: stage_dq)
    int use_tma;         // the maps are set (0: FLASHRT_NO_TMA or another kernel; every tile by cp.async)
    int dq_rotate;       // ordered wgmma fused, not causal: query tiles rotated per key tile (KeyTile::rotate_if_asked)
    int dq_first_store;  // ordered wgmma fused, every query row seeing a key: a query tile's first turn stores its dQ
                         // (bwd_preprocess leaves dq_accum unzeroed; api.py: _first_turn_stores)
    // Masks (kernels_cu/attention/mask.cuh); null / 0 when unused. (B,) lengths, (B+1,) varlen
    // offsets, (B, S) or packed (total,) non-decreasing ids.
    const int* seqlens_q;
    const int* seqlens_k;
    const int* cu_q;
    const int* cu_k;
    const int* block_q;
    const int* block_k;
    const int* seg_q;
    const int* seg_k;
    i64 q_sb, q_ss, q_sh;
    i64 k_sb, k_ss, k_sh;
    i64 v_sb, v_ss, v_sh;
    i64 o_sb, o_ss, o_sh;
    i64 do_sb, do_ss, do_sh;
    i64 dq_sb, dq_ss, dq_sh;
    i64 dk_sb, dk_ss, dk_sh;
    i64 dv_sb, dv_ss, dv_sh;
    i64 st_sb, st_sh;  // lse / lse2 / delta of (b, h, row), and dq_accum's row: b * st_sb + h * st_sh + row
    int B, H, Hkv, Sq, Sk;
    int win_left, win_right, top_left;
    int total_q, total_k;
    float scale_log2;
    float scale;
    // mask_mod (MASK_MOD), last so that the other fields keep their offsets: the tile map and
    // lists written by mask_classify.cu (ModLists in mask.cuh), the int32 tensors the expression reads, and the
    // lists' extents: 1, or H / B when the mask differs per head / batch entry.
    u8* mod_map;  // mask_classify.cu's per-tile bytes, from which the lists are made
    int* mod_rows;
    int* mod_rows_count;
    int* mod_cols;
    int* mod_cols_count;
    const int* mod_t0;
    const int* mod_t1;
    const int* mod_t2;
    const int* mod_t3;
    int mod_heads, mod_batches;
    float softcap;  // FRT_SOFTCAP: the cap in raw-score units, c / softmax_scale (score_mod.cuh: Softcap)
    const float* alibi;  // FRT_ALIBI: slopes, alibi[b * alibi_bstride + h] (score_mod.cuh: Alibi)
    int alibi_bstride;   // H for (B, H) slopes, 0 for (H,)
    // FRT_SCORE_MOD: the tensors a score_mod expression reads (score_mod.cuh: ScoreMod), null when unused
    const void* score_t0;
    const void* score_t1;
    const void* score_t2;
    const void* score_t3;
    // FRT_SCORE_TGRAD (bwd_dq.cu): the gradients of the float tensors marked "float_grad" (fp32) or "float_grad_exact"
    // (int64 limbs) (spec.SCORE_TENSOR_TYPES), one per score_t slot (score_mod.cuh: tensor_grad_add); null for others
    float* score_g0;
    float* score_g1;
    float* score_g2;
    float* score_g3;
    i64 score_n0, score_n1, score_n2, score_n3;  // their elements (reads outside add nothing: dual.cuh)
    const u64* drop_rng;  // FRT_DROPOUT: as FwdParams'
    int drop_keep;
    float drop_scale;
    int head_dim, head_dim_v;  // as FwdParams' (dout, out, dv: head_dim_v)
};

// mask_check.cu: a call's mask arrays (the pointers of FwdParams / BwdParams, null when not given), the
// extents they are checked against, and the call's outputs, set to NaN when a check fails.
struct CheckParams {
    const int* seqlens_q;
    const int* seqlens_k;
    const int* cu_q;
    const int* cu_k;
    const int* block_q;
    const int* block_k;
    const int* seg_q;
    const int* seg_k;
    u8* poison0;
    u8* poison1;
    u8* poison2;
    i64 poison_bytes0, poison_bytes1, poison_bytes2;
    int* report;  // host-mapped (flashrt/launch.py: report_words); mask_check.cu: REPORT_*
    int B, Sq, Sk;  // Sq, Sk: the tensors' seqlen extents, or max_seqlen_q / _k when varlen
    int total_q, total_k;  // varlen: rows of the packed q and k
    int call;  // 0 forward, 1 backward (for the message)
};

// decode.cu: queries of a few new tokens against a KV cache, contiguous (B, capacity, Hkv, D) or paged
// (num_pages, page_size, Hkv, D) through page_table (B, max_pages). Strides in elements; *_sb of a paged cache
// steps pages. flashrt/decoding.py checks every shape; the kernel checks the values (cache_seqlens, page ids).
struct DecodeParams {
    const u16* q;
    u16* k_cache;
    u16* v_cache;
    const u16* k_new;  // (B, Sq, Hkv, D) written into the cache at cache_seqlens[b] first; null: none
    const u16* v_new;
    u16* o;            // splits == 1: (B, Sq, H, D)
    float* lse;        // splits == 1: (B, H, Sq)
    float* o_part;     // splits > 1 but no cluster: fp32 (splits, B, Sq, H, D), combined by combine.cu
    float* lse_part;   // splits > 1: (splits, B, H, Sq)
    const int* cache_seqlens;  // (B,): tokens in the cache before this call (null: seqlen)
    const int* page_table;     // (B, max_pages) page ids; null: contiguous
    int* report;               // host-mapped (flashrt/launch.py: report_words): a bad value is reported here
    i64 q_sb, q_ss, q_sh;
    i64 kc_sb, kc_ss, kc_sh;  // v_cache's too
    i64 kn_sb, kn_ss, kn_sh;  // v_new's too
    i64 o_sb, o_ss, o_sh;
    i64 pt_sb;
    int B, H, Hkv, Sq;
    int capacity;   // tokens a sequence can hold: the cache's seqlen axis, or max_pages * page_size
    int seqlen;     // every sequence's cached tokens where cache_seqlens is null (flashrt.forward: Sk)
    int page_size, page_shift, num_pages;  // page_shift: log2(page_size) when a power of two, else -1
    int splits;     // blocks over each sequence's key range (grid x)
    int causal, win_left, win_right;  // bottom-right: query i sits at key position L - Sq + i
    float scale_log2;
    float softcap;       // FRT_SOFTCAP: c / softmax_scale (score_mod.cuh: Softcap), as FwdParams'
    const float* sinks;  // (H,) fp32 sink logits (softmax.cuh: add_sink) or null; joined here when splits == 1, else
                         // by the combine
    const float* alibi;  // FRT_ALIBI: (H,) or (B, H) fp32 slopes, as FwdParams'
    int alibi_bstride;   // 0 for (H,), H for (B, H)
    int cluster;         // 1: the splits are one thread block cluster and merge there (decode.cu: cluster_combine)
};

// combine.cu: partial results of n key ranges, (n, B, Sq, H, D) outputs and (n, B, H, Sq) natural-log lse, all
// contiguous, merged into out (B, Sq, H, D) and lse (B, H, Sq), contiguous.
struct CombineParams {
    const void* o_part;
    const float* lse_part;
    void* o;
    float* lse;
    int n, B, Sq, H, D;
    int row_warps;  // warps that share a row's parts: 1, 2, 4 or 8 (flashrt/decoding.py: _combine_fields)
    const float* sinks;  // (H,) fp32 sink logits joined into every row as a part with lse = sink and no value, or null
};

// ---------------------------------------------------------------------------
// Problem geometry shared by the kernel families.
// ---------------------------------------------------------------------------

// Compile-time shape of an elementwise kernel (bwd_preprocess, bwd_dkdv_reduce):
// grid-stride over rows or 8-element chunks. Block sizes and the mask mode do
// not apply; they are accepted so that every family instantiates through FRT_ENTRY.
template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct ElementwiseTraits {
    static constexpr int D = D_, NW = NW_;
    static constexpr bool BF16 = BF16_;
    static constexpr int MASK = 0;
    static_assert(D % 8 == 0 && D <= 256, "head_dim must be a multiple of 8, at most 256");
    static constexpr int SMEM = 0;
};

// Compile-time shape of a query-parallel kernel (fwd, bwd_dq): NW warps, each
// owning MT*16 of the BM query rows; key tiles of BN rows; head_dim D padded to DP.
template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct RowTraits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_, CAUSAL = CAUSAL_;
    static constexpr int MASK = FRT_MASK;
    static constexpr int DP = round_up(D, 16);
    static constexpr int NTHREADS = NW * 32;
    static constexpr int MT = BM / (16 * NW);
    static_assert(D % 8 == 0 && D <= 256, "head_dim must be a multiple of 8, at most 256");
    static_assert(BM % (16 * NW) == 0, "block_m must be a multiple of 16 * warps");
    static_assert(BN % 16 == 0, "block_n must be a multiple of 16");
    // Q / K / V / dO unpadded and swizzled (common.cuh: chunk_at) where spec.KernelSpec.swizzled says, else padded.
    static constexpr bool SWZ = FRT_SWIZZLE;
    static_assert(!SWZ || DP % 64 == 0, "swizzled rows are a multiple of 128 bytes");
    static constexpr int LD = SWZ ? DP * 2 : Pitch<DP>::bytes;  // shared pitch of Q/K/V/dO tiles
    static constexpr int SMEM_Q = BM * LD;
    static constexpr int SMEM_KV_STAGE = 2 * BN * LD;    // K, then V
};

// The work items of fwd_sm90 (a 1-D grid; block k does item k) and fwd_sm90_ws (claimed in this order):
// item -> (query tile m, head h, batch entry b). The (batch entry, head) pairs come in chunks of
// p.sched_pairs (the launcher sizes a chunk so that its K and V fit in half of L2: the blocks running at
// once share them). Inside a chunk the query tile is the outer loop, heaviest first when causal (the
// blocks that start last are the lightest, and fewer SMs idle behind a long one at the end) in the last
// chunk; in a causal launch's earlier chunks the pair is the outer loop, each pair's tiles heaviest first,
// so that the blocks do not all reach the next chunk's heaviest tiles, and its new K, V and Q in DRAM, at
// once (S=1k causal 1.6% faster: docs/perf-notes.md: Work-item order). (hk: the KV head of h.)
struct WorkItem {
    int m, h, b, hk;
};
template <class P>
FRT_DEVICE WorkItem make_work_item(const P& p, int m, int h, int b) {
    return {m, h, b, h / (p.H / p.Hkv)};
}
// The order itself, for n_t tiles of each of n_pairs pairs in chunks of `chunk` pairs: item -> (t, pair),
// t = 0 the heaviest tile when causal (the caller maps t to its tile).
struct ChunkedItem {
    int t, pair;
};
template <bool CAUSAL>
FRT_DEVICE ChunkedItem chunked_order(int item, int n_t, int n_pairs, int chunk) {
    const int per_chunk = n_t * chunk, c = item / per_chunk;
    const int first = c * chunk, pairs = min(chunk, n_pairs - first);
    const int r = item - c * per_chunk;
    if (CAUSAL && first + pairs < n_pairs) {  // a causal chunk before the last: pair-major
        const int in_chunk = r / n_t;
        return {r - in_chunk * n_t, first + in_chunk};
    }
    const int t = r / pairs;
    return {t, first + r - t * pairs};
}
template <bool CAUSAL, class P>
FRT_DEVICE WorkItem work_item(const P& p, int item, int n_m) {
    const ChunkedItem c = chunked_order<CAUSAL>(item, n_m, p.B * p.H, p.sched_pairs);
    return make_work_item(p, CAUSAL ? n_m - 1 - c.t : c.t, c.pair % p.H, c.pair / p.H);
}

// The blocks of the backward's grids (x: the tile; y, z: the pair), which the hardware starts in the order
// of their linear index: causal, with p.sched_pairs / p.sched_key_pairs set, in chunked_order (the last
// chunk heaviest tile first: fewer SMs idle behind a heavy block at the launch's end); else a pair's tiles
// in a row, heaviest first when causal (and where ORDER is false: the decode's registers spilled the head_dim
// 64 dQ at two blocks per SM, 5% slower; and fwd.cu, 8 bytes of spills with lengths at head_dim 128).
// Grid axis AXIS's block index and extent, AXIS a GRID_* coordinate of flashrt/params.py's GRID_AXES (generated
// into flashrt_tables.cuh), which launch.grid sizes the grid by.
template <int AXIS>
FRT_DEVICE unsigned grid_index() {
    if constexpr (AXIS == 0) return blockIdx.x;
    else if constexpr (AXIS == 1) return blockIdx.y;
    else return blockIdx.z;
}
template <int AXIS>
FRT_DEVICE unsigned grid_extent() {
    if constexpr (AXIS == 0) return gridDim.x;
    else if constexpr (AXIS == 1) return gridDim.y;
    else return gridDim.z;
}
FRT_DEVICE int linear_block() { return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); }
static_assert(GRID_QUERY_TILE == 0 && GRID_KEY_TILE == 0, "the chunked orders take the tile axis as the fastest");
template <bool CAUSAL, bool ORDER, class P>
FRT_DEVICE WorkItem query_block(const P& p) {
    constexpr int TILE = GRID_QUERY_TILE;
    if (CAUSAL && ORDER && p.sched_pairs > 0) return work_item<true>(p, linear_block(), grid_extent<TILE>());
    return make_work_item(p, CAUSAL ? grid_extent<TILE>() - 1 - grid_index<TILE>() : grid_index<TILE>(),
                          grid_index<GRID_QUERY_HEAD>(), grid_index<GRID_QUERY_BATCH>());
}
// (tile, grid row: GRID_KEY_SPLIT_KV_HEAD, batch entry)
template <bool CAUSAL>
FRT_DEVICE int3 key_block(int chunk) {
    if (CAUSAL && chunk > 0) {
        constexpr int ROW = GRID_KEY_SPLIT_KV_HEAD;
        const ChunkedItem c = chunked_order<true>(linear_block(), grid_extent<GRID_KEY_TILE>(),
                                                  grid_extent<ROW>() * grid_extent<GRID_KEY_BATCH>(), chunk);
        return make_int3(c.t, c.pair % grid_extent<ROW>(), c.pair / grid_extent<ROW>());
    }
    return make_int3(grid_index<GRID_KEY_TILE>(), grid_index<GRID_KEY_SPLIT_KV_HEAD>(), grid_index<GRID_KEY_BATCH>());
}
// Key tile t of every (batch entry, grid row) of a chunk of `chunk` of them (0: all) before key tile t + 1 of any
// (chunked_order): the causal ordered fused dQ's order (bwd_fused_sm90_ws.cu), where key tile t waits for t - 1 of
// its row: the blocks running together are few key tiles of many rows, so few wait on each other; the chunk bounds
// how many rows (tiles.ordered_key_chunk: their Q, dO and dQ tiles shared in L2 by the key tiles running together;
// docs/perf-notes.md, Ordered causal grid by pairs). No deadlock: a block waits only for blocks of lower linear index
// of its own chunk, which start first (a chunk holds whole rows: one split). Not causal, a row's key tiles together
// ran 1.02-1.16x faster (docs/perf-notes.md, Ordered grid).
FRT_DEVICE int3 key_block_tile_major(int chunk) {
    constexpr int ROW = GRID_KEY_SPLIT_KV_HEAD;
    const int pairs = grid_extent<ROW>() * grid_extent<GRID_KEY_BATCH>();
    const ChunkedItem c = chunked_order<false>(linear_block(), grid_extent<GRID_KEY_TILE>(), pairs,
                                               chunk > 0 ? min(chunk, pairs) : pairs);
    return make_int3(c.t, c.pair % grid_extent<ROW>(), c.pair / grid_extent<ROW>());
}

// The query tile that a block of a query-parallel kernel (fwd, bwd_dq; grid
// (ceil(Sq/BM), H, B); fwd_sm90: work_item) owns, and the n_blocks key tiles it visits: those of [n_first,
// n_end), or with mask_mod the tiles of its ModLists row. key_tile(0) is the last. OWN_VIS: each thread
// holds its own visibility (tile_visibility; fwd_sm90_ws), and the constructor is not a whole-block call;
// with id arrays, the tile's key span and its rows' intervals are found by one warpgroup (`search`: the
// producer's 128 threads, on named barrier 6) and written to `shared_keys`, where the others read them.
template <int BM, int BN, bool CAUSAL, int MASK, bool OWN_VIS = false>
struct QueryTile {
    static constexpr bool MOD = MASK & MASK_MOD, IDS = MASK & (MASK_BLOCK_IDS | MASK_SEGMENTS), WINDOW = MASK & MASK_WINDOW;
    // in shared memory when MASK != 0 (block_visibility), unless OWN_VIS
    typename TileVisibility<CAUSAL, MASK, OWN_VIS>::type vis;
    int h, b, hk, m0, rows, n_first, n_end, n_blocks;
    int live;   // of the rows, those inside the sequence (padding: the rest are never read; their outputs are zeros)
    i64 row0;   // the tile's first row on the seq axis of q / out / dout / dq
    i64 stat0;  // lse / lse2 / delta index of the tile's first row
    const int* mod_list;  // MOD: this query tile's ModLists row
    const TileIntervals<BM>* keys;  // IDS: each row's visible keys (Visibility::keys_of)

    // The block's tile of grid (ceil(Sq/BM), H, B), a pair's tiles in a row (query_block without ORDER;
    // bwd_dq's kernels ask for its chunked order themselves).
    template <class P>
    FRT_DEVICE QueryTile(const P& p, int tid, int nthreads) : QueryTile(p, query_block<CAUSAL, false>(p), tid, nthreads) {}

    // The query tile of work item wi (fwd_sm90, fwd_sm90_ws: work_item; bwd_dq: query_block). Whole-block call
    // unless OWN_VIS; OWN_VIS with id arrays: shared_keys as above; search: this thread is one of the warpgroup
    // that searches (a call of all its 128 threads).
    template <class P>
    FRT_DEVICE QueryTile(const P& p, const WorkItem& wi, int tid, int nthreads, TileIntervals<BM>* shared_keys = nullptr,
                         bool search = false)
        : vis(tile_visibility<CAUSAL, MASK, OWN_VIS>(p, wi.b)) {
        const int m_block = wi.m;
        h = wi.h;
        b = wi.b;
        hk = wi.hk;
        m0 = m_block * BM;
        rows = min(BM, vis.Eq - m0);  // <= 0: past a packed sequence's end, nothing to do
        row0 = vis.q_row0 + m0;
        live = min(rows, vis.Lq - m0);
        stat0 = (i64)b * p.st_sb + (i64)h * p.st_sh + row0;
        int lo = 0, hi = 0;
        keys = nullptr;
        if constexpr (IDS && OWN_VIS) {
            if (search) {
                const NamedGroup<6, 128> group;
                if (rows > 0) vis.key_span(m0, BM, lo, hi, tid, 128, group);
                fill_tile_intervals(*shared_keys, lo, hi, [&](int r) { return vis.keys_of(m0 + r, lo, hi); }, tid,
                                    128, group);
            } else {
                lo = shared_keys->span.x, hi = shared_keys->span.y;
            }
            keys = shared_keys;
        } else {
            if (rows > 0) vis.key_span(m0, BM, lo, hi, tid, nthreads);
            if constexpr (IDS)
                keys = &tile_intervals<BM>(lo, hi, [&](int r) { return vis.keys_of(m0 + r, lo, hi); }, tid, nthreads);
        }
        n_first = lo / BN;
        n_end = hi > lo ? ceil_div(hi, BN) : n_first;
        n_blocks = n_end - n_first;
        mod_list = nullptr;
        if constexpr (MOD) {
            n_blocks = 0;
            if (rows > 0) {
                const ModLists lists = ModLists::rows(p, BM, BN);
                const i64 at = lists.index(p, b, h, m_block);
                n_blocks = lists.count[at];
                mod_list = lists.list + at * lists.n_inner;
            }
        }
    }

    // The it-th key tile to visit, last to first (it < n_blocks).
    FRT_DEVICE int key_tile(int it) const {
        if constexpr (MOD) return ModLists::tile(mod_list[it]);
        return n_end - 1 - it;
    }

    // The key tile visited after the it-th, j, and before it (the (it - 1)-th). Without mask_mod
    // they are j - 1 and j + 1 (so written, the forward at head_dim 128 needs 8 registers fewer).
    FRT_DEVICE int next_key_tile(int it, int j) const {
        if constexpr (MOD) return key_tile(it + 1);
        return j - 1;
    }
    FRT_DEVICE int prev_key_tile(int it, int j) const {
        if constexpr (MOD) return key_tile(it - 1);
        return j + 1;
    }

    // Causal without element-mask bits: query i sees keys [0, key_limit(i)) and no others (up to its
    // diagonal; a row or key past the sequence: none), so a masked tile needs one compare per element.
    // (Not for dense tiles: the dense forward at S=8k ran 2.8% slower with it compiled in: docs/perf-notes.md, Causal work items.)
    static constexpr bool ROW_LIMIT = MASK == 0 && CAUSAL;
    FRT_DEVICE int key_limit(int i) const {
        static_assert(ROW_LIMIT, "key_limit: causal, no element-mask bits");
        return i < vis.Lq ? min(i + vis.shift + 1, vis.Lk) : 0;
    }

    // Causal, lengths and windows without mask_mod (and ids, on fwd_sm90_ws: OWN_VIS): query i sees an
    // interval of each key tile's keys (key_interval), so a masked tile needs one or two compares per
    // element instead of Visibility::visible (~8 instructions; the window at S=1k ran 26% faster:
    // docs/perf-notes.md: Tile skipping and element tests); one where the intervals start at the tile's first key, without a
    // window or segments (KEY_LO: they may start later). (A row past the sequence gets [0, 0), empty either
    // way.) With ids, the row's interval of the whole span, from shared memory.
    static constexpr bool INTERVALS = ROW_LIMIT || (MASK != 0 && !MOD && (!IDS || OWN_VIS));
    static constexpr bool KEY_LO = MASK & (MASK_WINDOW | MASK_SEGMENTS);
    FRT_DEVICE int2 key_interval(int i, int n0, int bn) const {
        static_assert(INTERVALS, "key_interval: causal, lengths, windows (and ids on fwd_sm90_ws) only");
        if constexpr (ROW_LIMIT) return make_int2(n0, key_limit(i));
        if constexpr (IDS) return keys->row[i - m0];
        return vis.keys_of(i, n0, min(n0 + bn, vis.Lk));
    }

    // The it-th key tile (j) holds some (query, key) pair of this tile that is not visible.
    FRT_DEVICE bool needs_mask(int it, int j) const {
        if constexpr (MOD)
            return mod_list[it] < 0;
        else if constexpr (IDS)
            return !keys->covers(j * BN, BN);
        else
            return !vis.all_visible(m0, BM, j * BN, BN);
    }

    // Query i of the tile sees no key of key tile j by the built-in rules (mask_mod's verdict is not
    // asked: false with one), so that a warpgroup whose rows all say so skips the tile.
    FRT_DEVICE bool sees_no_key(int i, int j) const {
        if constexpr (MOD) return false;
        const int lo = j * BN, hi = min(lo + BN, vis.Lk);
        int2 k;
        if constexpr (IDS)
            k = keys->row[i - m0];
        else
            k = vis.keys_of(i, lo, hi);
        return max(k.x, lo) >= min(k.y, hi);
    }

    // Whether row i of the tile (of query head h) sees key j: the element mask of the tiles that
    // need it. With id arrays, an interval test (their element test was a branch and two global
    // loads per pair, and cost a masked tile ~5x an unmasked one: docs/perf-notes.md: Tile skipping and element tests).
    FRT_DEVICE bool visible(int i, int j, int h) const {
        if constexpr (IDS) return keys->holds(i - m0, j) & vis.mod_visible(i, j, h);
        return vis.visible(i, j, h);
    }
};

// Copy key tile j of K and V (KV head hk of batch b; the sequence's rows start at
// k_row0, the first ek of them are read, the rest are zeros) into one pipeline stage: K at sK, V right after it
// (SWZ: unpadded and swizzled, common.cuh: load_tile).
template <int BN, int D, int NTHREADS, bool SWZ = false, class P>
FRT_DEVICE void load_kv_tile(u32 sK, const P& p, int b, int hk, i64 k_row0, int ek, int j, int tid) {
    constexpr int LD = SWZ ? round_up(D, 16) * 2 : Pitch<round_up(D, 16)>::bytes;
    const i64 n0 = k_row0 + j * BN;
    load_tile<BN, D, NTHREADS, FRT_QK_DIM, SWZ>(sK, p.k + b * p.k_sb + n0 * p.k_ss + hk * p.k_sh, p.k_ss, ek - j * BN,
                                                tid);
    load_tile<BN, D, NTHREADS, FRT_V_DIM, SWZ>(sK + BN * LD, p.v + b * p.v_sb + n0 * p.v_ss + hk * p.v_sh, p.v_ss,
                                               ek - j * BN, tid);
}

// Whether a key-parallel kernel's key tiles of one row all see the same query tiles, so that KeyTile may rotate them
// (ROTATE): not causal, no window, no ids, no mask_mod.
__host__ __device__ constexpr bool rotatable(bool causal, int mask) {
    return !causal && !(mask & (MASK_WINDOW | MASK_BLOCK_IDS | MASK_SEGMENTS | MASK_MOD));
}

// The key tile that a block of a key-parallel kernel (bwd_dkdv, bwd_fused, bwd_dkdv_sm90; grid
// (ceil(Sk / BN), Hkv * splits, B)) owns, and the (query head, query tile) pairs that can see
// it: the group's query heads in order, each with the query tiles [m_first, m_first + m_count)
// last to first, or with mask_mod the tiles of its ModLists column (per head when the mask
// differs per head). The pairs are split into `splits` contiguous chunks; this block visits
// pairs [it_begin, it_end). ROTATE, rotate_if_asked: each head's query tiles start rot = n_block % m_count
// tiles further down, wrapping (the ordered non-causal wgmma fused dQ: dq_turn).
template <int BM, int BN, bool CAUSAL, int MASK, bool ROTATE = false>
struct KeyTile {
    static constexpr bool MOD = MASK & MASK_MOD, IDS = MASK & (MASK_BLOCK_IDS | MASK_SEGMENTS);
    static_assert(!ROTATE || rotatable(CAUSAL, MASK), "KeyTile: rotation needs equal query spans");
    static constexpr bool CAN_ROTATE = ROTATE;
    typename VisibilityOf<CAUSAL, MASK>::type vis;  // in shared memory when MASK != 0 (block_visibility)
    int n_block, hk, split, b, group, n0, rows;     // rows <= 0: past a packed sequence's end
    int live;  // of the rows, the keys inside the sequence (padding: the rest are never read; their dK, dV are zeros)
    int m_first, m_count, it_begin, it_end;
    int rot;       // rotate_if_asked: the query-tile offset of this key tile; else 0
    bool rotated;  // ... it rotated
    ModLists lists;
    const TileIntervals<BN>* queries;  // IDS: each key's visible queries (Visibility::queries_of)

    struct Pair {
        int h, m;      // query head, query tile
        bool partial;  // some pair of the two tiles is not visible: the element mask runs
    };

    // The block's tile (key_block: causal, key tile 0 sees the most queries).
    template <class P>
    FRT_DEVICE KeyTile(const P& p, int tid, int nthreads) : KeyTile(p, key_block<CAUSAL>(p.sched_key_pairs), tid, nthreads) {}

    // Key tile blk.x of grid row blk.y (KV head and split) of batch entry blk.z.
    template <class P>
    FRT_DEVICE KeyTile(const P& p, int3 blk, int tid, int nthreads) : vis(block_visibility<CAUSAL, MASK>(p, blk.z)) {
        n_block = blk.x, hk = blk.y % p.Hkv, split = blk.y / p.Hkv, b = blk.z;
        group = p.H / p.Hkv;
        n0 = n_block * BN;
        rows = min(BN, vis.Ek - n0);
        live = min(rows, vis.Lk - n0);
        m_first = m_count = it_begin = it_end = rot = 0;
        rotated = false;
        queries = nullptr;
        if (rows <= 0) return;  // (the launcher uses one split when varlen: no partials to write)
        int n_pairs, q_lo = 0, q_hi = vis.Lq;
        if constexpr (MOD) {
            lists = ModLists::cols(p, BM, BN);
            n_pairs = 0;
            if (p.mod_heads > 1) {
                for (int gi = 0; gi < group; ++gi) n_pairs += mod_count(p, hk * group + gi);
            } else {
                n_pairs = group * mod_count(p, 0);
            }
        } else {
            vis.query_span(n0, BN, q_lo, q_hi, tid, nthreads);
            m_first = q_lo / BM;
            m_count = q_hi > q_lo ? ceil_div(q_hi, BM) - m_first : 0;
            n_pairs = m_count > 0 ? group * m_count : 0;
        }
        const int chunk = ceil_div(n_pairs, p.splits);
        it_begin = min(n_pairs, split * chunk), it_end = min(n_pairs, it_begin + chunk);
        if constexpr (IDS)
            queries = &tile_intervals<BN>(q_lo, q_hi, [&](int r) { return vis.queries_of(n0 + r, q_lo, q_hi); }, tid,
                                          nthreads);
    }

    // ROTATE, ordered (p.dq_sem) with p.dq_rotate and one split: start each head's query tiles rot = n_block %
    // m_count tiles below the last, wrapping, so that the key tiles of a row visit different query tiles at each
    // step (every key tile of the row sees the same query tiles: rotatable; dq_turn counts on it).
    template <class P>
    FRT_DEVICE void rotate_if_asked(const P& p) {
        if constexpr (ROTATE) {
            if (p.dq_sem && p.dq_rotate && p.splits == 1) {
                rotated = true;
                rot = m_count > 0 ? n_block % m_count : 0;
            }
        }
    }

    // Without ids or mask_mod, key j sees an interval of each query tile's queries (QueryTile::key_interval's
    // twin; both ends may cut it).
    static constexpr bool INTERVALS = !IDS && !MOD;
    FRT_DEVICE int2 query_interval(int j, int m0, int bm) const {
        static_assert(INTERVALS, "query_interval: causal, lengths and windows only");
        return vis.queries_of(j, m0, min(m0 + bm, vis.Lq));
    }

    // Whether key j of the tile is seen by query i (of query head h): the element mask of the
    // pairs that need it (QueryTile::visible's twin).
    FRT_DEVICE bool visible(int i, int j, int h) const {
        if constexpr (IDS) return queries->holds(j - n0, i) & vis.mod_visible(i, j, h);
        return vis.visible(i, j, h);
    }

    template <class P>
    FRT_DEVICE int mod_count(const P& p, int h) const {
        return lists.count[lists.index(p, b, h, n_block)];
    }

    // Pair `it`: query heads of the group in order, query tiles last to first (the ordered
    // fused dQ of bwd_dkdv.cu relies on it), or rotated (rotate_if_asked).
    template <class P>
    FRT_DEVICE Pair pair(const P& p, int it) const {
        if constexpr (MOD) {
            int gi = 0;
            if (p.mod_heads > 1) {
                for (int c; it >= (c = mod_count(p, hk * group + gi)); ++gi) it -= c;
            } else {
                const int c = mod_count(p, 0);
                gi = it / c, it -= gi * c;
            }
            const int h = hk * group + gi;
            const int e = lists.list[lists.index(p, b, h, n_block) * lists.n_inner + it];
            return {h, ModLists::tile(e), e < 0};
        } else {
            int mi = m_count - 1 - it % m_count;
            if constexpr (ROTATE) {
                mi -= rot;
                if (mi < 0) mi += m_count;
            }
            const int m = m_first + mi;
            bool partial;
            if constexpr (IDS)
                partial = !queries->covers(m * BM, BM);
            else
                partial = !vis.all_visible(m * BM, BM, n0, BN);
            return {hk * group + it / m_count, m, partial};
        }
    }
};

// Ordered fused dQ (dq_sem set: bwd_dkdv.cu's FUSED form, bwd_fused_sm90_ws.cu): the counter of query tile m of
// (batch entry, head h), and the value it holds when this key tile's turn to add has come, at its pair `it`. Key
// tiles add in order from the first that sees the query tile; rotated (KeyTile::rotate_if_asked), in the order they
// reach it: by step, then key tile. Key tile k reaches query tile m at step d = (c - k) mod R (R = m_count, c = R -
// 1 - m's index, d = it mod R), so its turn counts the nk key tiles (nk = ceil(Lk / BN), all of which see every query
// tile) whose step is below d, plus those of its own residue below k. Each waits for the key tile one above it one
// step before (no startup chain: docs/perf-notes.md, Ordered grid), which is why a row's key tiles must all fit on
// the GPU at once (tiles.rotate_ordered_dq).
template <int BM, class Tile>
FRT_DEVICE int* dq_counter(const BwdParams& p, const Tile& tile, int h, int m) {
    return p.dq_sem + ((i64)tile.b * p.H + h) * ceil_div(p.Sq, BM) + m;
}
// bwd_fused_sm90's dq_accum rows (BwdParams::dq_swizzle): the 16-byte chunk c of row R is stored at dq_slot(c, R) =
// c ^ 2 (R % 8), which bwd_sm90.cuh's stage_dq writes and bwd_dq_convert.cu reads (rows of 16 or more chunks). A
// warp's float2 stores of the accumulator go out in half-warp phases of four consecutive rows x two adjacent chunks:
// this puts each phase's eight chunks in eight different bank groups (docs/perf-notes.md, Per-pair fixed cost).
FRT_DEVICE int dq_slot(int chunk, i64 row) { return chunk ^ (int)((row & 7) << 1); }

template <int BM, int BN, class Tile>
FRT_DEVICE int dq_turn(const Tile& tile, int m, int it) {
    if (!(Tile::CAN_ROTATE && tile.rotated)) return tile.n_block - tile.vis.first_key_tile_of(m, BM, BN);
    const int R = tile.m_count, nk = ceil_div(tile.vis.Lk, BN), e = nk % R;
    const int c = R - 1 - (m - tile.m_first), d = it % R, lo = c - d + 1;
    // d' in [0, d) whose residue (c - d') mod R is below e: those residues hold nk / R + 1 key tiles, the rest nk / R
    const int extra = lo >= 0 ? max(0, min(c + 1, e) - lo) : min(c + 1, e) + max(0, e - (R + lo));
    return d * (nk / R) + extra + tile.n_block / R;
}

}  // namespace frt

// One compiled variant: a plain extern "C" entry named FRT_KERNEL_NAME whose
// template arguments come from the -D defines of flashrt/spec.py. FRT_MIN_BLOCKS, the
// blocks per SM in the launch bounds, is 1 unless a tiling asks for more (tiles.py):
// left to itself ptxas capped registers to raise occupancy, and spilled. The params are
// __grid_constant__, so that a kernel can take a field's address (fwd_sm90_ws's TMA maps) without a copy.
// Every kernel first lets its programmatic dependent, if any, start (common.cuh: launch_dependents).
#define FRT_ENTRY(TRAITS, BODY, PARAMS)                                                              \
    typedef frt::TRAITS<FRT_HEAD_DIM, FRT_BLOCK_M, FRT_BLOCK_N, FRT_WARPS, FRT_BF16, FRT_CAUSAL> FrtTraits; \
    static_assert(FrtTraits::SMEM == FRT_SMEM_BYTES, "launcher and kernel disagree on dynamic shared memory"); \
    extern "C" __global__ void __launch_bounds__(FRT_WARPS * 32, FRT_MIN_BLOCKS) FRT_KERNEL_NAME(const __grid_constant__ frt::PARAMS p) {  \
        frt::launch_dependents();                                                                     \
        frt::BODY<FrtTraits>(p);                                                                      \
    }
