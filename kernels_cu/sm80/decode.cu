// Decoding against a KV cache (flashrt/decoding.py): a few new query tokens per sequence, memory-bound.
//
// Grid (splits, Hkv * row_tiles, B). A block owns one KV head's packed rows: the H / Hkv query heads x Sq
// tokens that share that KV head (row r = token * group + head in group), BM of them, so each K/V byte is read
// once for the whole group. Its key range is a `splits`-th of the sequence's (in BN-key tiles), streamed
// through a STAGES-deep cp.async ring. The NW warps tile the BM rows by 16 (WM warps) and each tile's keys by
// KW (WN warps); each warp keeps its own softmax statistics and O, merged through shared memory at the end in
// a fixed order. One split writes out and lse; several write fp32 partials that combine.cu merges, or (p.cluster)
// merge them in their thread block cluster (cluster_combine).
//
// Keys at or past cache_seqlens[b] are this call's k_new / v_new rows, read from there; the block of split 0
// and row tile 0 also writes them into the cache (no block reads those cache rows in this launch). A bad value
// (cache_seqlens outside [0, capacity - new], a page id outside [0, num_pages)) is never used for an access: the
// rows it touches get NaN outputs and the host-mapped report says what (masks.raise_reported).
// FRT_SOFTCAP: the scores capped (score_mod.cuh: Softcap) before the mask, as in the forward kernels. FRT_ALIBI: each
// score gains -(slope / scale) |key - position|, the row's head's slope and its token's key position (score_mod.cuh:
// Alibi's definition, bottom-right aligned as decode's causal mask).
#include "attention/params.cuh"
#include "attention/score_mod.cuh"
#include "attention/softmax.cuh"

namespace frt {

template <int D_, int BM_, int BN_, int NW_, bool BF16_, bool CAUSAL_>
struct DecodeTraits {
    static constexpr int D = D_, BM = BM_, BN = BN_, NW = NW_;
    static constexpr bool BF16 = BF16_;
    static constexpr int DP = round_up(D, 16), NTHREADS = NW * 32;
    // Tiles unpadded and swizzled (common.cuh: chunk_at) where rows are a multiple of 128 bytes, else padded
    // (spec.KernelSpec.swizzled).
    static constexpr bool SWZ = FRT_SWIZZLE;
    static_assert(!SWZ || DP % 64 == 0, "swizzled rows are a multiple of 128 bytes");
    static constexpr int LD = SWZ ? DP * 2 : Pitch<DP>::bytes;
    static constexpr int WM = BM / 16, WN = NW / WM, KW = BN / WN;
    static_assert(D % 8 == 0 && D <= 256, "head_dim must be a multiple of 8, at most 256");
    static_assert(BM % 16 == 0 && NW % WM == 0 && BN % WN == 0 && KW % 16 == 0,
                  "warps must tile block_m by 16 rows and block_n by 16-key multiples");
    static constexpr int STAGES = FRT_DECODE_STAGES;  // (spec.KernelSpec.decode_stages)
    static_assert(STAGES >= 2, "decode: a ring of two stages or more");
    static constexpr bool Q_IN_REGS = DP <= 128;
    static constexpr int SMEM_STAGE = 2 * BN * LD;  // a stage: K, then V
    // Q read into registers at the first tile lands in the last stage, which the first tile's loads leave free (one
    // block more per SM at head_dim 56 / 64; docs/perf-notes.md, Decode: the loader); else before the stages.
    static constexpr bool Q_IN_STAGE = Q_IN_REGS && BM <= 2 * BN;
    static constexpr int SMEM_Q = Q_IN_STAGE ? 0 : BM * LD;
    // The epilogue reuses it: each warp column's row maxima and sums, then its O rows (fp32, pitch OP).
    static constexpr int OP = DP + 4, EXCHANGE = 2 * WN * BM * 4 + WN * BM * OP * 4;
    static constexpr int SMEM = cmax(SMEM_Q + STAGES * SMEM_STAGE, EXCHANGE);
};

FRT_DEVICE void report_bad(int* report, int code, int seq, int value, int limit) {
    if (atomicCAS(report + REPORT_CODE, 0, -1) != 0) return;  // a report is there (or being written)
    volatile int* r = report;
    r[REPORT_ARG] = 0, r[REPORT_SEQ] = seq, r[REPORT_POS] = -1;
    r[REPORT_VALUE] = value, r[REPORT_LIMIT] = limit, r[REPORT_CALL] = 4;
    __threadfence_system();  // the fields before the code that announces them
    r[REPORT_CODE] = code;
}

// sm_90, p.cluster (flashrt/decoding.py): the key range's `splits` blocks are one thread block cluster (block = split =
// cluster rank) and merge their parts there, as combine.cu would (out = sum_s w_s out_s, w_s = exp(lse_s - lse), in
// split order: deterministic; a NaN lse makes the row NaN; the head's sink one more part), without its launch and
// global round trip (docs/perf-notes.md, Decode: splits and the combine). The cluster's blocks share the rows' items,
// each reading every split's part through distributed shared memory.
// s_part: a split's part, row r's out at s_part + r * OP, its lse at column DP.
template <class T>
FRT_DEVICE void cluster_combine(const DecodeParams& p, const float* s_part, int rank, int b, int hk, int row0, int rows,
                                int group) {
    constexpr int C4 = T::D / 4, OP = T::OP;
    cluster_sync();  // every split's part is in its block's shared memory
    const u32 parts = smem_u32(s_part), lses = parts + T::DP * 4;
    const int n = p.splits;
    for (int idx = rank * T::NTHREADS + (int)threadIdx.x; idx < rows * C4; idx += n * T::NTHREADS) {
        const int r = idx / C4, c = (idx % C4) * 4;
        const int rg = row0 + r, i = rg / group, h = hk * group + rg % group;
        float m = p.sinks ? p.sinks[h] : -FRT_INF;
        bool nan = false;
        for (int sp = 0; sp < n; ++sp) {
            const float l = cluster_ld(cluster_map(lses + r * OP * 4, sp));
            nan |= l != l;
            m = fmaxf(m, l);
        }
        float sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int sp = 0; sp < n; ++sp) {
            const float l = cluster_ld(cluster_map(lses + r * OP * 4, sp));
            if (l == -FRT_INF || nan) continue;
            const float w = expf(l - m);
            const float4 x = cluster_ld4(cluster_map(parts + (r * OP + c) * 4, sp));
            sum += w;
            acc[0] = fmaf(w, x.x, acc[0]), acc[1] = fmaf(w, x.y, acc[1]);
            acc[2] = fmaf(w, x.z, acc[2]), acc[3] = fmaf(w, x.w, acc[3]);
        }
        if (p.sinks && p.sinks[h] != -FRT_INF) sum += expf(p.sinks[h] - m);
        const float inv = sum > 0.f ? 1.f / sum : 0.f, qnan = __int_as_float(0x7fffffff);
        uint2 packed;
        packed.x = Elem<T::BF16>::pack(nan ? qnan : acc[0] * inv, nan ? qnan : acc[1] * inv);
        packed.y = Elem<T::BF16>::pack(nan ? qnan : acc[2] * inv, nan ? qnan : acc[3] * inv);
        *reinterpret_cast<uint2*>(p.o + b * p.o_sb + i * p.o_ss + h * p.o_sh + c) = packed;
        if (c == 0) p.lse[((i64)b * p.H + h) * p.Sq + i] = nan ? qnan : sum > 0.f ? m + logf(sum) : -FRT_INF;
    }
    cluster_sync();  // no block leaves while another reads its shared memory
}

template <class T>
__device__ void decode(const DecodeParams& p) {
    constexpr int BM = T::BM, BN = T::BN, DP = T::DP, LD = T::LD, KW = T::KW, STAGES = T::STAGES;
    constexpr bool SWZ = T::SWZ;
    constexpr int NT_S = KW / 8, NT_O = DP / 8, KS_D = DP / 16, KS_N = KW / 16, CPR = DP / 8;
    extern __shared__ __align__(128) unsigned char smem[];  // (128: swizzled rows start on 128-byte lines)
    __shared__ int bad_page, bad_page_id;  // a page id outside the pool was found (atomics: any thread may)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3, wm = warp % T::WM, wn = warp / T::WM;
    const int group = p.H / p.Hkv, R = group * p.Sq, row_tiles = ceil_div(R, BM);
    const int split = grid_index<GRID_DECODE_SPLIT>(), b = grid_index<GRID_DECODE_BATCH>();
    const unsigned y = grid_index<GRID_DECODE_KV_HEAD_ROW_TILE>();
    const int rt = y % row_tiles, hk = y / row_tiles;
    const int row0 = rt * BM, rows = cmin(BM, R - row0);

    // The sequence: L0 cached keys, then n_new appended ones; query i sits at key position shift + i.
    const int L0 = p.cache_seqlens ? p.cache_seqlens[b] : p.seqlen, n_new = p.k_new ? p.Sq : 0;
    const bool bad_len = L0 < 0 || L0 > p.capacity - n_new;
    const int L = bad_len ? 0 : L0 + n_new, shift = L - p.Sq;
    const int* pages = p.page_table ? p.page_table + b * p.pt_sb : nullptr;
    // Row r's visible keys: [key_lo(i), key_hi(i)) of its token i.
    auto key_hi = [&](int i) {
        int hi = p.causal ? shift + i + 1 : L;
        if (p.win_right >= 0) hi = min(hi, shift + i + p.win_right + 1);
        return max(0, min(hi, L));
    };
    auto key_lo = [&](int i) { return p.win_left >= 0 ? max(0, shift + i - p.win_left) : 0; };
    const int i_first = row0 / group, i_last = (row0 + rows - 1) / group;
    const int lo = key_lo(i_first), hi = key_hi(i_last);     // the keys any row sees
    const int all_lo = key_lo(i_last), all_hi = key_hi(i_first);  // ... and those every row sees
    const int t_lo = lo / BN, n_t = hi > lo ? ceil_div(hi, BN) - t_lo : 0;
    const int per = ceil_div(n_t, p.splits);
    const int first = t_lo + min(split * per, n_t), n_blocks = min((split + 1) * per, n_t) - min(split * per, n_t);

    if (tid == 0) bad_page = 0;
    __syncthreads();
    // Whether a page id lies in the pool; one that does not is flagged for the report (and read as nothing).
    auto page_ok = [&](int page) {
        const bool ok = (unsigned)page < (unsigned)p.num_pages;
        if (!ok) {
            atomicOr(&bad_page, 1);
            atomicExch(&bad_page_id, page);
        }
        return ok;
    };
    // Cache row `key`: its element offset (k_cache and v_cache share strides), or -1 for a bad page id.
    auto cache_row = [&](int key) -> i64 {
        if (!pages) return b * p.kc_sb + key * p.kc_ss;
        const int page = pages[key / p.page_size];
        if (!page_ok(page)) return -1;
        return page * p.kc_sb + (key % p.page_size) * p.kc_ss;
    };
    // The appended keys' pages, checked by every block of the sequence (each reports the same outputs bad).
    if (pages && !bad_len && tid < n_new) cache_row(L0 + tid);
    const bool bad_append = __syncthreads_or(bad_page != 0);

    if (split == 0 && rt == 0 && n_new && !bad_len && !bad_append) {  // the append
        for (int idx = tid; idx < p.Sq * CPR; idx += T::NTHREADS) {
            const int i = idx / CPR, c = idx % CPR;
            if (c * 8 >= T::D) continue;
            const i64 at = cache_row(L0 + i) + hk * p.kc_sh + c * 8, from = b * p.kn_sb + i * p.kn_ss + hk * p.kn_sh + c * 8;
            *reinterpret_cast<uint4*>(p.k_cache + at) = *reinterpret_cast<const uint4*>(p.k_new + from);
            *reinterpret_cast<uint4*>(p.v_cache + at) = *reinterpret_cast<const uint4*>(p.v_new + from);
        }
    }

    const u32 sKV = smem_u32(smem) + T::SMEM_Q;
    const u32 sQ = T::Q_IN_STAGE ? sKV + (STAGES - 1) * T::SMEM_STAGE : smem_u32(smem);
    for (int idx = tid; idx < BM * CPR; idx += T::NTHREADS) {
        const int r = idx / CPR, c = idx % CPR, rg = row0 + r;
        const bool ok = r < rows && c * 8 < T::D;
        const u16* src = ok ? p.q + b * p.q_sb + (rg / group) * p.q_ss + (hk * group + rg % group) * p.q_sh + c * 8 : p.q;
        cp_async16(sQ + chunk_at<SWZ>(r, c, LD), src, ok);
    }
    // Tile j's keys [lo, hi) into a stage (the rest zero: no NaN of an unwritten cache row reaches P V). k_cache and
    // v_cache share their strides (decoding.py), so one offset serves both; the offset is 32-bit arithmetic until its
    // one widening multiply, and a power-of-two page size takes a shift (docs/perf-notes.md, Decode: the loader).
    constexpr int LOADS = ceil_div(BN * CPR, T::NTHREADS);
    const i64 kv_gap = p.v_cache - p.k_cache;
    const u16* kbase = p.k_cache + hk * p.kc_sh + (pages ? 0 : b * p.kc_sb);
    const u16* nbase = p.k_new + b * p.kn_sb + hk * p.kn_sh;  // (unused without k_new)
    const i64 nv_gap = p.v_new - p.k_new;
    auto page_of = [&](int key) { return p.page_shift >= 0 ? key >> p.page_shift : key / p.page_size; };
    // The fast path: a tile of cached keys only (all but a split's first and the sequence's last). A thread's u-th of
    // its LOADS 16-byte chunks is (chunk_row(u), chunk_col(u)): where a row's CPR chunks divide the threads, one column
    // of every RS-th row; else (rows of 48, 80, 96, ..., 240 elements) the tile's chunks in order, NTHREADS apart, any
    // past the tile's end skipped. (Those head_dims took the general path before: head_dim 192 at about half head_dim
    // 256's bandwidth; docs/perf-notes.md, Decode: the loader.)
    constexpr bool FAST = T::D % 16 == 0, COLUMNS = T::NTHREADS % CPR == 0;
    constexpr int RS = T::NTHREADS / CPR;
    static_assert(!COLUMNS || BN % RS == 0, "the fast path's rows tile the key tile");
    const int r0 = tid / CPR, c0 = tid % CPR, tr = COLUMNS ? r0 : 0, tc = COLUMNS ? c0 : 0;
    auto chunk_row = [&](int u) { return COLUMNS ? r0 + u * RS : (tid + u * T::NTHREADS) / CPR; };
    auto chunk_col = [&](int u) { return COLUMNS ? c0 : (tid + u * T::NTHREADS) % CPR; };
    auto chunk_in = [&](int u) { return COLUMNS || BN * CPR % T::NTHREADS == 0 || tid + u * T::NTHREADS < BN * CPR; };
    auto chunk_key = [&](int k0, int u) { return COLUMNS ? k0 + r0 + u * RS : k0 + chunk_row(u); };  // (its key)
    auto load_kv = [&](u32 stage, int j) {
        const u32 sK = stage, sV = stage + BN * LD;
        const int k0 = j * BN;
        if (FAST && k0 >= lo && k0 + BN <= min(hi, L0)) {
            // Rows in one run of memory: contiguous, or paged with the tile inside one page (pages of BN keys or
            // more, a power of two): a base pointer and a constant row step.
            const bool one_page = pages && p.page_shift >= 0 && ((BN - 1) >> p.page_shift) == 0;
            if (!pages || one_page) {
                // (ks: this thread's first chunk in columns, else the tile's start)
                const u16* ks = kbase + (i64)(k0 + tr) * p.kc_ss + tc * 8;
                bool ok = true;
                if (one_page) {
                    const int pg = pages[k0 >> p.page_shift];
                    ok = page_ok(pg);
                    ks = kbase + (i64)pg * p.kc_sb + (i64)((k0 & (p.page_size - 1)) + tr) * p.kc_ss + tc * 8;
                }
#pragma unroll
                for (int u = 0; u < LOADS; ++u) {
                    if (!chunk_in(u)) continue;
                    const int r = chunk_row(u), c = chunk_col(u);
                    const u16* at = ok ? ks + (COLUMNS ? u * RS * p.kc_ss : r * p.kc_ss + c * 8) : p.q;
                    cp_async16(sK + chunk_at<SWZ>(r, c, LD), at, ok);
                    cp_async16(sV + chunk_at<SWZ>(r, c, LD), ok ? at + kv_gap : p.q, ok);
                }
                return;
            }
            int pg[LOADS];
#pragma unroll
            for (int u = 0; u < LOADS; ++u) pg[u] = chunk_in(u) ? pages[page_of(chunk_key(k0, u))] : 0;
#pragma unroll
            for (int u = 0; u < LOADS; ++u) {
                if (!chunk_in(u)) continue;
                const int r = chunk_row(u), c = chunk_col(u), key = chunk_key(k0, u);
                const bool ok = page_ok(pg[u]);
                const u16* at = ok ? kbase + (pg[u] * p.kc_sb + (key - page_of(key) * p.page_size) * p.kc_ss) + c * 8
                                   : p.q;
                cp_async16(sK + chunk_at<SWZ>(r, c, LD), at, ok);
                cp_async16(sV + chunk_at<SWZ>(r, c, LD), ok ? at + kv_gap : p.q, ok);
            }
            return;
        }
        // The general path (a split's first tile, the sequence's last, head_dims off the 16-byte grid): rolled,
        // as it runs at most twice per block.
#pragma unroll 1
        for (int idx = tid; idx < BN * CPR; idx += T::NTHREADS) {
            const int r = idx / CPR, c = idx % CPR, key = j * BN + r;
            bool ok = key >= lo && key < hi && (T::D % 16 == 0 || c * 8 < T::D);
            const u16* ks = p.q;
            i64 gap = 0;
            if (ok && key >= L0) {
                ks = nbase + (key - L0) * p.kn_ss + c * 8, gap = nv_gap;
            } else if (ok) {
                const i64 at = cache_row(key);
                ok = at >= 0;
                if (ok) ks = p.k_cache + at + hk * p.kc_sh + c * 8, gap = kv_gap;
            }
            cp_async16(sK + chunk_at<SWZ>(r, c, LD), ks, ok);
            cp_async16(sV + chunk_at<SWZ>(r, c, LD), ks + gap, ok);
        }
    };
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_blocks) load_kv(sKV + s * T::SMEM_STAGE, first + s);
        cp_async_commit();
    }

    const Softcap cap = FRT_SOFTCAP ? Softcap(p.softcap, p.scale_log2) : Softcap();
    const float scale_log2 = cap.scale_of(p.scale_log2);
    float o[1][NT_O][4];
    zero(o);
    float row_max[2] = {-FRT_INF, -FRT_INF}, row_sum[2] = {0.f, 0.f};
    u32 qf[T::Q_IN_REGS ? KS_D : 1][1][4];
    const u32 sQw = sQ + wm * 16 * LD;
    // This thread's two rows' tokens (the fragment rows g and g + 8 of the warp's 16).
    const int tok[2] = {(row0 + wm * 16 + g) / group, (row0 + wm * 16 + g + 8) / group};
    // FRT_ALIBI: the rows' slopes in raw-score units (their heads: hk * group + row % group) and key positions.
    float slope[2] = {0.f, 0.f}, pos[2] = {0.f, 0.f};
    if constexpr (FRT_ALIBI) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int h = hk * group + (row0 + wm * 16 + g + 8 * hh) % group;
            slope[hh] = p.alibi[(i64)b * p.alibi_bstride + h] * (kLog2e / p.scale_log2);
            pos[hh] = (float)(shift + tok[hh] - 2 * t);  // (less the lane's first column: key offsets are constants)
        }
    }

    for (int it = 0; it < n_blocks; ++it) {
        const int j = first + it, stage = it % STAGES;
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile it is in; every warp is done with the stage the next load overwrites
        if constexpr (T::Q_IN_REGS) {
            if (it == 0) {  // (Q came with tile 0's loads)
#pragma unroll
                for (int kk = 0; kk < KS_D; ++kk) load_a<A_MK, SWZ>(sQw, LD, 0, kk, lane, qf[kk][0]);
                if constexpr (T::Q_IN_STAGE) __syncthreads();  // every warp holds Q before the next load overwrites it
            }
        }
        if (it + STAGES - 1 < n_blocks) load_kv(sKV + ((it + STAGES - 1) % STAGES) * T::SMEM_STAGE, j + STAGES - 1);
        cp_async_commit();

        const u32 sK = sKV + stage * T::SMEM_STAGE + wn * KW * LD, sV = sK + BN * LD;
        float s[1][NT_S][4];
        zero(s);
        if constexpr (T::Q_IN_REGS) {
            gemm_rs<T::BF16, 1, NT_S, KS_D, B_NK, SWZ>(s, qf, sK, LD, lane);
        } else {
            gemm_ss<T::BF16, 1, NT_S, KS_D, B_NK, A_MK, SWZ>(s, sQw, LD, sK, LD, lane);
        }
        if constexpr (FRT_SOFTCAP) {  // (before the mask: tanh(-inf) is no -inf)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[0][nt][c] = cap.tanh_of(s[0][nt][c]);
        }
        const int n0 = j * BN + wn * KW;
        if constexpr (FRT_ALIBI) {
            const float base = (float)n0;
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    s[0][nt][c] = fmaf(-slope[c >> 1], fabsf(base + (float)(nt * 8 + (c & 1)) - pos[c >> 1]),
                                       s[0][nt][c]);
        }
        if (n0 < all_lo || n0 + KW > all_hi) {
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int key = n0 + nt * 8 + 2 * t + (c & 1), i = tok[c >> 1];
                    if (key < key_lo(i) || key >= key_hi(i)) s[0][nt][c] = -FRT_INF;
                }
        }
        float alpha[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            alpha[hh] = online_row<NT_S>(row_max[hh], row_sum[hh], scale_log2,
                                         [&](int nt, int e) -> float& { return s[0][nt][2 * hh + e]; });
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // (past the first tiles, rarely)
#pragma unroll
            for (int dt = 0; dt < NT_O; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[0][dt][e] *= alpha[e >> 1];
        }
        u32 pf[KS_N][1][4];
        acc_to_a<T::BF16, 1, KS_N>(s, pf);
        gemm_rs<T::BF16, 1, NT_O, KS_N, B_KN, SWZ>(o, pf, sV, LD, lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // the stages are free: the warps' statistics and O meet there

    float* s_max = reinterpret_cast<float*>(smem);  // [WN][BM]
    float* s_sum = s_max + T::WN * BM;               // [WN][BM]
    float* s_o = s_sum + T::WN * BM;                 // [WN][BM][OP]
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = wm * 16 + g + 8 * hh;
        const float sum = warp_sum4(row_sum[hh]);
        if (t == 0) s_max[wn * BM + r] = row_max[hh], s_sum[wn * BM + r] = sum;
#pragma unroll
        for (int dt = 0; dt < NT_O; ++dt)
            *reinterpret_cast<float2*>(s_o + (wn * BM + r) * T::OP + dt * 8 + 2 * t) =
                make_float2(o[0][dt][2 * hh], o[0][dt][2 * hh + 1]);
    }
    const bool bad = __syncthreads_or(bad_page != 0) || bad_len;
    if (bad && tid == 0)
        report_bad(p.report, bad_len ? BAD_CACHE_SEQLENS : BAD_PAGE_ID, b, bad_len ? L0 : bad_page_id,
                   bad_len ? p.capacity - n_new : p.num_pages);

    // Each thread merges 4 columns of a row over the warp columns, in order (deterministic).
    for (int idx = tid; idx < BM * (DP / 4); idx += T::NTHREADS) {
        const int r = idx / (DP / 4), c = (idx % (DP / 4)) * 4;
        if (r >= rows || c >= T::D) continue;
        float m = -FRT_INF;
#pragma unroll
        for (int w = 0; w < T::WN; ++w) m = fmaxf(m, s_max[w * BM + r]);
        float l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < T::WN; ++w) {
            const float mw = s_max[w * BM + r], sc = mw == -FRT_INF ? 0.f : fast_exp2(mw - m);
            l += s_sum[w * BM + r] * sc;
            const float4 x = *reinterpret_cast<const float4*>(s_o + (w * BM + r) * T::OP + c);
            acc[0] += x.x * sc, acc[1] += x.y * sc, acc[2] += x.z * sc, acc[3] += x.w * sc;
        }
        const int rg = row0 + r, i = rg / group, h = hk * group + rg % group;
        // The head's sink joins the row here when this block holds all its keys (else combine.cu adds it once).
        const float keep = p.splits == 1 && p.sinks ? add_sink(m, l, p.sinks[h]) : 1.f;
        const float inv = l > 0.f ? keep / l : 0.f;
        float lse = l > 0.f ? (m + __log2f(l)) * kLn2 : -FRT_INF;
        if (bad) lse = __int_as_float(0x7fffffff);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = bad ? lse : acc[e] * inv;
        if (p.splits == 1) {
            uint2 packed;
            packed.x = Elem<T::BF16>::pack(acc[0], acc[1]);
            packed.y = Elem<T::BF16>::pack(acc[2], acc[3]);
            *reinterpret_cast<uint2*>(p.o + b * p.o_sb + i * p.o_ss + h * p.o_sh + c) = packed;
            if (c == 0) p.lse[((i64)b * p.H + h) * p.Sq + i] = lse;
        } else if (p.cluster) {  // the part over warp column 0's O row (only this thread reads these columns), its
            // lse in the row's padding (column DP): cluster_combine reads them
            *reinterpret_cast<float4*>(s_o + r * T::OP + c) = make_float4(acc[0], acc[1], acc[2], acc[3]);
            if (c == 0) s_o[r * T::OP + DP] = lse;
        } else {
            const i64 row = (((i64)split * p.B + b) * p.Sq + i) * p.H + h;
            *reinterpret_cast<float4*>(p.o_part + row * T::D + c) = make_float4(acc[0], acc[1], acc[2], acc[3]);
            if (c == 0) p.lse_part[(((i64)split * p.B + b) * p.H + h) * p.Sq + i] = lse;
        }
    }
    if (p.cluster) cluster_combine<T>(p, s_o, split, b, hk, row0, rows, group);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(DecodeTraits, decode, DecodeParams)
#endif
