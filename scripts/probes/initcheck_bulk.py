"""Does compute-sanitizer's initcheck see the global writes of cp.async.bulk (the bulk-copy unit)? One buffer written
by a bulk copy, one by plain stores, each read by a second kernel; the sums show both were written.

    python scripts/probes/initcheck_bulk.py
    compute-sanitizer --tool initcheck python scripts/probes/initcheck_bulk.py

H200, compute-sanitizer with CUDA 13: both sums right; initcheck flags read_bulk_store's reads (248 errors over the
buffer's 256 floats) and none of read_plain_store's. So the ordered fused backward's first dQ turns (bulk stores,
BwdParams::dq_first_store) look uninitialised to it: scripts/sanitize.sh runs initcheck with
FLASHRT_NO_DQ_FIRST_STORE=1 (docs/perf-notes.md: Ordered grid).
"""
import cupy
src = r'''
extern "C" __global__ void bulk_store(float* g) {
    __shared__ __align__(128) float s[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) s[i] = (float)i;
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned sa = (unsigned)__cvta_generic_to_shared(s);
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                     :: "l"(g), "r"(sa), "r"(1024) : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
}
extern "C" __global__ void plain_store(float* g) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) g[i] = (float)i;
}
__device__ void read_sum(const float* g, float* out) {
    float acc = 0.f;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) acc += g[i];
    atomicAdd(out, acc);
}
// one reader per writer, so that initcheck's reports name the buffer
extern "C" __global__ void read_bulk_store(const float* g, float* out) { read_sum(g, out); }
extern "C" __global__ void read_plain_store(const float* g, float* out) { read_sum(g, out); }
'''
mod = cupy.RawModule(code=src, options=("-arch=sm_90a",))
for name, n in (("bulk_store", 256), ("plain_store", 512)):
    buf = cupy.empty(n, dtype=cupy.float32)
    out = cupy.zeros(1, dtype=cupy.float32)
    mod.get_function(name)((1,), (128,), (buf,))
    mod.get_function("read_" + name)((1,), (128,), (buf, out))
    cupy.cuda.runtime.deviceSynchronize()
    print(f"{name}: sum {float(out[0])} (expected 32640)", flush=True)
