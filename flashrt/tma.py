"""TMA tensor maps (CUtensorMap) of the inputs for the warp-specialised kernels' loads (fwd_sm90_ws: q, k, v; the
Hopper fused backward: q, dout, k, v; kernels_cu/common/wgmma.cuh: load_tile_tma).

A map is encoded by the CUDA driver's cuTensorMapEncodeTiled, called through ctypes (neither CuPy
nor torch exposes it), and holds the tensor's address: a reused plan writes its maps into the params
struct at each call (TileMap.write) from dims and strides fixed when it was planned, remembering the
last few addresses' maps.
"""
from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

from .launch import LaunchError, driver_library

# cuda.h's enum values (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion, ...FloatOOBfill)
_UINT16 = 1         # bf16 and fp16 move as 16-bit words
_NO_INTERLEAVE = 0
_SWIZZLE_128B = 3   # the sw128 layout of kernels_cu/common/wgmma.cuh
_L2_256B = 3
_OOB_ZEROS = 0      # (rows past the tensor's end: fwd_sm90_ws.cu's TMA_TAILS loads ragged tiles there by TMA)
_BOX_COLS = 64      # one 128-byte swizzle row of 16-bit elements
_MAP_BYTES = 128
_REMEMBERED = 8     # maps kept per TileMap, by address


@lru_cache(maxsize=None)
def _encode_tiled():
    try:
        lib = driver_library()
    except LaunchError as exc:
        raise LaunchError(f"{exc} for TMA tensor maps; set FLASHRT_NO_TMA=1 to load tiles without them") from exc
    fn = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_scratch = threading.local()


def _aligned_scratch() -> int:
    """This thread's 64-byte-aligned 128 bytes, where the driver writes a map (CUtensorMap is alignas(64))."""
    addr = getattr(_scratch, "addr", None)
    if addr is None:
        _scratch.buf = ctypes.create_string_buffer(_MAP_BYTES + 64)
        addr = _scratch.addr = (ctypes.addressof(_scratch.buf) + 63) & ~63
    return addr


class TileMap:
    """The map of a (B, S, H, D) tensor of 16-bit elements, strides in elements (D's is 1), read in tiles of
    `rows` rows by 64 columns of one head of one batch entry (the box 64 x 1 x rows x 1 over dims D, H, S, B). A box
    past D (a head_dim the kernel pads: tiles.sm90_head_dim) lands as zeros."""

    def __init__(self, name: str, shape: tuple, strides: tuple, rows: int):
        B, S, H, D = shape
        # An axis of size 1 is never stepped along: any valid stride, the contiguous one here.
        natural = (S * H * D, H * D, D)
        byte_strides = [2 * (s if n > 1 else c) for n, s, c in zip((B, S, H), strides[:3], natural)]
        self.name = name
        self._dims = (ctypes.c_uint64 * 4)(D, H, S, B)
        self._strides = (ctypes.c_uint64 * 3)(byte_strides[2], byte_strides[1], byte_strides[0])  # H, S, B
        self._box = (ctypes.c_uint32 * 4)(_BOX_COLS, 1, rows, 1)
        self._steps = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
        self._maps: dict[int, bytes] = {}

    def encode(self, ptr: int) -> bytes:
        """The map of this tensor at address ptr (16-byte aligned)."""
        out = _aligned_scratch()
        rc = _encode_tiled()(out, _UINT16, 4, ptr, self._dims, self._strides, self._box, self._steps, _NO_INTERLEAVE,
                             _SWIZZLE_128B, _L2_256B, _OOB_ZEROS)
        if rc:
            raise LaunchError(f"cuTensorMapEncodeTiled refused {self.name} (CUresult {rc}; dims D, H, S, B = "
                              f"{tuple(self._dims)}, byte strides of H, S, B = {tuple(self._strides)}, box "
                              f"{tuple(self._box)}, address 0x{ptr:x}); set FLASHRT_NO_TMA=1 to load tiles without "
                              f"TMA")
        return ctypes.string_at(out, _MAP_BYTES)

    def write(self, ptr: int, dest: int) -> None:
        """The map of this tensor at ptr into the 128 bytes at host address dest (a params struct's field)."""
        m = self._maps.get(ptr)
        if m is None:
            m = self.encode(ptr)
            if len(self._maps) >= _REMEMBERED:
                self._maps.clear()
            self._maps[ptr] = m
        ctypes.memmove(dest, m, _MAP_BYTES)
