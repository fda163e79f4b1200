"""Every FLASHRT_* environment variable, typed, in one place.

Values are read at call time, so a test or a long-running process can change
them without re-importing flashrt.
"""
import os

_TRUE = {"1", "true", "yes", "on"}


def _flag(name: str) -> bool:
    value = _get(name)
    return value is not None and value.strip().lower() in _TRUE


_ENCODED: dict = {}


def _get(name: str) -> str | None:
    """os.environ.get(name), read at every attention call (no_sm90, no_tma, no_dq_first_store: the plan key) in ~0.2
    us instead of ~2: os.environ.get of an unset name raises and catches a KeyError. CPython's os.environ keeps its
    items, encoded, in the dict `_data` (which os.environ's own writes update); elsewhere, os.environ.get."""
    data = getattr(os.environ, "_data", None)
    if type(data) is not dict:
        return os.environ.get(name)
    key = _ENCODED.get(name)
    if key is None:
        key = _ENCODED[name] = os.environ.encodekey(name)
    value = data.get(key)
    return None if value is None else os.environ.decodevalue(value)


def _text(name: str) -> str | None:
    """A variable's value, stripped; None when unset or blank."""
    return (_get(name) or "").strip() or None


def cache_dir() -> str | None:
    """FLASHRT_CACHE_DIR: where compiled cubins live (default: the platformdirs user cache dir)."""
    return _text("FLASHRT_CACHE_DIR")


def nvrtc() -> str | None:
    """FLASHRT_NVRTC=12, 13 or a library's path: the NVRTC to load (default: the installed CuPy's CUDA major, else the driver's, else the newest found)."""
    return _text("FLASHRT_NVRTC")


def no_compile() -> bool:
    """FLASHRT_NO_COMPILE=1: a cache miss is an error instead of a compile (proves a prewarm covered everything)."""
    return _flag("FLASHRT_NO_COMPILE")


def dump_source() -> bool:
    """FLASHRT_DUMP_SOURCE=1: every compile first writes its translation unit, headers inlined, to <cache dir>/source/<variant>.cu."""
    return _flag("FLASHRT_DUMP_SOURCE")


def no_sm90() -> bool:
    """FLASHRT_NO_SM90=1: use the mma.sync kernels on Hopper too, not the wgmma forward and split backward (A/B timing, a fallback)."""
    return _flag("FLASHRT_NO_SM90")


def no_tma() -> bool:
    """FLASHRT_NO_TMA=1: the warp-specialised kernels (fwd_sm90_ws, the Hopper fused backward) load every tile
    without TMA tensor maps (A/B timing, a fallback)."""
    return _flag("FLASHRT_NO_TMA")


def no_dq_first_store() -> bool:
    """FLASHRT_NO_DQ_FIRST_STORE=1: the ordered Hopper fused backward zeroes its fp32 dQ accumulator first instead of
    storing each query tile's first dQ turn (A/B timing; compute-sanitizer's initcheck, which does not see the bulk
    copies' writes: scripts/probes/initcheck_bulk.py)."""
    return _flag("FLASHRT_NO_DQ_FIRST_STORE")


def no_copy_engine() -> bool:
    """FLASHRT_NO_COPY_ENGINE=1: ring_attention's transfers go by NCCL even where every rank is on one host with peer
    access (flashrt/p2p.py: the copy engines then; A/B timing, a fallback). Read once per process group."""
    return _flag("FLASHRT_NO_COPY_ENGINE")


def no_decode_forward() -> bool:
    """FLASHRT_NO_DECODE_FORWARD=1: flashrt.forward with 16 query rows or fewer keeps the forward kernels instead of decode's split-KV ones (A/B timing, a fallback)."""
    return _flag("FLASHRT_NO_DECODE_FORWARD")


def record() -> str | None:
    """FLASHRT_RECORD=<path>: every kernel variant this process looks up is added to the JSON manifest at <path> (merged with what it holds), for `flashrt prewarm --manifest <path>`."""
    return _text("FLASHRT_RECORD")


VARIABLES = {
    "FLASHRT_NO_SM90": no_sm90.__doc__,
    "FLASHRT_NO_TMA": no_tma.__doc__,
    "FLASHRT_NO_DQ_FIRST_STORE": no_dq_first_store.__doc__,
    "FLASHRT_NO_COPY_ENGINE": no_copy_engine.__doc__,
    "FLASHRT_NO_DECODE_FORWARD": no_decode_forward.__doc__,
    "FLASHRT_CACHE_DIR": cache_dir.__doc__,
    "FLASHRT_NVRTC": nvrtc.__doc__,
    "FLASHRT_NO_COMPILE": no_compile.__doc__,
    "FLASHRT_DUMP_SOURCE": dump_source.__doc__,
    "FLASHRT_RECORD": record.__doc__,
}
