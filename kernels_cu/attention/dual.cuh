// A score_mod expression's environment (score_mod.cuh; flashrt/spec.py: score_mod_source defines the user's functions
// in namespace flashrt_expr), and forward-mode dual numbers for its automatic derivative (score_mod_source evaluates
// the expression once more with s a Dual when no score_mod_grad is given).
//
// In the expression, tanh, exp, exp2, log and log2 of a float are the hardware's approximations (one MUFU op each:
// tanh.approx as the built-in softcap's, relative error <= 2^-10.99; ex2 / lg2.approx, ~2^-22), hiding CUDA's accurate
// ones for the expression only (the accurate tanhf cost a capped score 2.2-3.2x the built-in softcap's forward, H200;
// docs/perf-notes.md: score_mod). The dual numbers evaluate the same functions, so that the backward's scores are
// the forward's, bitwise where the expression is float arithmetic (a double literal, 0.1 for 0.1f, makes the
// forward compute in double and the dual numbers in float, ~1e-7 apart, and costs the forward FP64 ops per score).
//
// A Dual carries a value and its derivative in s. Constants convert to a Dual of derivative 0; the arithmetic and
// comparison operators and the math functions below are found by argument-dependent lookup wherever an argument is
// a Dual, so that the user's expression reads the same as over a float. There is no conversion back to float: an
// expression that casts s, or calls a function not overloaded here, does not compile (the error asks for
// score_mod_grad) rather than give a derivative that silently misses a term.
#pragma once

namespace flashrt_expr {
__device__ __forceinline__ float tanhf(float x) {
    float r;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float exp2f(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float log2f(float x) {
    float r;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float expf(float x) { return exp2f(x * 1.4426950408889634f); }
__device__ __forceinline__ float logf(float x) { return log2f(x) * 0.6931471805599453f; }
__device__ __forceinline__ float tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float exp(float x) { return expf(x); }
__device__ __forceinline__ float exp2(float x) { return exp2f(x); }
__device__ __forceinline__ float log(float x) { return logf(x); }
__device__ __forceinline__ float log2(float x) { return log2f(x); }
}  // namespace flashrt_expr

namespace flashrt_dual {

struct Dual {
    float v, d;  // value, derivative in s
    __device__ __forceinline__ Dual(float x = 0.f) : v(x), d(0.f) {}  // (a constant: also from int, double, bool)
    __device__ __forceinline__ Dual(float x, float dx) : v(x), d(dx) {}
};

#define FRT_DUAL __device__ __forceinline__ Dual
FRT_DUAL operator+(Dual a) { return a; }
FRT_DUAL operator-(Dual a) { return Dual(-a.v, -a.d); }
FRT_DUAL operator+(Dual a, Dual b) { return Dual(a.v + b.v, a.d + b.d); }
FRT_DUAL operator-(Dual a, Dual b) { return Dual(a.v - b.v, a.d - b.d); }
FRT_DUAL operator*(Dual a, Dual b) { return Dual(a.v * b.v, a.d * b.v + a.v * b.d); }
FRT_DUAL operator/(Dual a, Dual b) { return Dual(a.v / b.v, (a.d * b.v - a.v * b.d) / (b.v * b.v)); }
#define FRT_DUAL_COMPARE(op) \
    __device__ __forceinline__ bool operator op(Dual a, Dual b) { return a.v op b.v; }
FRT_DUAL_COMPARE(<)
FRT_DUAL_COMPARE(<=)
FRT_DUAL_COMPARE(>)
FRT_DUAL_COMPARE(>=)
FRT_DUAL_COMPARE(==)
FRT_DUAL_COMPARE(!=)
#undef FRT_DUAL_COMPARE

// f(a) with f'(a) = df (evaluated by the caller at a.v).
__device__ __forceinline__ Dual chain(float f, float df, Dual a) { return Dual(f, df * a.d); }

// Each function under its float, double and CUDA names (an expression written for floats calls tanhf or tanh alike).
#define FRT_DUAL_UNARY(name, value, slope) \
    FRT_DUAL name(Dual a) { const float x = a.v, f = (value); return chain(f, (slope), a); }
#define FRT_DUAL_UNARY2(fname, dname, value, slope) \
    FRT_DUAL_UNARY(fname, value, slope)            \
    FRT_DUAL_UNARY(dname, value, slope)
FRT_DUAL_UNARY2(tanhf, tanh, flashrt_expr::tanhf(x), 1.f - f * f)
FRT_DUAL_UNARY2(expf, exp, flashrt_expr::expf(x), f)
FRT_DUAL_UNARY(__expf, ::__expf(x), f)
FRT_DUAL_UNARY2(exp2f, exp2, flashrt_expr::exp2f(x), f * 0.6931471805599453f)
FRT_DUAL_UNARY2(expm1f, expm1, ::expm1f(x), f + 1.f)
FRT_DUAL_UNARY2(logf, log, flashrt_expr::logf(x), 1.f / x)
FRT_DUAL_UNARY(__logf, ::__logf(x), 1.f / x)
FRT_DUAL_UNARY2(log2f, log2, flashrt_expr::log2f(x), 1.4426950408889634f / x)
FRT_DUAL_UNARY2(log10f, log10, ::log10f(x), 0.4342944819032518f / x)
FRT_DUAL_UNARY2(log1pf, log1p, ::log1pf(x), 1.f / (1.f + x))
FRT_DUAL_UNARY2(sqrtf, sqrt, ::sqrtf(x), 0.5f / f)
FRT_DUAL_UNARY(rsqrtf, ::rsqrtf(x), -0.5f * f * f * f)
FRT_DUAL_UNARY2(fabsf, fabs, ::fabsf(x), x < 0.f ? -1.f : 1.f)
FRT_DUAL_UNARY(abs, ::fabsf(x), x < 0.f ? -1.f : 1.f)
FRT_DUAL_UNARY2(sinf, sin, ::sinf(x), ::cosf(x))
FRT_DUAL_UNARY2(cosf, cos, ::cosf(x), -::sinf(x))
FRT_DUAL_UNARY2(atanf, atan, ::atanf(x), 1.f / (1.f + x * x))
FRT_DUAL_UNARY2(sinhf, sinh, ::sinhf(x), ::coshf(x))
FRT_DUAL_UNARY2(coshf, cosh, ::coshf(x), ::sinhf(x))
FRT_DUAL_UNARY2(erff, erf, ::erff(x), 1.1283791670955126f * ::expf(-x * x))
FRT_DUAL_UNARY2(floorf, floor, ::floorf(x), 0.f)
FRT_DUAL_UNARY2(ceilf, ceil, ::ceilf(x), 0.f)
FRT_DUAL_UNARY2(roundf, round, ::roundf(x), 0.f)
#undef FRT_DUAL_UNARY2
#undef FRT_DUAL_UNARY

// The larger / smaller argument, with its derivative (ties: the first; a NaN loses, as CUDA's fmaxf has it).
#define FRT_DUAL_PICK(name, op) \
    FRT_DUAL name(Dual a, Dual b) { return a.v op b.v || a.v == b.v || b.v != b.v ? a : b; }
FRT_DUAL_PICK(fmaxf, >)
FRT_DUAL_PICK(fmax, >)
FRT_DUAL_PICK(max, >)
FRT_DUAL_PICK(fminf, <)
FRT_DUAL_PICK(fmin, <)
FRT_DUAL_PICK(min, <)
#undef FRT_DUAL_PICK

// a^b: a constant exponent differentiates without log a (a <= 0 allowed).
#define FRT_DUAL_POW(name)                                                                   \
    FRT_DUAL name(Dual a, Dual b) {                                                          \
        const float f = ::powf(a.v, b.v);                                                    \
        const float da = a.d == 0.f ? 0.f : b.v * ::powf(a.v, b.v - 1.f) * a.d;              \
        return Dual(f, b.d == 0.f ? da : da + f * ::logf(a.v) * b.d);                        \
    }
FRT_DUAL_POW(powf)
FRT_DUAL_POW(pow)
#undef FRT_DUAL_POW
__device__ __forceinline__ Dual fmaf(Dual a, Dual b, Dual c) { return a * b + c; }
__device__ __forceinline__ Dual fma(Dual a, Dual b, Dual c) { return a * b + c; }
__device__ __forceinline__ Dual __fdividef(Dual a, Dual b) {
    return Dual(::__fdividef(a.v, b.v), (a.d * b.v - a.v * b.d) / (b.v * b.v));
}
// a^n for an int n, as CUDA's pow(float, int) computes it (the forward's value, bitwise).
__device__ __forceinline__ Dual pow(Dual a, int n) {
    return Dual(::pow(a.v, n), n == 0 ? 0.f : (float)n * ::pow(a.v, n - 1) * a.d);
}
#undef FRT_DUAL

// The gradient of a float score tensor (bwd_dq.cu's FRT_SCORE_TGRAD pass; flashrt/spec.py: score_mod_source writes
// flashrt_score_mod_tgrad): the expression is evaluated once per read of the tensors whose gradient is wanted, with
// s a plain float; in evaluation number `target`, the target-th such read returns its value with derivative 1 and
// records where its gradient element is, every other read derivative 0. The result's derivative is then df / dT[i]
// for that read, which the caller adds dz times into T's gradient at i; the evaluations stop when a pass makes no
// more reads than its target (a read under a branch not taken is not counted: its derivative is 0 there).
// A read outside the tensor (an expression's bug: the forward reads memory it does not own there) reads 0 and adds
// nothing, so that the gradient pass never writes outside its arrays.
struct Reads {
    int target, count = 0;
    bool hit = false;      // the target read happened
    void* grad = nullptr;  // its tensor's gradient (null: the read was outside the tensor), and the element read
    long long index = 0;
};
struct Seeded {
    const float* p;
    void* grad;  // the tensor's gradient (score_mod.cuh: tensor_grad_add)
    long long n;  // its elements
    Reads* reads;
    __device__ __forceinline__ Dual operator[](long long i) const {
        const bool hit = reads->count++ == reads->target, inside = i >= 0 && i < n;
        if (hit) reads->hit = true, reads->grad = inside ? grad : nullptr, reads->index = i;
        return Dual(inside ? p[i] : 0.f, hit ? 1.f : 0.f);
    }
};

}  // namespace flashrt_dual
