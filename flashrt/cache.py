"""On-disk cache of compiled cubins.

Location: FLASHRT_CACHE_DIR, else the platformdirs user cache dir.

An entry is one file, `<variant name>-<key prefix>.cubin`: a magic line, a JSON
header line (key, payload sha256 and size, NVRTC version, options, timing) and
the cubin. The key hashes the flashrt version, the kernel text the variant compiles
(its family's file with every include expanded, and its translation unit), the
variant's parameters, the NVRTC options, the NVRTC version and the arch, so any
change to any of them is a miss, never a stale hit; an edit to one file misses
only the variants that include it.

Life cycle of a lookup (as FlashInfer's JIT does it): memory -> disk -> lock ->
disk again -> compile -> atomic write (temp file in the same folder, then
os.replace). An entry that fails its checksum, or whose cubin is for another
SM, is recompiled with a warning and never loaded. Several processes may
compile the same variant at once: each either waits on the entry's lock or
writes an identical file atomically, so a lock is only there to save work: a
wait longer than LOCK_TIMEOUT_S warns, naming the lock file, and compiles
anyway. A cache folder that cannot be written (read-only, full) falls back to
compiling in memory, with one warning.

Every compile logs its variant and seconds at INFO on the `flashrt` logger. With FLASHRT_RECORD=<path>, every
variant a process looks up (first lookup in the process: a memory miss) is merged into the JSON manifest at <path>
(a list of KernelSpec field dicts, read-merge-written under an flock of `<path>.lock`, written atomically), which
`flashrt prewarm --manifest <path>` compiles.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
import warnings
from functools import lru_cache
from pathlib import Path

from . import _env, nvrtc, params, tiles
from ._version import __version__
from .spec import MASK_BITS, KernelSpec

try:
    import fcntl
except ImportError:  # Windows: no lock; atomic writes still keep entries whole, a kernel may compile twice
    fcntl = None

log = logging.getLogger("flashrt")

_MAGIC = b"FLASHRT-CUBIN 1\n"
_SUFFIX = ".cubin"
# The biggest kernel compiles in seconds, even 16 at once on 2 cores: waiting this long on another
# process's lock means that process is hung (a dead one has no lock: flock locks die with their process).
LOCK_TIMEOUT_S = 300.0
SLOW_COMPILE_S = 60.0  # a compile still running after this long is reported, so a hang is never silent


class CacheMiss(RuntimeError):
    """A kernel is not cached and FLASHRT_NO_COMPILE=1 forbids compiling it."""


class CacheWarning(UserWarning):
    pass


# ---------------------------------------------------------------------------
# Kernel sources
# ---------------------------------------------------------------------------
def kernels_dir() -> Path:
    """kernels_cu/ inside the installed package, or beside it in a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "attention" / "params.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"flashrt's kernel sources (kernels_cu/) are missing next to {here}; reinstall flashrt")


@lru_cache(maxsize=None)
def kernel_sources() -> dict[str, str]:
    """Every kernel source file by its path under kernels_cu/ ("attention/params.cuh": the name an #include
    gives), and the generated params.TABLES_HEADER; passed to NVRTC as in-memory headers."""
    d = kernels_dir()
    files = {p.relative_to(d).as_posix(): p.read_text() for p in sorted(d.rglob("*")) if p.suffix in (".cu", ".cuh")}
    return {**files, params.TABLES_HEADER: params.tables_header()}


@lru_cache(maxsize=None)
def source_hash(source_file: str) -> str:
    """sha256 of a family's source file with its includes expanded (nvrtc.full_source): exactly the kernel text a
    variant of it compiles, so that editing one file misses only the variants that include it."""
    text = nvrtc.full_source(f'#include "{source_file}"\n', "key", [], kernel_sources())
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------
# Keys and paths
# ---------------------------------------------------------------------------
def cache_dir() -> Path:
    override = _env.cache_dir()
    if override:
        return Path(override).expanduser()
    import platformdirs
    return Path(platformdirs.user_cache_dir("flashrt", appauthor=False))


def entry_key(spec: KernelSpec) -> str:
    fields = {
        "flashrt": __version__,
        "sources": source_hash(spec.source_file),
        "unit": spec.translation_unit(),  # the include, the params layout's asserts, a mask_mod expression
        "spec": spec.key_fields(),
        "options": spec.options(),
        "nvrtc": list(nvrtc.version()),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def entry_path(spec: KernelSpec, key: str) -> Path:
    return cache_dir() / f"{spec.name}-{key[:16]}{_SUFFIX}"


# ---------------------------------------------------------------------------
# Entry encoding
# ---------------------------------------------------------------------------
def encode_entry(key: str, cubin: bytes, meta: dict) -> bytes:
    header = dict(meta, key=key, sha256=hashlib.sha256(cubin).hexdigest(), size=len(cubin))
    return _MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + cubin


def decode_entry(raw: bytes, key: str | None = None) -> tuple[dict, bytes]:
    """(header, cubin) of a cache file; ValueError says why an entry is unusable."""
    if not raw.startswith(_MAGIC):
        raise ValueError("bad magic")
    end = raw.find(b"\n", len(_MAGIC))
    if end < 0:
        raise ValueError("truncated header")
    try:
        header = json.loads(raw[len(_MAGIC):end])
    except ValueError as exc:
        raise ValueError(f"corrupt header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"corrupt header (a JSON {type(header).__name__}, not an object)")
    cubin = raw[end + 1:]
    if len(cubin) != header.get("size"):
        raise ValueError(f"truncated payload ({len(cubin)} bytes, header says {header.get('size')})")
    if hashlib.sha256(cubin).hexdigest() != header.get("sha256"):
        raise ValueError("checksum mismatch")
    if key is not None and header.get("key") != key:
        raise ValueError("key mismatch")
    return header, cubin


# ---------------------------------------------------------------------------
# Lookup
# ---------------------------------------------------------------------------
_memory: dict[str, bytes] = {}
_key_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()
_warned: set[str] = set()


def _warn_once(tag: str, message: str) -> None:
    with _guard:
        if tag in _warned:
            return
        _warned.add(tag)
    warnings.warn(message, CacheWarning, stacklevel=3)


def _read(path: Path, key: str, spec: KernelSpec) -> bytes | None:
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        _warn_once(f"read:{path}", f"flashrt: cannot read cache entry {path} ({exc}); recompiling")
        return None
    try:
        cubin = decode_entry(raw, key)[1]
        # The key already covers the arch; this checks the payload itself, which is what the driver runs.
        sm, want = nvrtc.cubin_sm(cubin), int(spec.arch[3:].rstrip("a"))
        if sm != want:
            raise ValueError(f"its cubin is for sm_{sm}, expected sm_{want}" if sm is not None
                             else "its payload is not a CUDA ELF")
        return cubin
    except ValueError as exc:
        _warn_once(f"corrupt:{path}", f"flashrt: cache entry {path} is unusable ({exc}); recompiling it")
        return None


# `flashrt prewarm --masks` names of the mask features (spec.MASK_BITS; "causal" is KernelSpec.causal). mask_mod (and
# score_mod) has none: its expression is part of the variant, so only a manifest (FLASHRT_RECORD) prewarms it.
MASK_NAMES = {"causal": 0, "lengths": MASK_BITS["lengths"], "window": MASK_BITS["window"],
              "ids": MASK_BITS["block_ids"], "segments": MASK_BITS["segments"]}


def mask_names(spec: KernelSpec) -> list[str]:
    """The `flashrt prewarm --masks` names of a variant's mask (without mask_mod, which has none)."""
    return [n for n, bit in MASK_NAMES.items() if (spec.causal if n == "causal" else spec.mask & bit)]


def prewarm_command(spec: KernelSpec) -> str:
    """The `flashrt prewarm` command (by kind) whose variants include `spec` (not for a mask_mod: a manifest)."""
    masked = [n for n in mask_names(spec) if n != "causal"]  # the base matrix has causal and not
    return (f"flashrt prewarm --arch {spec.arch} --head-dims {spec.qk_width or spec.head_dim} --dtypes {spec.dtype}"
            + (f" --masks {','.join(mask_names(spec))}" if masked else ""))


def miss_message(spec: KernelSpec) -> str:
    expression = "mask_mod" if spec.mask_mod else "score_mod" if spec.score_mod else ""
    # (fwd_sm90_ws at a padded head_dim: the kinds' matrix holds its widths where v's head_dim is q's, cli.matrix)
    own_v = spec.head_dims or spec.v_width != tiles.v_width(spec.family, spec.head_dim, spec.qk_width or spec.head_dim)
    by_kind = (f"its {expression} expression is part of the variant, so only a manifest prewarms it"
               if expression else "its v head_dim of its own is part of the variant, so only a manifest prewarms it"
               if own_v else f"or fill the cache by kind: {prewarm_command(spec)}")
    return (f"flashrt: kernel {spec.name} is not in the cache ({cache_dir()}) and FLASHRT_NO_COMPILE=1 forbids "
            f"compiling it; record a manifest with FLASHRT_RECORD=/path/manifest.json on a machine that runs the "
            f"workload, then run: flashrt prewarm --manifest /path/manifest.json --arch {spec.arch} "
            f"(on this machine, with the same FLASHRT_CACHE_DIR); {by_kind}")


def get_cubin(spec: KernelSpec) -> bytes:
    return lookup(spec)[0]


def prefetch(specs) -> None:
    """Look up the cubins of `specs` (each at most once) at the same time, on threads (NVRTC and the file reads
    release the GIL): a call that needs several new kernels waits for its slowest compile, not for their sum. The
    first failure in the order of `specs` is raised, as looking them up one by one would raise it."""
    todo = [s for s in dict.fromkeys(specs) if _memory.get(entry_key(s)) is None]
    if len(todo) < 2:
        for spec in todo:
            lookup(spec)
        return
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 8)) as pool:
        futures = [pool.submit(lookup, spec) for spec in todo]
    for f in futures:
        f.result()


def lookup(spec: KernelSpec) -> tuple[bytes, str]:
    """(cubin, where it came from: 'memory' | 'disk' | 'compiled')."""
    key = entry_key(spec)
    cubin = _memory.get(key)
    if cubin is not None:
        return cubin, "memory"
    with _guard:
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:
        cubin = _memory.get(key)
        if cubin is not None:
            return cubin, "memory"
        path = entry_path(spec, key)
        cubin = _read(path, key, spec)
        status = "disk"
        if cubin is None:
            if _env.no_compile():
                _record(spec)  # what is missing is recorded too
                raise CacheMiss(miss_message(spec))
            cubin, status = _compile_and_store(spec, key, path)
        _record(spec)
        _memory[key] = cubin
        return cubin, status


@contextlib.contextmanager
def _file_lock(path: Path, name: str):
    """Exclusive lock on `path`.lock across processes (a cache entry's compile, a manifest's read-merge-write: `name`
    says which, in the warning after LOCK_TIMEOUT_S); yields False when the folder is not writable."""
    lock = Path(str(path) + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        _wait_for(fd, lock, name)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _wait_for(fd: int, lock: Path, name: str) -> None:
    """Take the flock on `fd`, or give up after LOCK_TIMEOUT_S with a warning naming the lock file."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    delay = 0.005
    while fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                _warn_once(f"lock:{lock}", f"flashrt: waited {LOCK_TIMEOUT_S:.0f}s for the lock {lock}: a live "
                                           f"process has held it for {name} all that time (slow or hung; a "
                                           f"killed one releases its lock); going on with {name} here as well")
                return
            time.sleep(delay)
            delay = min(2 * delay, 0.2)
        except OSError:  # a file system without flock (some network mounts): go on without the lock
            return


def source_dump_path(spec: KernelSpec) -> Path:
    """Where FLASHRT_DUMP_SOURCE=1 writes a variant's full source."""
    return cache_dir() / "source" / f"{spec.name}.cu"


def _compile(spec: KernelSpec) -> tuple[bytes, dict]:
    dump = source_dump_path(spec) if _env.dump_source() else None
    slow = threading.Timer(SLOW_COMPILE_S, log.warning, ("flashrt: still compiling %s after %.0fs; NVRTC is slow on "
                                                         "this machine or hung", spec.name, SLOW_COMPILE_S))
    slow.daemon = True
    slow.start()
    t0 = time.perf_counter()
    try:
        cubin, compile_log = nvrtc.compile_cubin(spec.translation_unit(), spec.name, spec.options(),
                                                 kernel_sources(), dump)
    finally:
        slow.cancel()
    seconds = time.perf_counter() - t0
    log.info("flashrt: compiled %s in %.2fs", spec.name, seconds)
    meta = {"name": spec.name, "arch": spec.arch, "spec": spec.key_fields(), "options": spec.options(),
            "nvrtc": list(nvrtc.version()), "flashrt": __version__, "compile_s": round(seconds, 3),
            "created": time.time(), "log": compile_log}
    return cubin, meta


def _compile_and_store(spec: KernelSpec, key: str, path: Path) -> tuple[bytes, str]:
    with _file_lock(path, spec.name) as writable:
        if writable:
            cubin = _read(path, key, spec)  # another process may have finished it while we waited
            if cubin is not None:
                return cubin, "disk"
        cubin, meta = _compile(spec)
        if not writable:
            _warn_once("readonly", f"flashrt: cache folder {path.parent} is not writable; compiling in memory "
                                   f"(set FLASHRT_CACHE_DIR to a writable folder to keep compiled kernels)")
            return cubin, "compiled"
        try:
            _atomic_write(path, encode_entry(key, cubin, meta))
        except OSError as exc:
            _warn_once("write", f"flashrt: could not write cache entry {path} ({exc}); using the kernel from "
                                f"memory, it will compile again in the next process (free space in {path.parent} "
                                f"or set FLASHRT_CACHE_DIR to a writable folder)")
        return cubin, "compiled"


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # not mkstemp's 0600: a cache prewarmed by one user serves the others
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------
# Manifests: the variants a workload looks up (FLASHRT_RECORD), for `flashrt prewarm --manifest`
# ---------------------------------------------------------------------------
_FIELDS = {f.name: f for f in dataclasses.fields(KernelSpec)}
_TYPES = {"str": str, "int": int, "bool": bool, "tuple": tuple}  # KernelSpec's annotations (strings: PEP 563)


def spec_fields(spec: KernelSpec) -> dict:
    """A variant's KernelSpec fields as JSON values (mod_tensors, score_mod and head_dims lists), what a manifest and an
    entry's header hold."""
    return dict(spec.key_fields(), mod_tensors=list(spec.mod_tensors), score_mod=_lists(spec.score_mod),
                head_dims=list(spec.head_dims))


def spec_from_fields(fields) -> KernelSpec:
    """The KernelSpec of a manifest entry or an entry header's "spec"; ValueError (one line) says what is wrong."""
    if not isinstance(fields, dict):
        raise ValueError(f"a variant is a JSON object of KernelSpec fields, got {json.dumps(fields)[:80]}")
    unknown = sorted(set(fields) - set(_FIELDS))
    missing = sorted(n for n, f in _FIELDS.items() if n not in fields and f.default is dataclasses.MISSING)
    if unknown or missing:
        raise ValueError("not a KernelSpec: " + "; ".join(
            ([f"unknown fields {', '.join(unknown)}"] if unknown else [])
            + ([f"missing fields {', '.join(missing)}"] if missing else [])))
    values = dict(fields)
    for name in ("mod_tensors", "head_dims"):
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    if isinstance(values.get("score_mod"), list):  # [expression, derivative, [[name, type], ...]]
        values["score_mod"] = _tuples(values["score_mod"])
    items = {"mod_tensors": (str, "strings"), "head_dims": (int, "integers")}  # (tuple fields: their items' type)
    for name, value in values.items():
        want = _TYPES.get(str(_FIELDS[name].type), object)  # (a field of another type: KernelSpec checks it)
        item, items_are = items.get(name, (object, ""))
        if not isinstance(value, want) or (want is int and isinstance(value, bool)) or (
                want is tuple and not all(isinstance(t, item) and not isinstance(t, bool) for t in value)):
            shown = json.dumps(list(value) if isinstance(value, tuple) else value)
            raise ValueError(f"field {name} must be {f'a list of {items_are}' if want is tuple else want.__name__}, "
                             f"got {shown}")
    return KernelSpec(**values)  # its own checks: family, dtype, head_dim, arch, mask bits, tiling


def _tuples(x):
    """JSON lists (nested) as tuples, as KernelSpec.score_mod holds them."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _lists(x):
    """Nested tuples as the lists JSON reads back."""
    return [_lists(v) for v in x] if isinstance(x, (list, tuple)) else x


def _canonical(fields) -> str:
    return json.dumps(fields, sort_keys=True)


def read_manifest(path) -> list:
    """The entries of a manifest file as they are (validate each with spec_from_fields); [] for a missing or empty
    file; ValueError when it is not a JSON list."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not a flashrt manifest (not JSON: {exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path} is not a flashrt manifest (a JSON {type(data).__name__}, expected a list of "
                         f"KernelSpec field objects)")
    return data


def _sort_key(fields) -> tuple:
    try:
        return 0, spec_from_fields(fields).name, _canonical(fields)
    except (ValueError, TypeError):
        return 1, "", _canonical(fields)


def _manifest_bytes(entries: list) -> bytes:
    """One variant per line, sorted by name (entries that are no valid variant last), deduplicated."""
    unique = {_canonical(f): f for f in entries}
    lines = [_canonical(f) for f in sorted(unique.values(), key=_sort_key)]
    return ("[\n" + ",\n".join(lines) + "\n]\n").encode() if lines else b"[]\n"


def merge_manifest(path, entries: list) -> int:
    """Add `entries` (field dicts) to the manifest at `path` (created with its folder if missing), under its lock,
    written atomically; returns how many variants it then holds. ValueError if the file is not a manifest."""
    path = Path(path).expanduser()
    with _file_lock(path, f"the manifest {path}"):  # (it makes the folder)
        held = read_manifest(path)
        known = {_canonical(f) for f in held}
        new = [f for f in entries if _canonical(f) not in known]
        if new:
            _atomic_write(path, _manifest_bytes(held + new))
        return len(known | {_canonical(f) for f in new})


def write_manifest(path, entries: list) -> int:
    """Write exactly `entries` (field dicts) as the manifest at `path`, atomically; returns how many variants."""
    path = Path(path).expanduser()
    with _file_lock(path, f"the manifest {path}"):  # (it makes the folder)
        _atomic_write(path, _manifest_bytes(entries))
    return len({_canonical(f) for f in entries})


_recorded: set = set()


def _record(spec: KernelSpec) -> None:
    """FLASHRT_RECORD: merge `spec` into the manifest, once per (path, variant) and process. Read only on a memory
    miss (lookup), so it costs nothing when unset; a manifest that cannot be written costs one warning, never the
    lookup."""
    path = _env.record()
    if path is None:
        return
    fields = spec_fields(spec)
    tag = (path, _canonical(fields))
    with _guard:
        if tag in _recorded:
            return
        _recorded.add(tag)
    try:
        merge_manifest(path, [fields])
    except (OSError, ValueError) as exc:
        with _guard:
            _recorded.discard(tag)
        _warn_once(f"record:{path}", f"flashrt: cannot record kernel variants in FLASHRT_RECORD={path} ({exc}); "
                                     f"not recording")


# ---------------------------------------------------------------------------
# Inspection (CLI: flashrt cache info / clear)
# ---------------------------------------------------------------------------
def entries() -> list[tuple[Path, dict | None]]:
    """Every cache file with its header, or None for an unusable one."""
    d = cache_dir()
    out = []
    for path in sorted(d.glob(f"*{_SUFFIX}")) if d.is_dir() else []:
        try:
            header = decode_entry(path.read_bytes())[0]
        except (OSError, ValueError):
            header = None
        out.append((path, header))
    return out


def is_stale(header: dict) -> bool:
    """True when this flashrt would never look the entry up: another flashrt version, kernel
    sources, NVRTC version or KernelSpec layout wrote it."""
    try:
        spec = spec_from_fields(header["spec"])
    except (KeyError, TypeError, ValueError):
        return True
    return entry_key(spec) != header.get("key")


def entry_files() -> list[Path]:
    """The cache's entry files (not their locks, temp files or source dumps), without reading them."""
    d = cache_dir()
    return sorted(d.glob(f"*{_SUFFIX}")) if d.is_dir() else []


def exported(arch: str | None = None) -> tuple[list[dict], dict]:
    """(the variants of the usable entries, as manifest field dicts; counts of what was skipped: "stale",
    "unusable" (corrupt), "other_arch", "no_spec" (an entry whose header holds no spec))."""
    out, skipped = {}, {"stale": 0, "unusable": 0, "other_arch": 0, "no_spec": 0}
    for _, header in entries():
        if header is None:
            skipped["unusable"] += 1
            continue
        try:
            spec = spec_from_fields(header["spec"])
        except (KeyError, TypeError, ValueError):
            skipped["no_spec"] += 1
            continue
        if entry_key(spec) != header.get("key"):
            skipped["stale"] += 1
        elif arch is not None and spec.arch != arch:
            skipped["other_arch"] += 1
        else:
            out[spec.name] = spec_fields(spec)
    return [out[n] for n in sorted(out)], skipped


def clear(stale_only: bool = False) -> int:
    """Remove flashrt's files from the cache folder (with `stale_only`, only the entries this flashrt
    cannot use, stale or unusable, and their locks); returns how many files were removed (clear_counts: how
    many of them were entries)."""
    return sum(clear_counts(stale_only).values())


def clear_counts(stale_only: bool = False) -> dict:
    """clear(), returning {"entries": cache entries removed, "other": their locks, temp files, source dumps}."""
    d = cache_dir()
    if stale_only:
        doomed = [p for p, h in entries() if h is None or is_stale(h)]
        doomed += [Path(str(p) + ".lock") for p in doomed]
    else:
        doomed = [p for p in (d.iterdir() if d.is_dir() else []) if p.name.startswith("flashrt_")
                  and p.suffix in (_SUFFIX, ".lock", ".tmp")]
        doomed += list((d / "source").glob("flashrt_*.cu"))
        _memory.clear()
    removed = {"entries": 0, "other": 0}
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed["entries" if path.suffix == _SUFFIX else "other"] += 1
    return removed
