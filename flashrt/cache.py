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
"""
from __future__ import annotations

import contextlib
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

from . import _env, nvrtc, params
from ._version import __version__
from .spec import KernelSpec

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


def prewarm_command(spec: KernelSpec) -> str:
    return (f"flashrt prewarm --arch {spec.arch} --head-dims {spec.head_dim} --dtypes {spec.dtype}")


def get_cubin(spec: KernelSpec) -> bytes:
    return lookup(spec)[0]


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
                raise CacheMiss(f"flashrt: kernel {spec.name} is not in the cache ({cache_dir()}) and "
                                f"FLASHRT_NO_COMPILE=1 forbids compiling it; fill the cache with: "
                                f"{prewarm_command(spec)}")
            cubin, status = _compile_and_store(spec, key, path)
        _memory[key] = cubin
        return cubin, status


@contextlib.contextmanager
def _file_lock(path: Path, name: str):
    """Exclusive lock on `path`.lock across processes; yields False when the folder is not writable."""
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
                                           f"process has been compiling {name} all that time (slow or hung; a "
                                           f"killed one releases its lock); compiling {name} here as well")
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
        spec = KernelSpec(**header["spec"])
    except (KeyError, TypeError, ValueError):
        return True
    return entry_key(spec) != header.get("key")


def clear(stale_only: bool = False) -> int:
    """Remove flashrt's files from the cache folder (with `stale_only`, only the entries this flashrt
    cannot use, stale or unusable, and their locks); returns how many were removed."""
    d = cache_dir()
    if stale_only:
        doomed = [p for p, h in entries() if h is None or is_stale(h)]
        doomed += [Path(str(p) + ".lock") for p in doomed]
    else:
        doomed = [p for p in (d.iterdir() if d.is_dir() else []) if p.name.startswith("flashrt_")
                  and p.suffix in (_SUFFIX, ".lock", ".tmp")]
        doomed += list((d / "source").glob("flashrt_*.cu"))
        _memory.clear()
    removed = 0
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed
