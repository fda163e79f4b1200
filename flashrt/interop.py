"""torch tensors and CuPy arrays -> one descriptor; outputs and streams in the caller's library.

No data is converted or copied: kernels read the caller's memory through its
pointer and strides, outputs are allocated by the caller's own library (torch's
caching allocator or CuPy's memory pool), and kernels run on that library's
current stream, so no host synchronisation is needed. (torch <-> CuPy exchange,
where a user wants it, goes through DLPack; CuPy reads bf16 only with
ml_dtypes installed, and torch exports a tensor that requires grad only
after .detach().)
"""
from __future__ import annotations

import dataclasses

DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16"}


@dataclasses.dataclass(frozen=True)
class Array:
    obj: object
    lib: str                 # "torch" | "cupy"
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str               # "bf16" | "fp16" | the library's own name for anything else
    device: int              # CUDA device index; -1 for host memory
    itemsize: int


def _lib_of(x) -> str | None:
    mod = type(x).__module__.split(".")[0]
    return mod if mod in ("torch", "cupy") else None


def describe(x, name: str) -> Array:
    """Descriptor of a torch tensor or CuPy array; TypeError names the argument otherwise."""
    lib = _lib_of(x)
    if lib == "torch":
        dtype = str(x.dtype).replace("torch.", "")
        device = x.device.index if x.is_cuda else -1
        if x.is_cuda and device is None:
            device = 0
        return Array(x, lib, x.data_ptr(), tuple(x.shape), tuple(x.stride()), DTYPE_NAMES.get(dtype, dtype),
                     device, x.element_size())
    if lib == "cupy":
        import cupy
        if isinstance(x, cupy.ndarray):
            itemsize = x.dtype.itemsize
            dtype = x.dtype.name
            return Array(x, lib, x.data.ptr, tuple(x.shape), tuple(s // itemsize for s in x.strides),
                         DTYPE_NAMES.get(dtype, dtype), x.device.id, itemsize)
    raise TypeError(f"{name} must be a torch CUDA tensor or a CuPy array, got {type(x).__module__}.{type(x).__name__}")


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def new(x, shape: tuple[int, ...], kind: str = "like", fill: float | None = None):
    """A new contiguous array in the library and on the device of x (a torch tensor or CuPy array):
    of x's dtype (kind "like"), fp32 ("f32") or int32 ("i32"); uninitialised, or filled with `fill`."""
    if is_torch(x):
        import torch
        dtype = x.dtype if kind == "like" else torch.float32 if kind == "f32" else torch.int32
        out = torch.empty(shape, dtype=dtype, device=x.device)
        return out if fill is None else out.fill_(fill)
    import cupy
    with cupy.cuda.Device(x.device.id):
        out = cupy.empty(shape, dtype=x.dtype if kind == "like" else cupy.float32 if kind == "f32" else cupy.int32)
        if fill is not None:
            out.fill(fill)
    return out


def data_ptr(x) -> int:
    """Device address of a torch tensor or CuPy array (cheaper than describe())."""
    return x.data_ptr() if is_torch(x) else x.data.ptr


def to_numpy(a: Array):
    """A host copy of a small array (synchronises with the device)."""
    if a.lib == "torch":
        return a.obj.detach().cpu().numpy()
    import cupy
    return cupy.asnumpy(a.obj)


_external_streams: dict[tuple[int, int], object] = {}


class _StreamHandle:
    """A raw CUDA stream handle, exposed through the CUDA stream protocol."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _wrap_stream(ptr: int, device: int):
    import cupy
    from_external = getattr(cupy.cuda.Stream, "from_external", None)  # CuPy >= 14
    if from_external is not None:
        with cupy.cuda.Device(device):
            return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device)


def stream(x):
    """The stream to launch on: the current stream of x's library (x a torch tensor or CuPy array) on its device."""
    if not is_torch(x):
        import cupy
        with cupy.cuda.Device(x.device.id):
            return cupy.cuda.get_current_stream()
    import torch
    device = x.device.index
    ptr = torch.cuda.current_stream(device).cuda_stream
    s = _external_streams.get((device, ptr))
    if s is None:
        s = _external_streams[(device, ptr)] = _wrap_stream(ptr, device)
    return s
