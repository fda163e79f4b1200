"""Everything that touches the GPU: device limits, module loading, grids, launches.

Kernels are loaded once per (variant, device) from cubin bytes that cache.py
has checksummed. Grids and dynamic shared memory are computed here from the
KernelSpec (whose smem formula the kernel static_asserts) and checked against
the device before launch, so a misfit is a clear error, not a failed launch.
"""
from __future__ import annotations

import ctypes
import dataclasses
import sys
import threading
from functools import lru_cache

from . import cache, nvrtc, params, tiles
from .spec import CLASSIFY, ELEMENTWISE, KEY_PARALLEL, PROGRAMMATIC, QUERY_PARALLEL, KernelSpec

_DEFAULT_SMEM = 48 * 1024  # dynamic shared memory a kernel gets without opting in
_MAX_GRID_YZ = 65535


class LaunchError(RuntimeError):
    """A kernel cannot be launched on this device as configured."""


@dataclasses.dataclass(frozen=True)
class Device:
    index: int
    name: str
    arch: str          # the arch flashrt compiles for: sm_90a on Hopper, else sm_<major><minor>
    sm_count: int
    smem_optin: int    # max dynamic + static shared memory per block after opting in
    l2_bytes: int      # L2 cache size (fwd_sm90 orders its work items by it: tiles.item_chunk)


def arch_for(major: int, minor: int, name: str = "this GPU") -> str:
    """The arch flashrt compiles for on a GPU of compute capability major.minor (8.0 or newer: the kernels use
    mma.sync with bf16, cp.async and ldmatrix). sm_90a unlocks Hopper-only instructions; its cubins run only on
    compute capability 9.0."""
    if major < 8:
        raise LaunchError(f"flashrt needs a GPU of compute capability 8.0 or newer (Ampere, Ada, Hopper); {name} is "
                          f"{major}.{minor}")
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def check_driver(driver_version: int, nvrtc_version: tuple[int, int]) -> None:
    """Cubins from NVRTC of CUDA major N load only on drivers of major >= N: say so before a load fails."""
    driver_major, driver_minor = driver_version // 1000, driver_version % 1000 // 10
    if nvrtc_version[0] > driver_major:
        raise LaunchError(
            f"flashrt compiles with NVRTC {nvrtc_version[0]}.{nvrtc_version[1]}, whose kernels need a CUDA "
            f"{nvrtc_version[0]} driver, but this driver supports CUDA {driver_major}.{driver_minor}: install the "
            f"CUDA {driver_major} build (pip install 'flashrt[cuda{driver_major}]', which brings its NVRTC and "
            f"CuPy) and uninstall the CUDA {nvrtc_version[0]} NVRTC wheel, or update the NVIDIA driver")


@lru_cache(maxsize=None)
def device(index: int) -> Device:
    import cupy
    check_driver(cupy.cuda.runtime.driverGetVersion(), nvrtc.version())
    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return Device(index, name, arch_for(props["major"], props["minor"], name), props["multiProcessorCount"],
                  props["sharedMemPerBlockOptin"], props["l2CacheSize"])


# ---------------------------------------------------------------------------
# Grids
# ---------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _axes(layout: str, **extents: int) -> tuple[int, int, int]:
    """A grid's (x, y, z) from its coordinates' extents, in the axes params.GRID_AXES gives `layout` (the kernels read
    them through the same table: kernels_cu/attention/params.cuh, grid_index)."""
    return tuple(extents[c] for c in params.GRID_AXES[layout])


def grid(spec: KernelSpec, B: int, H: int, Hkv: int, Sq: int, Sk: int, sm_count: int = 132,
         splits: int = 1, row_warps: int = 1) -> tuple[int, int, int]:
    """Launch grid of a variant: the tiled kernels' axes as params.GRID_AXES lays them out (fwd_sm90: a 1-D grid of
    work items, kernels_cu/attention/params.cuh: work_item; the elementwise kernels: grid-stride loops)."""
    if spec.family == "fwd_sm90":
        g = (_cdiv(Sq, spec.block_m) * H * B, 1, 1)
    elif spec.family == "fwd_sm90_ws":  # persistent: one block per SM, at most one per work item
        g = (min(_cdiv(Sq, spec.block_m) * H * B, sm_count), 1, 1)
    elif spec.family == "decode":  # Sq: rows
        g = _axes("decode", split=splits, kv_head_row_tile=Hkv * _cdiv(H // Hkv * Sq, spec.block_m), batch=B)
    elif spec.family in QUERY_PARALLEL:
        g = _axes("query", tile=_cdiv(Sq, spec.block_m), head=H, batch=B)
    elif spec.family in CLASSIFY:  # kernels_cu/helpers/mask_classify.cu; B, H: the lists' batch entries and heads
        m_tiles, n_tiles, nw = _cdiv(Sq, spec.block_m), _cdiv(Sk, spec.block_n), spec.warps
        g = {"mask_map": _axes("mask_map", slot_block=_cdiv(n_tiles, tiles.map_slots(spec)), query_tile=m_tiles,
                               batch_head=B * H),
             "mask_rows": (_cdiv(B * H * m_tiles, nw), 1, 1), "mask_cols": (_cdiv(B * H * n_tiles, nw), 1, 1)}[spec.family]
    elif spec.family in KEY_PARALLEL:
        g = _axes("key", tile=_cdiv(Sk, spec.block_n), split_kv_head=Hkv * splits, batch=B)
    elif spec.family == "mask_check":  # one block (kernels_cu/helpers/mask_check.cu)
        g = (1, 1, 1)
    elif spec.family in ELEMENTWISE:  # grid-stride loops: enough blocks for the work, at most 32 per SM
        work = {"bwd_preprocess": (B * H * Sq, spec.warps),  # one warp per (b, h, query) row
                "bwd_dkdv_reduce": (B * Hkv * Sk * spec.head_dim // 8, spec.threads),  # a thread per 8 elements
                "bwd_dq_convert": (B * H * Sq * spec.head_dim // 8, spec.threads),
                # a thread per 8 columns at the most (256: spec.ANY_HEAD_DIM's instance; grid-stride over fewer)
                "combine_rows": (B * H * Sq * spec.head_dim // 8, spec.threads),
                "combine_rows_f32": (B * H * Sq * spec.head_dim // 8, spec.threads)}.get(
                    spec.family, (B * H * Sq * row_warps, spec.warps))  # the combines: row_warps warps per row
        g = (max(1, min(_cdiv(*work), 32 * sm_count)), 1, 1)
    else:
        raise ValueError(spec.family)
    if spec.family == "mask_map" and B * H > _MAX_GRID_YZ:
        raise LaunchError(f"{spec.name}: mask_mod needs a tile map per (batch entry, head) here, {B} x {H} = {B * H} "
                          f"of them, more than the {_MAX_GRID_YZ} one launch takes; split the batch, or write the "
                          f"expression without h (and without b / tensors) so that one map serves every head")
    if g[1] > _MAX_GRID_YZ or g[2] > _MAX_GRID_YZ or g[0] >= 2**31:
        raise LaunchError(f"{spec.name}: grid {g} exceeds the CUDA limit of {_MAX_GRID_YZ} on its y/z axes "
                          f"(heads={H}, batch={B}); split the batch into chunks of at most {_MAX_GRID_YZ}")
    return g


# ---------------------------------------------------------------------------
# Loading and launching
# ---------------------------------------------------------------------------
_functions: dict[tuple[str, int], object] = {}
_load_lock = threading.Lock()


def check_fits(spec: KernelSpec, dev: Device) -> None:
    if spec.smem_bytes > dev.smem_optin:
        raise LaunchError(f"{spec.name} needs {spec.smem_bytes} bytes of shared memory per block but "
                          f"{dev.name} allows at most {dev.smem_optin}; use a smaller tiling "
                          f"(tiles.tiling chooses one that fits)")


def _capturing(dev: Device) -> bool:
    """Whether CuPy's or torch's current stream on dev is being captured into a CUDA graph."""
    import sys
    import cupy
    torch = sys.modules.get("torch")  # looked up, never imported: only a torch program captures with it
    streams = [cupy.cuda.get_current_stream(dev.index).ptr]
    if torch is not None and torch.cuda.is_initialized():
        streams.append(torch.cuda.current_stream(dev.index).cuda_stream)
    # 0 and 1 are the legacy stream: never captured, and querying it during another capture is an error.
    return any(ptr > 1 and cupy.cuda.runtime.streamIsCapturing(ptr) for ptr in streams)


def function(spec: KernelSpec, dev: Device):
    """The loaded kernel of `spec` on `dev` (compiled or read from cache on first use)."""
    fn = _functions.get((spec.name, dev.index))
    if fn is not None:
        return fn
    import cupy
    if _capturing(dev):  # a compile or module load cannot be recorded into a CUDA graph
        raise LaunchError(f"{spec.name} is not loaded yet, and the current CUDA stream is being captured into a "
                          f"CUDA graph, where a kernel cannot be compiled or loaded: run the same attention call "
                          f"once before capture (a warm-up step, as torch.cuda.graph's docs recommend and "
                          f"torch.compile(mode='reduce-overhead') does)")
    check_fits(spec, dev)
    cubin = cache.get_cubin(spec)
    from cupy_backends.cuda.api import driver
    with _load_lock, cupy.cuda.Device(dev.index):
        fn = _functions.get((spec.name, dev.index))
        if fn is None:
            module = cupy.cuda.function.Module()
            module.load(cubin)
            fn = module.get_function(spec.name)
            static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn.ptr)
            max_threads = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn.ptr)
            if spec.threads > max_threads:
                regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, fn.ptr)
                raise LaunchError(f"{spec.name} uses {regs} registers per thread, so at most {max_threads} "
                                  f"threads per block fit on {dev.name}, but it needs {spec.threads}")
            if static + spec.smem_bytes > dev.smem_optin:
                raise LaunchError(f"{spec.name} needs {static + spec.smem_bytes} bytes of shared memory "
                                  f"({spec.smem_bytes} dynamic + {static} static) but {dev.name} allows "
                                  f"{dev.smem_optin}")
            if static + spec.smem_bytes > _DEFAULT_SMEM:  # (the default's 48 KB count static memory too)
                driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        spec.smem_bytes)
            _functions[(spec.name, dev.index)] = fn
    return fn


def function_attributes(spec: KernelSpec, dev: Device) -> dict:
    """Registers, spills (local bytes) and shared memory of a loaded kernel."""
    from cupy_backends.cuda.api import driver
    fn = function(spec, dev)
    get = lambda attr: driver.funcGetAttribute(attr, fn.ptr)  # noqa: E731
    return {"num_regs": get(driver.CU_FUNC_ATTRIBUTE_NUM_REGS),
            "local_size_bytes": get(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
            "shared_size_bytes": get(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
            "max_dynamic_shared_size_bytes": get(driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)}


@lru_cache(maxsize=None)
def _cuda():
    """CuPy's runtime and driver bindings, imported on first use (import flashrt does not load CuPy)."""
    import cupy
    from cupy_backends.cuda.api import driver
    return cupy, driver


class Sequence:
    """Kernel launches that run in order, again and again, with their params structs rewritten in place.

    launches: (spec, grid, struct index[, cluster]) each (cluster: blocks along x in a thread block cluster, sm_90;
    the grid's x a multiple of it); templates: the packed params structs (params.pack), one
    kernel argument each. Each thread gets its own writable ctypes copies of the structs (buffers());
    the caller writes its pointers into them and calls launch(stream). cuLaunchKernel through CuPy's
    driver binding copies the struct at each call, so a later run may overwrite it at once (a CuPy
    Function call, or a ctypes copy per launch, costs several times more host time).
    """

    def __init__(self, dev: Device, launches: list, templates: list):
        for before, (spec, *_) in zip([None, *launches], launches):
            after = PROGRAMMATIC.get(spec.family) if spec.programmatic else None
            if after and (before is None or before[0].family != after):
                raise LaunchError(f"{spec.name} is a programmatic dependent launch that must follow {after}, not "
                                  f"{before[0].name if before else 'nothing'} (spec.PROGRAMMATIC)")
        self.dev, self.launches, self.templates = dev, launches, templates
        self._local = threading.local()

    def buffers(self) -> list:
        """This thread's params structs, writable (made, and the kernels loaded, on this thread's first use)."""
        mine = getattr(self._local, "mine", None)
        if mine is None:
            # (the kernels not loaded yet compiled or read at once: cache.prefetch; under capture function() says why
            # none may be, first)
            pending = [spec for spec, *_ in self.launches if (spec.name, self.dev.index) not in _functions]
            if pending and not _capturing(self.dev):
                for spec in pending:
                    check_fits(spec, self.dev)
                cache.prefetch(pending)
            structs = [(ctypes.c_char * len(t)).from_buffer_copy(t) for t in self.templates]
            pointers = [_ONE_POINTER(ctypes.addressof(s)) for s in structs]  # kernelParams: one pointer each
            calls = [(function(spec, self.dev).ptr, grid_dims, spec, ctypes.addressof(pointers[i]),
                      _launch_config(spec, grid_dims, spec.programmatic, cluster[0] if cluster else 1))
                     for spec, grid_dims, i, *cluster in self.launches]
            mine = self._local.mine = (structs, pointers, calls)
        return mine[0]

    def launch(self, stream: int) -> None:
        """Enqueue every launch on the raw stream handle `stream` (interop.stream), with this thread's structs.

        cuLaunchKernel needs the device's context current on this thread. A thread that has made no CUDA
        runtime call has none, even where the runtime's current device is this one: autograd's backward
        thread, its allocations all from torch's cache, failed with CUDA_ERROR_INVALID_CONTEXT. Setting the
        device makes its primary context current (CUDA >= 12)."""
        cupy, driver = _cuda()
        calls = self._local.mine[2]
        previous = make_current(self.dev.index)
        try:
            _enqueue(calls, stream, driver)
        finally:
            if previous is not None:
                cupy.cuda.runtime.setDevice(previous)


def make_current(index: int) -> int | None:
    """Make device `index`'s primary context current on this thread, for driver calls (Sequence.launch, p2p.py's stream
    memory operations); returns the device to set back afterwards, or None."""
    cupy, driver = _cuda()
    current = cupy.cuda.runtime.getDevice()
    if current == index and driver.ctxGetCurrent():
        return None
    cupy.cuda.runtime.setDevice(index)
    return current if current != index else None


def _enqueue(calls: list, stream: int, driver) -> None:
    for fn, (gx, gy, gz), spec, kernel_params, config in calls:
        try:
            if config is None:
                driver.launchKernel(fn, gx, gy, gz, spec.threads, 1, 1, spec.smem_bytes, stream, kernel_params, 0)
            else:
                config.stream = stream
                status = _launch_kernel_ex()(ctypes.addressof(config), fn, kernel_params, None)
                if status:
                    raise LaunchError(f"cuLaunchKernelEx returned CUresult {status}")
        except Exception as exc:
            raise LaunchError(f"launch of {spec.name} failed (grid={(gx, gy, gz)}, block={spec.threads}, "
                              f"dynamic smem={spec.smem_bytes} B): {exc}") from exc


@lru_cache(maxsize=None)
def driver_library() -> ctypes.CDLL:
    """The CUDA driver library, for the calls that neither CuPy nor torch exposes (tma.py's map encoding,
    the programmatic launch below)."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise LaunchError(f"cannot load the CUDA driver library ({' or '.join(names)})")


class _LaunchAttribute(ctypes.Structure):  # cuda.h: CUlaunchAttribute (an id padded to 8 bytes, a 64-byte union)
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("value", ctypes.c_int32 * 16)]


class _LaunchConfig(ctypes.Structure):  # cuda.h: CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("smem", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("n_attrs", ctypes.c_uint32)]


_CLUSTER_DIMENSION, _PROGRAMMATIC_STREAM_SERIALIZATION = 4, 6  # cuda.h: CUlaunchAttributeID


def _launch_config(spec: KernelSpec, grid_dims: tuple, programmatic: bool, cluster: int) -> _LaunchConfig | None:
    """A launch config (this thread's: _enqueue writes the stream into it), or None for a plain launch: with
    `programmatic`, `spec` may start before the kernel ahead of it in the stream ends (spec.KernelSpec.programmatic);
    with cluster > 1, each `cluster` blocks along x are one thread block cluster (at most 8, the portable size)."""
    attrs = []
    if programmatic:
        attrs.append(_LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION))
        attrs[-1].value[0] = 1  # programmaticStreamSerializationAllowed
    if cluster > 1:
        if not (cluster <= 8 and grid_dims[0] % cluster == 0):
            raise LaunchError(f"{spec.name}: a cluster of {cluster} blocks along x needs at most 8 and a grid x "
                              f"({grid_dims[0]}) that it divides")
        attrs.append(_LaunchAttribute(id=_CLUSTER_DIMENSION))
        attrs[-1].value[0:3] = [cluster, 1, 1]  # clusterDim x, y, z
    if not attrs:
        return None
    array = (_LaunchAttribute * len(attrs))(*attrs)
    config = _LaunchConfig(grid=(ctypes.c_uint32 * 3)(*grid_dims), block=(ctypes.c_uint32 * 3)(spec.threads, 1, 1),
                           smem=spec.smem_bytes, attrs=array, n_attrs=len(attrs))
    config._attrs = array  # (kept alive with the config)
    return config


@lru_cache(maxsize=None)
def _launch_kernel_ex():
    fn = driver_library().cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_ONE_POINTER = ctypes.c_void_p * 1

REPORT = None  # report_words' int32 array, once made (masks.raise_reported reads it at every call)
REPORT_LEN = 8  # int32 words (params.REPORT_WORDS, rounded up)
_checked_devices: set = set()


def report_words(dev: Device) -> int:
    """The address of the device checks' report (kernels_cu/helpers/mask_check.cu), for kernels on `dev`: REPORT_LEN
    int32 words of pinned host memory, mapped into every device's address space (portable, mapped: under unified
    addressing its host address is its device address), all zero until a check fails. The host reads it with a
    plain load, no copy and no synchronisation (masks.raise_reported). Made once per process, never freed."""
    global REPORT
    _checked_devices.add(dev.index)
    if REPORT is None:
        cupy, _ = _cuda()
        with cupy.cuda.Device(dev.index):
            ptr = cupy.cuda.runtime.hostAlloc(4 * REPORT_LEN, cupy.cuda.runtime.hostAllocPortable
                                              | cupy.cuda.runtime.hostAllocMapped)
        words = (ctypes.c_int32 * REPORT_LEN).from_address(ptr)
        ctypes.memset(ptr, 0, 4 * REPORT_LEN)
        REPORT = words
    return ctypes.addressof(REPORT)


def synchronize_checked() -> None:
    """Wait for every device that has run a device check (so that their reports are in)."""
    cupy, _ = _cuda()
    for index in sorted(_checked_devices):
        with cupy.cuda.Device(index):
            cupy.cuda.runtime.deviceSynchronize()

_SCHED: dict = {}  # (device index, raw stream handle) -> address of fwd_sm90_ws's work-item counter


def sched_counter(dev: Device, stream: int) -> int | None:
    """The work-item counter of fwd_sm90_ws's launches on `stream` (kernels_cu/sm90/fwd_sm90_ws.cu): 4 bytes of device
    memory of this module's, zeroed once in the stream's order and never freed. Each launch's last claim sets it
    back to zero, and launches on one stream run one after another, so no launch needs a fill of its own (a fill
    kernel and its gap cost ~2.5 us a call). (A destroyed stream's handle is released only after its work is
    done, so a later stream with the same handle finds the counter at zero.)

    None while the stream is being captured into a CUDA graph: a graph may be replayed on any stream, beside
    other launches, so a captured launch takes a zeroed counter of its own (api._Plan.run).
    """
    cupy, _ = _cuda()
    # (0 and 1 are the legacy stream: never captured, and querying it during another capture is an error.)
    if stream > 1 and cupy.cuda.runtime.streamIsCapturing(stream):
        return None
    key = (dev.index, stream)
    ptr = _SCHED.get(key)
    if ptr is None:
        with cupy.cuda.Device(dev.index):
            ptr = cupy.cuda.runtime.malloc(4)
            cupy.cuda.runtime.memsetAsync(ptr, 0, 4, stream)
        ptr = _SCHED.setdefault(key, ptr)
    return ptr
