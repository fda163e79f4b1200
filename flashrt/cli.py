"""Command line: flashrt prewarm | cache info | cache clear | check."""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

from . import cache, nvrtc, tiles
from ._version import __version__
from .spec import DTYPES, FAMILIES, HEAD_DIMS, NO_INPUTS, KernelSpec

# Opt-in shared memory per block of each arch's flagship parts (CUDA programming guide, compute
# capabilities table); used to pick tiles when compiling for a GPU that is not present.
SMEM_OPTIN = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
              120: 101376, 121: 101376}


def gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, or no device
        return 0


def _target(arch: str | None) -> tuple[str, int]:
    """(arch, smem limit) to compile for: the named arch, else GPU 0."""
    if arch:
        nvrtc.check_arch(arch)
        cc = int(arch[3:].rstrip("a"))
        if cc not in SMEM_OPTIN:
            raise SystemExit(f"flashrt: no shared-memory table entry for {arch}; known: "
                             + ", ".join(f"sm_{c}" for c in SMEM_OPTIN))
        if gpu_count():
            from . import launch
            dev = launch.device(0)
            if dev.arch == arch:
                return arch, dev.smem_optin
        return arch, SMEM_OPTIN[cc]
    if not gpu_count():
        raise SystemExit("flashrt: no CUDA GPU found; name the GPU to compile for with --arch "
                         "(sm_80 A100, sm_86/sm_89 RTX 30xx/40xx, sm_90a H100/H200)")
    from . import launch
    dev = launch.device(0)
    return dev.arch, dev.smem_optin


def matrix(arch: str, smem_limit: int, head_dims, dtypes) -> list[KernelSpec]:
    """Every kernel the forward and backward passes may launch for these head_dims and dtypes."""
    specs = {tiles.tiling(f, d, t, c, arch, smem_limit)  # (mask_mod's classifiers need an expression)
             for f in set(FAMILIES) - set(NO_INPUTS) for d in head_dims for t in dtypes for c in (False, True)
             if tiles.applies(f, d, arch)}
    specs.add(tiles.check_spec(arch))
    return sorted(specs, key=lambda s: s.name)


def _progress(done: int, total: int, t0: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {time.time() - t0:5.1f}s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def prewarm(arch: str | None, head_dims, dtypes, jobs: int, quiet: bool = False) -> dict:
    arch, smem = _target(arch)
    specs = matrix(arch, smem, head_dims, dtypes)
    t0 = time.time()
    counts = {"compiled": 0, "disk": 0, "memory": 0}
    if not quiet:
        print(f"flashrt {__version__}: {len(specs)} kernels for {arch} (NVRTC {'.'.join(map(str, nvrtc.version()))})"
              f", cache {cache.cache_dir()}")
    # NVRTC is thread-safe and ctypes releases the GIL during the compile, so threads run in parallel.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(cache.lookup, s) for s in specs]
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            counts[fut.result()[1]] += 1
            if not quiet:
                _progress(i, len(specs), t0)
    seconds = time.time() - t0
    if not quiet:
        print(f"compiled {counts['compiled']}, already cached {counts['disk'] + counts['memory']}, "
              f"in {seconds:.1f}s")
    return dict(counts, seconds=seconds, arch=arch, kernels=len(specs))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def cmd_prewarm(args) -> int:
    head_dims = _ints(args.head_dims) if args.head_dims else list(HEAD_DIMS)
    dtypes = _names(args.dtypes)
    bad = [d for d in head_dims if d not in HEAD_DIMS] + [t for t in dtypes if t not in DTYPES]
    if bad:
        raise SystemExit(f"flashrt prewarm: unsupported {bad}; head dims are multiples of 8 up to 256, "
                         f"dtypes {', '.join(DTYPES)}")
    prewarm(args.arch, head_dims, dtypes, args.jobs)
    return 0


def cmd_cache(args) -> int:
    if args.action == "clear":
        print(f"removed {cache.clear(stale_only=args.stale)} files from {cache.cache_dir()}")
        return 0
    entries = cache.entries()
    size = sum(p.stat().st_size for p, _ in entries)
    print(f"cache dir: {cache.cache_dir()}")
    print(f"entries:   {len(entries)} ({size / 2**20:.1f} MiB)")
    bad = [p for p, h in entries if h is None]
    if bad:
        print(f"unusable:  {len(bad)} (will be recompiled on use): " + ", ".join(p.name for p in bad[:5]))
    stale = {p for p, h in entries if h is not None and cache.is_stale(h)}
    if stale:
        print(f"stale:     {len(stale)} (from another flashrt version, kernel sources or NVRTC; never used by "
              f"flashrt {__version__}; remove them with: flashrt cache clear --stale)")
    by_arch: dict[str, int] = {}
    for _, h in entries:
        if h:
            by_arch[h["arch"]] = by_arch.get(h["arch"], 0) + 1
    for arch, n in sorted(by_arch.items()):
        print(f"  {arch}: {n}")
    if args.verbose:
        for p, h in entries:
            state = "UNUSABLE" if h is None else f"flashrt {h.get('flashrt')}, nvrtc {h['nvrtc']}, {h['compile_s']}s"
            print(f"  {p.name}  {state}" + ("  STALE" if p in stale else ""))
    return 0


def cmd_check(args) -> int:
    if not gpu_count():
        arch = args.arch or "sm_90a"
        print(f"flashrt check: no CUDA GPU found on this machine, so attention cannot run here.\n"
              f"Compiling the kernels for {arch} instead, to prove the NVRTC toolchain works "
              f"(pick another GPU with --arch; fill the whole cache with: flashrt prewarm --arch {arch}).")
        prewarm(arch, [64, 128], ["bf16"], args.jobs)
        return 0
    from . import check
    return check.run(quick=args.quick)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashrt", description="FlashAttention kernels compiled at run time.")
    parser.add_argument("--version", action="version", version=f"flashrt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prewarm", help="compile kernels into the cache ahead of time")
    p.add_argument("--arch", help="target GPU arch (sm_80, sm_86, sm_89, sm_90a, ...); default: GPU 0")
    p.add_argument("--head-dims", default="", help="comma-separated, default: every multiple of 8 up to 256")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.set_defaults(fn=cmd_prewarm)

    p = sub.add_parser("cache", help="inspect or clear the kernel cache")
    p.add_argument("action", choices=["info", "clear"])
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--stale", action="store_true", help="clear: only the entries this flashrt cannot use")
    p.set_defaults(fn=cmd_cache)

    p = sub.add_parser("check", help="run and verify attention on this GPU (or compile, without one)")
    p.add_argument("--arch", help="arch to compile for when there is no GPU (default sm_90a)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.set_defaults(fn=cmd_check)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
