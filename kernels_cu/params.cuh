// Kernel argument structs, passed by value. flashrt/params.py mirrors each field
// in order: every compiled variant static_asserts the struct size against it,
// and a CPU test compares the field lists, so the two sides cannot drift apart.
//
// Tensors are (batch, seq, heads, head_dim) with arbitrary strides in elements
// for the first three axes and a contiguous last axis. lse/lse2/delta are
// contiguous fp32 (batch, heads, seq_q).
#pragma once
#include "common.cuh"

namespace frt {

struct FwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;
    i64 q_sb, q_ss, q_sh;
    i64 k_sb, k_ss, k_sh;
    i64 v_sb, v_ss, v_sh;
    i64 o_sb, o_ss, o_sh;
    int B, H, Hkv, Sq, Sk;
    float scale_log2;  // softmax_scale * log2(e)
};

struct BwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* o;
    const u16* dout;
    const float* lse;  // natural-log LSE from the forward pass
    float* lse2;       // scratch: lse * log2(e); +inf for rows that saw no key
    float* delta;      // scratch: rowsum(dout * o)
    u16* dq;
    u16* dk;
    u16* dv;
    i64 q_sb, q_ss, q_sh;
    i64 k_sb, k_ss, k_sh;
    i64 v_sb, v_ss, v_sh;
    i64 o_sb, o_ss, o_sh;
    i64 do_sb, do_ss, do_sh;
    i64 dq_sb, dq_ss, dq_sh;
    i64 dk_sb, dk_ss, dk_sh;
    i64 dv_sb, dv_ss, dv_sh;
    int B, H, Hkv, Sq, Sk;
    float scale_log2;
    float scale;
};

// Causal masking is aligned to the bottom-right corner of the (Sq, Sk) score
// matrix, as in FlashAttention >= 2.1: query i sees key j iff j <= i + Sk - Sq.
FRT_DEVICE int causal_offset(int Sq, int Sk) { return Sk - Sq; }

}  // namespace frt
