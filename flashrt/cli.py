"""Command line: flashrt prewarm | cache info | cache export | cache clear | check | info.

Also `python -m flashrt ...` (flashrt/__main__.py). An error in the arguments (or in a manifest) is one line on
stderr and exit status 2, as argparse's own; a failure while working (NVRTC missing, a compile error) is its message
on stderr, without a traceback, and exit status 1.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import sys
import time
from pathlib import Path

from . import _env, cache, nvrtc, tiles
from ._version import __version__
from .spec import (ARCH_RE, DTYPES, ELEMENTWISE, FAMILIES, HEAD_DIMS, NO_INPUTS, PACKED_ROWS, SOFTCAP_FAMILIES,
                   KernelSpec)

# Opt-in shared memory per block of each arch's flagship parts (CUDA programming guide, compute
# capabilities table); used to pick tiles when compiling for a GPU that is not present.
SMEM_OPTIN = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
              120: 101376, 121: 101376}
_GENERATIONS = {50: "Maxwell", 52: "Maxwell", 53: "Maxwell", 60: "Pascal", 61: "Pascal", 62: "Pascal", 70: "Volta",
                72: "Volta", 75: "Turing"}
MASK_NAMES = cache.MASK_NAMES  # --masks: name -> spec.MASK_BITS bit ("causal": KernelSpec.causal)


class CliError(Exception):
    """A mistake in the command line or its inputs: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block) and exit status 2."""

    def error(self, message):
        raise CliError(f"{self.prog}: error: {message}")


def gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, or no device
        return 0


# ---------------------------------------------------------------------------
# Argument types: each raises argparse.ArgumentTypeError, which _Parser turns into one line and exit 2
# ---------------------------------------------------------------------------
def arch_type(text: str) -> str:
    """--arch: sm_80, sm_86, sm_89, sm_90a, ... (case-insensitive: SM_90A is sm_90a)."""
    arch = text.strip().lower()
    known = ", ".join(f"sm_{cc}" + ("a" if cc == 90 else "") for cc in SMEM_OPTIN)
    m = ARCH_RE.fullmatch(arch)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU arch; name one like sm_80 or sm_90a ({known})")
    cc, suffix = int(m.group(1)), m.group(2)
    if cc < 80:
        generation = _GENERATIONS.get(cc)
        raise argparse.ArgumentTypeError(
            f"flashrt needs sm_80 or newer (Ampere, Ada, Hopper); {arch} is "
            + (f"{generation}" if generation else "not a CUDA arch") + f": use one of {known}")
    if cc == 90 and not suffix:
        raise argparse.ArgumentTypeError("Hopper GPUs (H100, H200) run flashrt's sm_90a kernels, never sm_90 ones: "
                                         "use --arch sm_90a")
    if suffix and cc != 90:
        raise argparse.ArgumentTypeError(f"{arch}: flashrt has no arch-specific ('a') kernels for sm_{cc}; "
                                         f"use --arch sm_{cc}")
    if cc not in SMEM_OPTIN:
        raise argparse.ArgumentTypeError(f"flashrt has no shared-memory table entry for {arch}; known: {known}")
    return arch


def head_dims_type(text: str) -> list[int]:
    dims = []
    for item in text.split(","):
        item = item.strip()
        try:
            d = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a head dim; head dims are multiples of 8 up to 256, "
                                             f"comma-separated (64,128)") from None
        if d not in HEAD_DIMS:
            raise argparse.ArgumentTypeError(f"unsupported head dim {d}; head dims are multiples of 8 up to 256")
        dims.append(d)
    return dims


def dtypes_type(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no dtype given; choose from {', '.join(DTYPES)} (comma-separated)")
    bad = [n for n in names if n not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"unsupported dtype {', '.join(bad)}; choose from {', '.join(DTYPES)}")
    return names


def masks_type(text: str) -> list[str]:
    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no mask given; choose from {', '.join(MASK_NAMES)}")
    if any(n in ("mod", "mask_mod") for n in names):
        raise argparse.ArgumentTypeError("mask_mod cannot be prewarmed by kind (its expression is part of the "
                                         "variant): record a manifest with FLASHRT_RECORD=<path> and use --manifest")
    bad = [n for n in names if n not in MASK_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown mask {', '.join(bad)}; choose from {', '.join(MASK_NAMES)}")
    return list(dict.fromkeys(names))


def jobs_type(text: str) -> int:
    try:
        jobs = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if jobs < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {jobs}")
    return jobs


# ---------------------------------------------------------------------------
# What to compile
# ---------------------------------------------------------------------------
def _target(arch: str | None) -> tuple[str, int]:
    """(arch, smem limit) to compile for: the named arch, else GPU 0."""
    if arch:
        _check_nvrtc_arch(arch)
        if gpu_count():
            from . import launch
            dev = launch.device(0)
            if dev.arch == arch:
                return arch, dev.smem_optin
        return arch, SMEM_OPTIN[int(arch[3:].rstrip("a"))]
    if not gpu_count():
        raise CliError("flashrt prewarm: error: no CUDA GPU found; name the GPU to compile for with --arch "
                       "(sm_80 A100, sm_86/sm_89 RTX 30xx/40xx, sm_90a H100/H200)")
    from . import launch
    dev = launch.device(0)
    return dev.arch, dev.smem_optin


def _check_nvrtc_arch(arch: str) -> None:
    try:
        nvrtc.check_arch(arch)
    except ValueError as exc:
        raise CliError(f"flashrt prewarm: error: argument --arch: {exc}") from None


def matrix(arch: str, smem_limit: int, head_dims, dtypes, masks=(), softcap: bool = False,
           alibi: bool = False, dropout: bool = False) -> list[KernelSpec]:
    """Every kernel the forward and backward passes may launch for these head_dims and dtypes, causal or not; with
    `masks` (MASK_NAMES), also every kernel of every combination of them (causal and not only if "causal" is named:
    the unmasked ones are always both); with `softcap` / `alibi` / `dropout`, also the softcapped / ALiBi / dropout ones
    (spec.SOFTCAP_FAMILIES, DROPOUT_FAMILIES, dropout's draws of 8 and 16 bits; one of them per kernel). mask_mod's
    kernels need their expression: a manifest prewarms them."""
    bits = [MASK_NAMES[n] for n in masks if n != "causal"]
    combos = [(0, c) for c in (False, True)]
    combos += [(sum(subset), c) for r in range(1, len(bits) + 1) for subset in itertools.combinations(bits, r)
               for c in ((False, True) if "causal" in masks else (False,))]
    # score modifications and dropout: (softcap, alibi, dropout) of the variants of a family that computes scores
    mods = [(False, False, 0)] + [(True, False, 0)] * softcap + [(False, True, 0)] * alibi
    mods += [(False, False, 8), (False, False, 16)] * dropout  # (dropout's draws: spec.dropout_resolution)
    # (mask_mod's classifiers need an expression)
    # (and the tilings for long query sequences, tiles.long_rows)
    def kernel_dims(family):  # a wgmma family's kernel for a head_dim it pads: the instance's (tiles.sm90_head_dim);
        # the backward's helper kernels take the instance of the kernel they serve (api._backward_plan: DK)
        dims = {tiles.sm90_head_dim(family, d) for d in head_dims}
        if family in ELEMENTWISE and family.startswith("bwd_") and arch == "sm_90a":
            dims |= {tiles.sm90_head_dim(g, d) for g in ("bwd_dkdv_sm90", "bwd_fused_sm90") for d in head_dims}
        return dims

    specs = {tiles.tiling(f, d, t, c, arch, smem_limit, mask, softcap=cap, alibi=ali, long=long, dropout=drop)
             for mask, c in combos for f in set(FAMILIES) - set(NO_INPUTS) - set(PACKED_ROWS) for d in kernel_dims(f)
             for t in dtypes for cap, ali, drop in (mods if f in SOFTCAP_FAMILIES else mods[:1])
             for long in (False, True)[:1 + tiles.long_rows(f, d, 1 << 30)]
             if tiles.applies(f, d, arch, mask, cap, ali, dropout=drop) and not (mask and f in ELEMENTWISE)
             and f not in ("combine_f32", "combine_rows_f32")}
    # (fwd_sm90_ws at a head_dim it pads: S and O over that head_dim's columns, tiles.qk_width and v_width, as
    # api._kernel_for picks it)
    def widths(s, d):
        return dataclasses.replace(s, qk_width=tiles.qk_width(s.family, s.head_dim, d),
                                   v_width=tiles.v_width(s.family, s.head_dim, d))
    specs = {s for s in specs if s.family != "fwd_sm90_ws"} | {
        widths(s, d) for s in specs if s.family == "fwd_sm90_ws" for d in head_dims
        if tiles.sm90_head_dim(s.family, d) == s.head_dim}
    # (flashrt.combine of fp32 parts: no 16-bit dtype, compiled as bf16 whatever the dtypes)
    specs.update(tiles.tiling(f, 256, "bf16", False, arch, smem_limit) for f in ("combine_f32", "combine_rows_f32"))
    specs.update(s for d in head_dims for t in dtypes for cap, ali, drop in mods if not drop
                 for s in tiles.decode_variants(d, t, arch, smem_limit, cap, ali))
    specs.add(tiles.check_spec(arch))
    return sorted(specs, key=lambda s: s.name)


def manifest_specs(path: str, arch: str | None = None) -> list[KernelSpec]:
    """The variants of a manifest (FLASHRT_RECORD, flashrt cache export), each on `arch` if given (the recorded arch
    otherwise); CliError with one line per bad entry."""
    if not Path(path).expanduser().is_file():
        raise CliError(f"flashrt prewarm: error: no manifest at {path}; record one by running the workload with "
                       f"FLASHRT_RECORD={path}, or write one with: flashrt cache export {path}")
    try:
        entries = cache.read_manifest(Path(path).expanduser())
    except (OSError, ValueError) as exc:
        raise CliError(f"flashrt prewarm: error: {exc}") from None
    if not entries:
        raise CliError(f"flashrt prewarm: error: the manifest {path} holds no variants")
    specs, errors = {}, []
    for i, fields in enumerate(entries, 1):
        if arch is not None and isinstance(fields, dict):
            fields = dict(fields, arch=arch)
        try:
            spec = cache.spec_from_fields(fields)
        except ValueError as exc:
            recorded = f" (recorded for {entries[i - 1].get('arch')})" if arch and isinstance(fields, dict) else ""
            errors.append(f"flashrt prewarm: error: {path}: entry {i}{recorded}: {exc}")
            continue
        specs[spec.name] = spec
    for a in sorted({s.arch for s in specs.values()}):
        try:
            nvrtc.check_arch(a)
        except ValueError as exc:
            errors.append(f"flashrt prewarm: error: {path}: {exc}")
    if errors:
        raise CliError("\n".join(errors))
    return [specs[n] for n in sorted(specs)]


# ---------------------------------------------------------------------------
# Compiling, with progress
# ---------------------------------------------------------------------------
class _Progress:
    """A bar updated in place (\\r) when stderr is a terminal, else a line at every ~10% (and at the end)."""

    def __init__(self, total: int, tty: bool | None = None):
        self.total, self.t0, self.step = total, time.time(), 0
        self.tty = sys.stderr.isatty() if tty is None else tty

    def __call__(self, done: int) -> None:
        elapsed = time.time() - self.t0
        if self.tty:
            width = 30
            filled = width * done // max(self.total, 1)
            sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  {elapsed:5.1f}s")
            if done == self.total:
                sys.stderr.write("\n")
        else:
            step = 10 * done // max(self.total, 1)
            if step == self.step and done != self.total:
                return
            self.step = step
            sys.stderr.write(f"  {done}/{self.total} ({100 * done // max(self.total, 1)}%)  {elapsed:.1f}s\n")
        sys.stderr.flush()


def compile_specs(specs: list[KernelSpec], jobs: int, quiet: bool = False, tty: bool | None = None) -> dict:
    """Look every variant up in the cache (compiling the missing ones) on `jobs` threads; counts by outcome."""
    t0 = time.time()
    counts = {"compiled": 0, "disk": 0, "memory": 0}
    progress = None if quiet else _Progress(len(specs), tty)
    # NVRTC is thread-safe and ctypes releases the GIL during the compile, so threads run in parallel.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = [pool.submit(cache.lookup, s) for s in specs]
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            counts[fut.result()[1]] += 1
            if progress:
                progress(i)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a failed compile: the queued ones do not start
    seconds = time.time() - t0
    if not quiet:
        print(f"compiled {counts['compiled']}, already cached {counts['disk'] + counts['memory']}, "
              f"in {seconds:.1f}s")
    return dict(counts, seconds=seconds, kernels=len(specs))


def _nvrtc_version() -> str:
    return ".".join(map(str, nvrtc.version()))


def prewarm(arch: str | None, head_dims, dtypes, jobs: int, quiet: bool = False, masks=(),
            softcap: bool = False, alibi: bool = False, dropout: bool = False) -> dict:
    arch, smem = _target(arch)
    specs = matrix(arch, smem, head_dims, dtypes, masks, softcap, alibi, dropout)
    if not quiet:
        print(f"flashrt {__version__}: {len(specs)} kernels for {arch} (NVRTC {_nvrtc_version()})"
              f", cache {cache.cache_dir()}")
    return dict(compile_specs(specs, jobs, quiet), arch=arch)


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------
def _verbose_logs() -> None:
    """Show the `flashrt` logger's INFO records (each compile: variant and seconds) on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("flashrt")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def cmd_prewarm(args) -> int:
    # prewarm compiles, whatever the shell exports for the workload; and what it compiles is no workload's record
    os.environ.pop("FLASHRT_NO_COMPILE", None)
    os.environ.pop("FLASHRT_RECORD", None)
    if args.verbose:
        _verbose_logs()
    tty = False if args.verbose else None  # log lines and an in-place bar do not mix
    if args.manifest is not None:
        given = [o for o, v in (("--head-dims", args.head_dims), ("--dtypes", args.dtypes), ("--masks", args.masks),
                                 ("--softcap", args.softcap or None), ("--alibi", args.alibi or None),
                                 ("--dropout", args.dropout or None))
                 if v is not None]
        if given:
            raise CliError(f"flashrt prewarm: error: --manifest compiles exactly the manifest's variants; drop "
                           f"{' and '.join(given)}")
        if args.arch:
            _check_nvrtc_arch(args.arch)
        specs = manifest_specs(args.manifest, args.arch)
        archs = sorted({s.arch for s in specs})
        label = f"from {args.manifest} for {', '.join(archs)}"
    else:
        head_dims = args.head_dims if args.head_dims is not None else list(HEAD_DIMS)
        dtypes = args.dtypes if args.dtypes is not None else list(DTYPES)
        arch, smem = _target(args.arch)
        specs = matrix(arch, smem, head_dims, dtypes, args.masks or (), args.softcap, args.alibi, args.dropout)
        label = f"for {arch}"
    if args.list:
        for s in specs:
            print(s.name)
        return 0
    print(f"flashrt {__version__}: {len(specs)} kernels {label} (NVRTC {_nvrtc_version()}), "
          f"cache {cache.cache_dir()}")
    compile_specs(specs, args.jobs, tty=tty)
    return 0


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def cmd_cache_info(args) -> int:
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
            by_arch[str(h.get("arch"))] = by_arch.get(str(h.get("arch")), 0) + 1
    for arch, n in sorted(by_arch.items()):
        print(f"  {arch}: {n}")
    if args.verbose:
        for p, h in entries:
            state = "UNUSABLE" if h is None else \
                f"flashrt {h.get('flashrt')}, nvrtc {h.get('nvrtc')}, {h.get('compile_s')}s"
            print(f"  {p.name}  {state}" + ("  STALE" if p in stale else ""))
    return 0


def cmd_cache_clear(args) -> int:
    removed = cache.clear_counts(stale_only=args.stale)
    others = f" (and {_plural(removed['other'], 'lock, temp or source file')})" if removed["other"] else ""
    print(f"removed {_plural(removed['entries'], 'entry', 'entries')}"
          f"{others} from {cache.cache_dir()}")
    return 0


def cmd_cache_export(args) -> int:
    variants, skipped = cache.exported(args.arch)
    notes = [f"{n} {why}" for why, n in (("stale (another flashrt, kernel source or NVRTC)", skipped["stale"]),
                                          ("unusable", skipped["unusable"]),
                                          ("without a recorded variant (older entries)", skipped["no_spec"]),
                                          (f"for another arch than {args.arch}", skipped["other_arch"])) if n]
    skipped_text = f"; skipped: {', '.join(notes)}" if notes else ""
    if not variants:
        raise CliError(f"flashrt cache export: error: no usable entries in {cache.cache_dir()}"
                       + (f" for {args.arch}" if args.arch else "") + f"; nothing written{skipped_text}")
    try:
        cache.write_manifest(args.path, variants)
    except OSError as exc:
        raise CliError(f"flashrt cache export: error: cannot write {args.path} ({exc.strerror or exc})") from None
    print(f"wrote {_plural(len(variants), 'variant')} to {args.path}{skipped_text}")
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def info_lines() -> list[str]:
    """`flashrt info`: what a bug report needs. Works without a GPU, CuPy, NVRTC or torch (says which is missing)."""
    import platform
    from . import launch
    lines = [f"flashrt {__version__} ({Path(__file__).resolve().parent})",
             f"Python {platform.python_version()} ({sys.executable}), {platform.platform()}"]
    try:
        import cupy
    except Exception as exc:  # not installed, or broken
        cupy = None
        lines.append(f"CuPy: not importable ({_first_line(exc)}); pip install \"flashrt[cuda12]\" or "
                     f"\"flashrt[cuda13]\"")
    else:
        try:
            runtime = f"CUDA runtime {_cuda_version(cupy.cuda.runtime.runtimeGetVersion())}"
        except Exception as exc:
            runtime = f"CUDA runtime unknown ({_first_line(exc)})"
        lines.append(f"CuPy {cupy.__version__}, {runtime}")
    try:
        version, path = nvrtc.version(), nvrtc.library_path()
        choice = getattr(nvrtc, "choice", None)
        reason = choice()[2] if choice else ""
        lines.append(f"NVRTC {version[0]}.{version[1]} ({path})" + (f", {reason}" if reason else ""))
    except Exception as exc:
        version = None
        lines.append(f"NVRTC: unavailable ({_first_line(exc)})")
    gpus = []
    if cupy is None:
        lines.append("CUDA driver: unknown (no CuPy); GPUs: unknown")
    else:
        try:
            driver = cupy.cuda.runtime.driverGetVersion()
        except Exception as exc:
            driver = 0
            lines.append(f"CUDA driver: unknown ({_first_line(exc)})")
        else:
            lines.append(f"CUDA driver: supports CUDA {_cuda_version(driver)}" if driver else
                         "CUDA driver: none found (no NVIDIA driver on this machine)")
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            count, why = 0, f" ({_first_line(exc)})"
        else:
            why = ""
        for i in range(count):
            try:
                props = cupy.cuda.runtime.getDeviceProperties(i)
                name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
                arch = launch.arch_for(props["major"], props["minor"])
                gpus.append(f"  GPU {i}: {name}, {arch} ({props['multiProcessorCount']} SMs, "
                            f"{props['sharedMemPerBlockOptin'] // 1024} KiB shared memory per block)")
            except Exception as exc:
                gpus.append(f"  GPU {i}: unreadable ({_first_line(exc)})")
        lines.append(f"GPUs: {count}" if count else f"GPUs: none{why}")
        lines += gpus
        if driver and version:
            try:
                launch.check_driver(driver, version)
            except launch.LaunchError as exc:
                lines.append(f"  driver problem: {exc}")
    try:
        import torch
    except ImportError:
        lines.append("torch: not installed (optional: flashrt.attention and flashrt.torch need it)")
    except Exception as exc:
        lines.append(f"torch: not importable ({_first_line(exc)})")
    else:
        try:
            gpu = "sees a GPU" if torch.cuda.is_available() else "sees no GPU"
        except Exception as exc:
            gpu = f"GPU unknown ({_first_line(exc)})"
        lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpu}")
    d = cache.cache_dir()
    files = cache.entry_files()
    size = sum(f.stat().st_size for f in files if f.is_file())
    lines.append(f"cache: {d}: {_plural(len(files), 'entry', 'entries')}, {size / 2**20:.1f} MiB"
                 + ("" if d.is_dir() else " (not created yet)"))
    lines.append("environment:")
    for name, doc in _env.VARIABLES.items():
        value = os.environ.get(name)
        lines.append(f"  {name}={value}" if value is not None else f"  {name} (unset)")
        lines.append(f"      {' '.join((doc or '').split())}")
    for name in sorted(k for k in os.environ if k.startswith("FLASHRT_") and k not in _env.VARIABLES):
        lines.append(f"  {name}={os.environ[name]}  (not a flashrt variable: ignored)")
    return lines


def cmd_info(args) -> int:
    for line in info_lines():
        print(line)
    return 0


_PREWARM_EPILOG = """\
choosing what to compile:
  by kind     flashrt prewarm --arch sm_90a --head-dims 64,128 --dtypes bf16 [--masks causal,window]
              (--masks adds the masked variants of every combination of the named masks, of the chosen
              head dims and dtypes: causal, window, lengths, ids (block ids), segments; causal variants
              of masked kernels only when causal is named. mask_mod cannot be prewarmed by kind: its
              expression is part of the variant; record a manifest.)
  exactly what a workload uses
              run the workload once with FLASHRT_RECORD=/path/manifest.json (on a machine that runs it:
              every variant it looks up is added to that JSON file), then, here:
              flashrt prewarm --manifest /path/manifest.json [--arch sm_90a]
  what a cache holds
              flashrt cache export /path/manifest.json, then prewarm --manifest elsewhere
Then FLASHRT_NO_COMPILE=1 in the workload proves the cache covers it (a miss raises flashrt.cache.CacheMiss).
prewarm itself ignores FLASHRT_NO_COMPILE and FLASHRT_RECORD.

output: a progress bar updated in place when stderr is a terminal, else a line at every ~10%.
Every compile logs its variant and seconds at INFO on the 'flashrt' logger (-v shows them here;
in Python: logging.basicConfig(level=logging.INFO)).
"""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flashrt", description="FlashAttention kernels compiled at run time by NVRTC, cached on "
                                                 "disk. Argument errors: one line, exit status 2.")
    parser.add_argument("--version", action="version", version=f"flashrt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{prewarm,cache,check,info}")

    p = sub.add_parser("prewarm", help="compile kernels into the cache ahead of time", epilog=_PREWARM_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Compile kernels into the cache (FLASHRT_CACHE_DIR), by kind or from a manifest.")
    p.add_argument("--arch", type=arch_type, help="target GPU arch: sm_80, sm_86, sm_89, sm_90a, ... "
                                                  "(case-insensitive); default: GPU 0, or with --manifest, the "
                                                  "recorded arch (--arch replaces it)")
    p.add_argument("--head-dims", type=head_dims_type, default=None,
                   help="comma-separated multiples of 8 up to 256; default: all of them")
    p.add_argument("--dtypes", type=dtypes_type, default=None, help="comma-separated: bf16, fp16 (default both)")
    p.add_argument("--masks", type=masks_type, default=None,
                   help=f"also the masked variants: comma-separated {', '.join(MASK_NAMES)} (not mask_mod: see "
                        f"--manifest)")
    p.add_argument("--softcap", action="store_true", help="also the variants with a softcap (flashrt.forward's "
                                                          "softcap=)")
    p.add_argument("--alibi", action="store_true", help="also the variants with ALiBi (flashrt.forward's "
                                                        "alibi_slopes=)")
    p.add_argument("--dropout", action="store_true", help="also the variants with dropout (flashrt.forward's "
                                                          "dropout_p=)")
    p.add_argument("--manifest", metavar="PATH", help="compile exactly the variants of this JSON manifest "
                                                      "(FLASHRT_RECORD, flashrt cache export)")
    p.add_argument("--jobs", type=jobs_type, default=os.cpu_count() or 1, help="compiles at once (default: CPUs)")
    p.add_argument("--list", action="store_true", help="print the variants' names and compile nothing")
    p.add_argument("-v", "--verbose", action="store_true", help="log each compile (variant, seconds) on stderr")
    p.set_defaults(fn=cmd_prewarm)

    p = sub.add_parser("cache", help="inspect, export or clear the kernel cache")
    actions = p.add_subparsers(dest="action", required=True, metavar="{info,export,clear}")
    a = actions.add_parser("info", help="entries per arch; unusable and stale ones")
    a.add_argument("-v", "--verbose", action="store_true", help="every entry")
    a.set_defaults(fn=cmd_cache_info)
    a = actions.add_parser("export", help="write the manifest of every usable variant in the cache",
                           description="Write a JSON manifest of every variant the cache holds, for flashrt "
                                       "prewarm --manifest on another machine or cache. Skipped: stale entries "
                                       "(another flashrt, kernel source or NVRTC), corrupt ones, and older "
                                       "entries whose header does not record their variant.")
    a.add_argument("path", help="the manifest file to write (replaced atomically)")
    a.add_argument("--arch", type=arch_type, help="only the variants for this arch")
    a.set_defaults(fn=cmd_cache_export)
    a = actions.add_parser("clear", help="remove cache entries (and their lock files)")
    a.add_argument("--stale", action="store_true", help="only the entries this flashrt cannot use")
    a.set_defaults(fn=cmd_cache_clear)

    p = sub.add_parser("check", help="run and verify attention on this GPU (or compile, without one)")
    p.add_argument("--arch", type=arch_type, help="arch to compile for when there is no GPU (default sm_90a)")
    p.add_argument("--jobs", type=jobs_type, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("info", help="versions, GPUs, NVRTC, the cache and every FLASHRT_* variable (for bug reports)")
    p.set_defaults(fn=cmd_info)
    return parser


def _stdout_gone() -> None:
    """stdout's reader left (`flashrt cache info -v | head`): send what is still buffered to /dev/null, so that
    the interpreter's last flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def main(argv=None) -> int:
    try:
        try:
            args = _parser().parse_args(argv)
            code = args.fn(args)
        finally:
            sys.stdout.flush()
        return code
    except CliError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    except BrokenPipeError:
        _stdout_gone()
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("flashrt: interrupted\n")
        return 130
    except (nvrtc.NvrtcUnavailable, nvrtc.CompileError, cache.CacheMiss, tiles.TilingError, OSError) as exc:
        sys.stderr.write(f"{'' if str(exc).startswith('flashrt') else 'flashrt: '}{exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
