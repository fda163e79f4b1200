"""cp.async into shared rows of three layouts, alone (no math): 16-byte chunks of 64-row tiles (128- or 256-byte rows, a
global row stride of 8 such rows, as a (B, S, 8, D) cache's), a 3-stage ring per block, 512 blocks of 128 threads:
rows at their own width ("plain"), padded by 16 bytes (the padded tiles' Pitch), or plain width with chunk c of row r at
c ^ (r & 7) ("swizzled", common.cuh: chunk_at). Prints us and TB/s per layout; under ncu (ONE=1: one launch each)
l1tex__m_xbar2l1tex_read_sectors.sum shows what L1 fetched from L2 (docs/perf-notes.md, Decode: the loader).
Needs CuPy only: python scripts/probes/cp_async_pitch.py"""
import os

import cupy as cp

ONE = os.environ.get("ONE") == "1"
SOURCE = r"""
extern "C" __global__ void copy_tiles(const char* g, long long gs, int tiles, int pitch, int rowb, int swz,
                                      int* sink) {
    extern __shared__ __align__(128) char sm[];
    const int tid = threadIdx.x, cpr = rowb / 16, rs = 128 / cpr;
    const char* base = g + (long long)blockIdx.x * tiles * 64 * gs;
    const int stage_bytes = 64 * pitch;
    auto load = [&](int t) {
        for (int r = tid / cpr; r < 64; r += rs) {
            const int c = tid % cpr, cs = swz ? (c ^ (r & 7)) : c;
            const unsigned dst = (unsigned)__cvta_generic_to_shared(sm + (t % 3) * stage_bytes + r * pitch + cs * 16);
            const char* src = base + ((long long)t * 64 + r) * gs + c * 16;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src));
        }
        asm volatile("cp.async.commit_group;\n");
    };
    load(0), load(1);
    int acc = 0;
    for (int t = 0; t < tiles; ++t) {
        asm volatile("cp.async.wait_group 1;\n");
        __syncthreads();
        acc += sm[(t % 3) * stage_bytes + tid];
        __syncthreads();
        if (t + 2 < tiles) load(t + 2);
        else asm volatile("cp.async.commit_group;\n");
    }
    if (acc == 12345) sink[0] = acc;  // (keeps the reads)
}
"""


def main() -> None:
    kernel = cp.RawModule(code=SOURCE, options=("-std=c++17",)).get_function("copy_tiles")
    blocks, tiles = 512, 64
    sink = cp.zeros(1, cp.int32)
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for rowb in (128, 256):
        gs = 8 * rowb
        g = cp.zeros(blocks * tiles * 64 * gs, cp.uint8)
        for name, pitch, swz in (("plain", rowb, 0), ("padded", rowb + 16, 0), ("swizzled", rowb, 1)):
            smem = 3 * 64 * pitch
            kernel.max_dynamic_shared_size_bytes = smem
            args = (g, cp.int64(gs), cp.int32(tiles), cp.int32(pitch), cp.int32(rowb), cp.int32(swz), sink)
            for _ in range(0 if ONE else 3):
                kernel((blocks,), (128,), args, shared_mem=smem)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            times = []
            for _ in range(1 if ONE else 10):
                start.record()
                kernel((blocks,), (128,), args, shared_mem=smem)
                end.record()
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end))
            ms = sorted(times)[len(times) // 2]
            print(f"{rowb}-byte rows, {name}: {ms * 1e3:.1f} us, {blocks * tiles * 64 * rowb / ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
