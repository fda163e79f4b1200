// The device-side check of a call's mask arrays (validate=True), launched after its attention kernels:
// no host copy and no synchronisation, so masked calls cost what unmasked ones do and can be captured
// into CUDA graphs. flashrt/masks.py holds the rules' wording (the messages) and reads the report.
//
// One block scans each array given, in the order of CheckParams' pointers (masks.ARRAY_ARGS), on sm_90
// while the call's last kernel runs (a programmatic dependent launch: common.cuh, launch_dependents). The
// first failure, by argument and then by index, is written to `report` (host-mapped memory: the host
// reads it without a copy at its next call, masks.raise_reported) unless an unread report is there,
// and the call's outputs are overwritten with NaN (every byte 0xff is a NaN in bf16, fp16 and fp32),
// so that a bad input never leaves a plausible answer behind. (The attention kernels stay inside their
// tensors whatever the arrays hold: mask.cuh clamps lengths and offsets; what a bad array breaks is
// the answer, which this check catches.)
#include "attention/params.cuh"

namespace frt {

// The report's int32 words (REPORT_*) and failure codes (BAD_*): flashrt/params.py's tables (flashrt_tables.cuh).

struct CheckFailure {
    int code, seq, pos, value, limit;
};

// Element i of argument `arg` (x its data, n its length): code 0 when it passes.
FRT_DEVICE CheckFailure check_element(const CheckParams& p, int arg, const int* x, i64 i) {
    CheckFailure f = {0, 0, -1, 0, 0};
    const bool q_side = (arg & 1) == 0;  // the arguments alternate q, k
    if (arg < 2) {  // seqlens_q / seqlens_k: a length within the tensor's seqlen axis
        const int extent = q_side ? p.Sq : p.Sk;
        if (x[i] < 0 || x[i] > extent) f = {BAD_LENGTH, (int)i, -1, x[i], extent};
    } else if (arg < 4) {  // cu_seqlens_q / _k: from 0, non-decreasing, inside the packed tensor, at most max_seqlen apart
        const int total = q_side ? p.total_q : p.total_k, longest = q_side ? p.Sq : p.Sk;
        if (i == 0 && x[0] != 0)
            f = {BAD_CU_START, 0, -1, x[0], 0};
        else if (i > 0 && x[i] < x[i - 1])
            f = {BAD_CU_ORDER, (int)i, -1, x[i], x[i - 1]};
        else if (i == p.B && x[i] > total)
            f = {BAD_CU_END, (int)i, -1, x[i], total};
        else if (i > 0 && (i64)x[i] - x[i - 1] > longest)  // (64-bit: offsets of opposite signs)
            f = {BAD_CU_LONGEST, (int)i - 1, -1, (int)min((i64)x[i] - x[i - 1], (i64)0x7fffffff), longest};
    } else if (i > 0 && x[i] < x[i - 1]) {  // block / segment ids: non-decreasing along each sequence
        int seq, start;
        if (p.cu_q) {  // packed: the sequence that holds row i, if any
            const int* cu = q_side ? p.cu_q : p.cu_k;
            seq = first_at_least<true>(cu, 0, p.B + 1, (int)i) - 1;
            if (seq < 0 || seq >= p.B) return f;  // a row outside every sequence
            start = cu[seq];
        } else {
            const int len = q_side ? p.Sq : p.Sk;
            seq = (int)(i / len), start = seq * len;
        }
        if (i > start) f = {BAD_IDS_ORDER, seq, (int)(i - start), x[i], x[i - 1]};
    }
    return f;
}

// Argument `arg`'s data (null when not given) and length. (A switch, not an array: an array indexed at run
// time would live in local memory.)
FRT_DEVICE const int* array_of(const CheckParams& p, int arg) {
    switch (arg) {
        case 0: return p.seqlens_q;
        case 1: return p.seqlens_k;
        case 2: return p.cu_q;
        case 3: return p.cu_k;
        case 4: return p.block_q;
        case 5: return p.block_k;
        case 6: return p.seg_q;
        default: return p.seg_k;
    }
}
FRT_DEVICE i64 length_of(const CheckParams& p, int arg) {
    if (arg < 4) return arg < 2 ? p.B : p.B + 1;
    if (p.cu_q) return arg & 1 ? p.total_k : p.total_q;  // packed ids: (total,)
    return (i64)p.B * (arg & 1 ? p.Sk : p.Sq);
}

// Every byte of out[0, bytes) set to 0xff, by the block (out: a 16-byte aligned allocation, or null).
FRT_DEVICE void poison(u8* out, i64 bytes) {
    if (out == nullptr) return;
    const i64 n16 = bytes / 16;
    for (i64 i = threadIdx.x; i < n16; i += blockDim.x)
        reinterpret_cast<uint4*>(out)[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
    for (i64 i = n16 * 16 + threadIdx.x; i < bytes; i += blockDim.x) out[i] = 0xff;
}

template <class T>
__device__ void mask_check(const CheckParams& p) {
    // This thread's first failure as (argument << 40) | index: the order in which failures are reported.
    u64 mine = ~0ull;
    for (int arg = 0; arg < 4; ++arg) {  // lengths and offsets: B or B + 1 entries
        const int* x = array_of(p, arg);
        const i64 n = x ? length_of(p, arg) : 0;
        for (i64 i = threadIdx.x; i < n; i += blockDim.x)
            if (check_element(p, arg, x, i).code) mine = min(mine, ((u64)arg << 40) | (u64)i);
    }
    // Ids, a few per token: the given arrays' next UNROLL elements each, their loads in flight together (one
    // block: latency is its whole cost; the seed shape's two arrays of 2048 ids take one round).
    constexpr int UNROLL = 4;
    i64 n_ids = 0;
#pragma unroll
    for (int arg = 4; arg < 8; ++arg) n_ids = max(n_ids, array_of(p, arg) ? length_of(p, arg) : 0);
    for (i64 base = threadIdx.x; base < n_ids; base += UNROLL * blockDim.x) {
        int cur[4][UNROLL], prev[4][UNROLL];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int* x = array_of(p, a + 4);
            const i64 n = x ? length_of(p, a + 4) : 0;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const i64 i = base + u * blockDim.x;
                cur[a][u] = i < n ? x[i] : 0;
                prev[a][u] = i < n && i > 0 ? x[i - 1] : cur[a][u];
            }
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const i64 i = base + u * blockDim.x;
                if (cur[a][u] < prev[a][u] && check_element(p, a + 4, array_of(p, a + 4), i).code)
                    mine = min(mine, ((u64)(a + 4) << 40) | (u64)i);
            }
    }
    // On sm_90 this launch is the call's last kernel's programmatic dependent (launch.Sequence): the scan
    // above ran beside that kernel. From here on it has finished and its outputs are visible, so they can be
    // overwritten, and the kernels after this one find them done.
    wait_previous_grid();
    __shared__ u64 first;
    if (threadIdx.x == 0) first = ~0ull;
    __syncthreads();
    if (mine != ~0ull) atomicMin(&first, mine);
    if (!__syncthreads_or(mine != ~0ull)) return;
    if (threadIdx.x == 0 && p.report[REPORT_CODE] == 0) {
        const int arg = (int)(first >> 40);
        const CheckFailure f = check_element(p, arg, array_of(p, arg), (i64)(first & ((1ull << 40) - 1)));
        volatile int* r = p.report;
        r[REPORT_ARG] = arg, r[REPORT_SEQ] = f.seq, r[REPORT_POS] = f.pos;
        r[REPORT_VALUE] = f.value, r[REPORT_LIMIT] = f.limit, r[REPORT_CALL] = p.call;
        __threadfence_system();  // the fields before the code that announces them
        r[REPORT_CODE] = f.code;
    }
    poison(p.poison0, p.poison_bytes0);
    poison(p.poison1, p.poison_bytes1);
    poison(p.poison2, p.poison_bytes2);
}

}  // namespace frt

#ifdef FRT_KERNEL_NAME
FRT_ENTRY(ElementwiseTraits, mask_check, CheckParams)
#endif
