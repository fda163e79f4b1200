"""The only module that talks to NVRTC: source text in, cubin bytes out.

CuPy's own compile path is not used: it needs a GPU to pick the arch, forces
its own options and cannot target sm_90a. NVRTC itself runs on any machine,
GPU or not, given a real arch such as sm_80 or sm_90a.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import site
import struct
import sys
from pathlib import Path
from typing import NamedTuple

from . import _env

_SUPPORTED_MAJORS = (12, 13)


def _install_hint(major: int | None = None, label: str | None = None) -> str:
    """The pip command that brings the NVRTC (and CuPy) of CUDA `major` (`label`: what asks for it), or of either,
    from a package index and from a flashrt checkout."""
    if major in _SUPPORTED_MAJORS:
        return (f'install the NVRTC of CUDA {major}{f" (for {label})" if label else ""}: pip install '
                f'"flashrt[cuda{major}]" (from a flashrt checkout: pip install ".[cuda{major}]")')
    return ('install the NVRTC wheel that matches your CuPy: pip install "flashrt[cuda12]" (cupy-cuda12x) or '
            'pip install "flashrt[cuda13]" (cupy-cuda13x); from a flashrt checkout, pip install ".[cuda12]" or '
            '".[cuda13]"')


_EXTRA_HINT = _install_hint()


class NvrtcUnavailable(RuntimeError):
    """NVRTC could not be loaded, or its version is not supported."""


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; carries the variant name, the options, NVRTC's log and where the source was dumped."""

    def __init__(self, name: str, options: list[str], log: str, source: str, source_note: str = ""):
        self.name, self.options, self.log, self.source = name, list(options), log, source
        note = source_note or "set FLASHRT_DUMP_SOURCE=1 to write the full source (headers inlined) to a file"
        super().__init__(f"NVRTC failed to compile {name}\n  options: {' '.join(options)}\n  source: {note}\n"
                         f"{log.rstrip()}")


# ---------------------------------------------------------------------------
# Which NVRTC: several can be installed side by side (pip install ".[cuda12,torch]" may bring torch's CUDA 13
# NVRTC wheel beside the CUDA 12 one), so every one found is listed, then one is chosen: FLASHRT_NVRTC if set,
# else the one of CuPy's CUDA major, else the driver's, else the newest.
# ---------------------------------------------------------------------------
class Candidate(NamedTuple):
    major: int | None  # CUDA major from the file name; None: unknown until loaded
    path: str          # an absolute path, or a library name for the system loader's own search
    where: str         # "site-packages", "conda", "CUDA_HOME", "system", "FLASHRT_NVRTC"


_WINDOWS = os.name == "nt"
_LINUX_NAME = re.compile(r"libnvrtc\.so\.(\d+)(\.[\d.]+)?")
_WINDOWS_NAME = re.compile(r"nvrtc64_(\d+)\d_0\.dll")  # nvrtc64_120_0.dll: CUDA 12, nvrtc64_130_0.dll: 13


def _major_of(path: str) -> int | None:
    name = os.path.basename(path)
    m = _WINDOWS_NAME.fullmatch(name.lower()) if _WINDOWS else _LINUX_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def _site_dirs() -> list[str]:
    """Folders where pip puts packages, in import order."""
    dirs = [d for d in sys.path if d and os.path.isdir(d)]
    try:
        dirs += list(site.getsitepackages()) + [site.getusersitepackages()]
    except AttributeError:  # an old virtualenv's site module
        pass
    seen, out = set(), []
    for d in dirs:
        key = os.path.realpath(d)
        if key not in seen and os.path.isdir(os.path.join(d, "nvidia")):
            seen.add(key)
            out.append(d)
    return out


def _in_dir(folder: str, where: str) -> list[Candidate]:
    """The NVRTC libraries in one folder, one per CUDA major (the shortest name: the soname, not its target)."""
    pattern = "nvrtc64_*_0.dll" if _WINDOWS else "libnvrtc.so.*"
    by_major: dict[int, str] = {}
    for path in sorted(glob.glob(os.path.join(folder, pattern)), key=len):
        major = _major_of(path)
        if major is not None and major not in by_major:
            by_major[major] = path
    return [Candidate(m, p, where) for m, p in sorted(by_major.items(), reverse=True)]


def candidates() -> list[Candidate]:
    """Every NVRTC library found, in search order: pip wheels (nvidia/cu13/lib, nvidia/cuda_nvrtc/lib, ...),
    $CONDA_PREFIX, $CUDA_PATH / $CUDA_HOME, then the names the system loader resolves (found only when loaded).
    Nothing is loaded here."""
    found: list[Candidate] = []
    wheel_dirs = ("nvidia/*/bin", "nvidia/*/bin/*") if _WINDOWS else ("nvidia/*/lib",)
    for site_dir in _site_dirs():
        for pattern in wheel_dirs:
            for folder in sorted(glob.glob(os.path.join(site_dir, pattern))):
                found += _in_dir(folder, "site-packages")
    roots = [("conda", os.environ.get("CONDA_PREFIX"))]
    roots += [("CUDA_HOME", os.environ.get(v)) for v in ("CUDA_PATH", "CUDA_HOME")]
    subdirs = ("bin", "bin/x64", "Library/bin") if _WINDOWS else ("lib64", "lib", "targets/*/lib")
    for where, root in roots:
        if root:
            for sub in subdirs:
                for folder in sorted(glob.glob(os.path.join(root, sub))):
                    found += _in_dir(folder, where)
    names = ("nvrtc64_130_0.dll", "nvrtc64_120_0.dll") if _WINDOWS else ("libnvrtc.so.13", "libnvrtc.so.12",
                                                                          "libnvrtc.so")
    found += [Candidate(_major_of(n), n, "system") for n in names]
    seen, out = set(), []
    for c in found:
        key = os.path.realpath(c.path) if os.path.isabs(c.path) else c.path
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


_CUPY_WHEELS = {"cupy-cuda13x": 13, "cupy-cuda12x": 12, "cupy-cuda11x": 11}


def _cupy_cuda() -> tuple[int, str] | None:
    """(CUDA major, what says so) of the installed CuPy: its runtime if CuPy is imported already, else the name of
    its wheel (cupy-cuda12x, cupy-cuda13x) from the package metadata, without importing it. None: no CuPy wheel,
    or several."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            v = int(cupy.cuda.runtime.runtimeGetVersion())
            return v // 1000, f"CuPy's CUDA {v // 1000}.{v % 1000 // 10} runtime"
        except Exception:  # a partly imported or broken CuPy: ask the metadata
            pass
    import importlib.metadata  # (here, not at import: it costs ~30 ms, and only the first compile asks)
    found = []
    for dist, major in _CUPY_WHEELS.items():
        try:
            importlib.metadata.version(dist)
            found.append((major, dist))
        except importlib.metadata.PackageNotFoundError:
            pass
    return found[0] if len(found) == 1 else None


def _driver_cuda() -> tuple[int, int] | None:
    """(major, minor) of the CUDA version the installed driver supports; None without a driver library."""
    try:
        lib = ctypes.CDLL("nvcuda.dll" if _WINDOWS else "libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0 or v.value <= 0:
            return None
        return v.value // 1000, v.value % 1000 // 10
    except (OSError, AttributeError):
        return None


def _override() -> tuple[int | None, Candidate | None]:
    """FLASHRT_NVRTC parsed: (a CUDA major, None), (None, the library it names), or (None, None) when unset."""
    value = _env.nvrtc()
    if value is None:
        return None, None
    if value.isdigit():
        if int(value) not in _SUPPORTED_MAJORS:
            raise NvrtcUnavailable(f"FLASHRT_NVRTC={value}: flashrt supports NVRTC "
                                   f"{' and '.join(map(str, _SUPPORTED_MAJORS))}; set FLASHRT_NVRTC to one of those "
                                   f"majors or to an NVRTC library's path, or unset it")
        return int(value), None
    path = os.path.expanduser(value)
    if os.path.isabs(path) or os.sep in path or "/" in path:
        if not os.path.isfile(path):
            raise NvrtcUnavailable(f"FLASHRT_NVRTC={value}: no such file; set FLASHRT_NVRTC to an NVRTC library's path "
                                   f"(libnvrtc.so.12, nvrtc64_120_0.dll, ...) or to a CUDA major version (12 or 13), "
                                   f"or unset it")
        return None, Candidate(_major_of(path), os.path.abspath(path), "FLASHRT_NVRTC")
    if "nvrtc" in value.lower():  # a library name for the system loader: libnvrtc.so.12
        return None, Candidate(_major_of(value), value, "FLASHRT_NVRTC")
    raise NvrtcUnavailable(f"FLASHRT_NVRTC must be a CUDA major version (12 or 13) or the path of an NVRTC library "
                           f"(libnvrtc.so.12, nvrtc64_120_0.dll, ...), got {value!r}")


def _plan(found: list[Candidate], cupy: tuple[int, str] | None,
          driver: tuple[int, int] | None) -> list[tuple[Candidate, str]]:
    """Every candidate with the reason it would be chosen, best first: CuPy's CUDA major, then the driver's, then
    the supported majors, newest first, then the rest; the search order breaks ties."""
    wants = []  # (major, what asks for it): only majors flashrt supports
    if cupy is not None and cupy[0] in _SUPPORTED_MAJORS:
        wants.append((cupy[0], cupy[1]))
    if driver is not None and driver[0] in _SUPPORTED_MAJORS:
        wants.append((driver[0], f"the driver's CUDA {driver[0]}.{driver[1]}"))
    majors = [m for m, _ in wants]

    def rank(c: Candidate):
        if c.major in majors:
            return (majors.index(c.major),)
        return (len(wants), c.major not in _SUPPORTED_MAJORS, -(c.major or 0))

    plan = []
    for c in sorted(found, key=rank):
        at = majors.index(c.major) if c.major in majors else len(wants)
        notes = [f"none for {label}" for m, label in wants[:at] if m != c.major]
        if at < len(wants):
            main = f"matches {wants[at][1]}"
        else:
            main = "the system loader's default" if c.major is None else "newest found"
        plan.append((c, "; ".join(notes + [main])))
    return plan


def _open(path: str) -> ctypes.CDLL:
    """Load one NVRTC library; a wheel's NVRTC gets its builtins library preloaded from its own folder."""
    folder = os.path.dirname(path) if os.path.isabs(path) else ""
    if folder and _WINDOWS and hasattr(os, "add_dll_directory"):
        _DLL_DIRS.append(os.add_dll_directory(folder))  # NVRTC loads nvrtc-builtins64_*.dll from here
    lib = ctypes.CDLL(path)
    if folder and not _WINDOWS:
        major = _major_of(path)
        for builtins in sorted(glob.glob(os.path.join(folder, f"libnvrtc-builtins.so.{major}.*")), key=len)[:1]:
            try:
                ctypes.CDLL(builtins)
            except OSError:  # NVRTC's own lookup of its builtins may still succeed
                pass
    return lib


_DLL_DIRS: list = []


def _describe(found: list[Candidate]) -> str:
    return ", ".join(f"NVRTC {c.major} ({c.path})" for c in found if os.path.isabs(c.path)) or "none"


def _locate() -> tuple[ctypes.CDLL, str, str]:
    """Load the NVRTC to use: (library, its path, why it was chosen)."""
    errors = []
    major, named = _override()
    if named is not None:
        try:
            return _open(named.path), named.path, f"FLASHRT_NVRTC={_env.nvrtc()}"
        except OSError as exc:
            raise NvrtcUnavailable(f"FLASHRT_NVRTC={_env.nvrtc()}: could not load it ({exc}); set FLASHRT_NVRTC to an "
                                   f"NVRTC library's path or to a CUDA major version (12 or 13), or unset it") from exc
    found = candidates()
    if major is not None:
        plan = [(c, f"FLASHRT_NVRTC={major}") for c in found if c.major == major]
    else:
        plan = _plan(found, _cupy_cuda(), _driver_cuda())
    for c, reason in plan:
        try:
            return _open(c.path), c.path, reason
        except OSError as exc:
            errors.append(f"{c.path}: {exc}")
    if major is not None:
        raise NvrtcUnavailable(f"FLASHRT_NVRTC={major} asks for NVRTC {major}, but none could be loaded (found: "
                               f"{_describe(found)}); {_install_hint(major)}, or unset FLASHRT_NVRTC"
                               + ("\n  tried: " + "; ".join(errors) if errors else ""))
    try:  # a layout the search above does not know: whatever cuda.pathfinder finds
        from cuda import pathfinder
        path = pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path
        return ctypes.CDLL(path), path, "found by cuda.pathfinder"
    except Exception as exc:  # pathfinder missing, or it found nothing
        errors.append(f"cuda.pathfinder: {exc}")
    raise NvrtcUnavailable("could not load the NVRTC library; " + _install_hint(*(_cupy_cuda() or ()))
                           + "\n  tried: " + "; ".join(errors))


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib, path, reason = _locate()
    c_int_p = ctypes.POINTER(ctypes.c_int)
    c_char_pp = ctypes.POINTER(ctypes.c_char_p)
    prog_p = ctypes.POINTER(ctypes.c_void_p)
    sigs = {
        "nvrtcVersion": [c_int_p, c_int_p],
        "nvrtcGetNumSupportedArchs": [c_int_p],
        "nvrtcGetSupportedArchs": [c_int_p],
        "nvrtcCreateProgram": [prog_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, c_char_pp, c_char_pp],
        "nvrtcDestroyProgram": [prog_p],
        "nvrtcCompileProgram": [ctypes.c_void_p, ctypes.c_int, c_char_pp],
        "nvrtcGetProgramLogSize": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)],
        "nvrtcGetProgramLog": [ctypes.c_void_p, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)],
        "nvrtcGetCUBIN": [ctypes.c_void_p, ctypes.c_char_p],
    }
    for fn, argtypes in sigs.items():
        f = getattr(lib, fn, None)
        if f is None:
            raise NvrtcUnavailable(f"{path} is not an NVRTC library (it has no {fn}); " + _EXTRA_HINT)
        f.argtypes, f.restype = argtypes, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    if major.value not in _SUPPORTED_MAJORS:
        raise NvrtcUnavailable(f"NVRTC {major.value}.{minor.value} ({path}) is not supported: flashrt needs "
                               f"CUDA 12 or 13; " + _EXTRA_HINT)
    lib.flashrt_path = path
    lib.flashrt_version = (major.value, minor.value)
    lib.flashrt_reason = reason
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: {_lib().nvrtcGetErrorString(status).decode()}")


def version() -> tuple[int, int]:
    """(major, minor) of the NVRTC in use."""
    return _lib().flashrt_version


def library_path() -> str:
    return _lib().flashrt_path


def choice() -> tuple[tuple[int, int], str, str]:
    """(version, path, reason) of the NVRTC in use (loading it): its (major, minor), the library's path (or the name
    the system loader resolved) and why it was chosen, e.g. "matches cupy-cuda12x" or "FLASHRT_NVRTC=12".
    Raises NvrtcUnavailable as version() does. candidates() lists every NVRTC found."""
    lib = _lib()
    return lib.flashrt_version, lib.flashrt_path, lib.flashrt_reason


def supported_archs() -> list[int]:
    """Compute capabilities this NVRTC can emit code for, e.g. [75, 80, ..., 90, ...]."""
    lib = _lib()
    n = ctypes.c_int()
    _check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    arr = (ctypes.c_int * n.value)()
    _check(lib.nvrtcGetSupportedArchs(arr), "nvrtcGetSupportedArchs")
    return list(arr)


def check_arch(arch: str) -> None:
    """Raise ValueError unless `arch` (sm_80, sm_90a, ...) is a real arch this NVRTC supports."""
    m = re.fullmatch(r"sm_(\d+)(a?)", arch)
    if not m:
        raise ValueError(f"arch must look like sm_80 or sm_90a, got {arch!r}")
    cc = int(m.group(1))
    supported = supported_archs()
    if cc not in supported:
        raise ValueError(f"NVRTC {'.'.join(map(str, version()))} cannot compile for {arch}; "
                         f"it supports sm_{', sm_'.join(map(str, supported))}")


_INCLUDE = re.compile(r'\s*#\s*include\s*"([^"]+)"')


def full_source(source: str, name: str, options: list[str], headers: dict[str, str]) -> str:
    """The translation unit NVRTC compiles, as one file: every #include of one of `headers` replaced by its text.

    NVRTC has no preprocess-only mode, so the includes are expanded here, honouring #pragma once. #line
    markers keep NVRTC's messages pointing at the original file and line, and the file compiles on its
    own with the options written at its top.
    """
    once: set[str] = set()

    def expand(text: str, filename: str) -> list[str]:
        out = [f'#line 1 "{filename}"']
        for lineno, line in enumerate(text.splitlines(), 1):
            m = _INCLUDE.match(line)
            if line.strip() == "#pragma once":
                once.add(filename)
                out.append("")
            elif m and m.group(1) in headers:
                if m.group(1) not in once:
                    out += expand(headers[m.group(1)], m.group(1))
                out.append(f'#line {lineno + 1} "{filename}"')
            else:
                out.append(line)
        return out

    return "\n".join([f"// {name}: NVRTC options {' '.join(options)}", *expand(source, f"{name}.cu"), ""])


def compile_cubin(source: str, name: str, options: list[str], headers: dict[str, str],
                  dump: Path | None = None) -> tuple[bytes, str]:
    """Compile `source` (with in-memory `headers`: include name -> text) to a cubin.

    `dump`: a file to write the full source to before compiling (see full_source), so that a compile
    that fails, crashes or hangs leaves something to read. Returns (cubin, log). Raises CompileError
    with NVRTC's log on failure.
    """
    note = ""
    if dump is not None:
        try:
            dump.parent.mkdir(parents=True, exist_ok=True)
            dump.write_text(full_source(source, name, options, headers))
            note = str(dump)
        except OSError as exc:
            note = f"could not be written to {dump} ({exc})"
    lib = _lib()
    prog = ctypes.c_void_p()
    names = list(headers)
    hdr_src = (ctypes.c_char_p * max(1, len(names)))(*[headers[n].encode() for n in names])
    hdr_names = (ctypes.c_char_p * max(1, len(names)))(*[n.encode() for n in names])
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), len(names),
                                  hdr_src, hdr_names), "nvrtcCreateProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.value.decode(errors="replace")
        if status != 0:
            raise CompileError(name, options, log, source, note)
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cubin_sm(cubin: bytes) -> int | None:
    """The SM number (80, 90, 100, ...) whose code a cubin holds, from its ELF header; None if it is no CUDA ELF.

    e_flags holds it in the low byte up to ELF ABI version 7, in bits 8..15 from version 8 (which NVRTC
    12.9 writes for sm_100 and up). The 'a' of sm_90a is not read: its flag moved between the layouts
    (0x800, then 0x8), and sm_90 and sm_90a code run on the same GPUs.
    """
    if len(cubin) < 64 or cubin[:5] != b"\x7fELF\x02" or struct.unpack_from("<H", cubin, 18)[0] != 190:  # EM_CUDA
        return None
    flags = struct.unpack_from("<I", cubin, 48)[0]
    return (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF
