"""The only module that talks to NVRTC: source text in, cubin bytes out.

CuPy's own compile path is not used: it needs a GPU to pick the arch, forces
its own options and cannot target sm_90a. NVRTC itself runs on any machine,
GPU or not, given a real arch such as sm_80 or sm_90a.
"""
from __future__ import annotations

import ctypes
import functools
import re
import struct
from pathlib import Path

_EXTRA_HINT = ("install the NVRTC wheel that matches your CuPy: "
               "pip install 'flashrt[cuda12]' (cupy-cuda12x) or pip install 'flashrt[cuda13]' (cupy-cuda13x)")
_SUPPORTED_MAJORS = (12, 13)


class NvrtcUnavailable(RuntimeError):
    """NVRTC could not be loaded, or its version is not supported."""


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; carries the variant name, the options, NVRTC's log and where the source was dumped."""

    def __init__(self, name: str, options: list[str], log: str, source: str, source_note: str = ""):
        self.name, self.options, self.log, self.source = name, list(options), log, source
        note = source_note or "set FLASHRT_DUMP_SOURCE=1 to write the full source (headers inlined) to a file"
        super().__init__(f"NVRTC failed to compile {name}\n  options: {' '.join(options)}\n  source: {note}\n"
                         f"{log.rstrip()}")


def _locate() -> str:
    errors = []
    try:
        from cuda import pathfinder
        return pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception as exc:  # pathfinder missing, or it found nothing
        errors.append(f"cuda.pathfinder: {exc}")
    for soname in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        try:
            ctypes.CDLL(soname)
            return soname
        except OSError as exc:
            errors.append(f"{soname}: {exc}")
    raise NvrtcUnavailable("could not load the NVRTC library; " + _EXTRA_HINT + "\n  tried: " + "; ".join(errors))


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    path = _locate()
    lib = ctypes.CDLL(path)
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
        f = getattr(lib, fn)
        f.argtypes, f.restype = argtypes, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    if major.value not in _SUPPORTED_MAJORS:
        raise NvrtcUnavailable(f"NVRTC {major.value}.{minor.value} ({path}) is not supported: flashrt needs "
                               f"CUDA 12 or 13; " + _EXTRA_HINT)
    lib.flashrt_path = path
    lib.flashrt_version = (major.value, minor.value)
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: {_lib().nvrtcGetErrorString(status).decode()}")


def version() -> tuple[int, int]:
    """(major, minor) of the NVRTC in use."""
    return _lib().flashrt_version


def library_path() -> str:
    return _lib().flashrt_path


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
