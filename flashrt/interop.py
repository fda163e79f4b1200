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
import math

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
        elif not x.is_cuda and x.device.type != "cpu":
            _not_on_cuda(x, name)
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


def _not_on_cuda(x, name: str) -> None:
    """Raise the ValueError for a torch tensor on a device that is neither CUDA nor the host."""
    if x.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (a shape and dtype with no data); flashrt computes on CUDA tensors: "
                         f"create {name} on a CUDA device (for a model built on the meta device: "
                         f"model.to_empty(device='cuda'), then load its weights); flashrt.attention takes meta "
                         f"tensors to infer output shapes")
    raise ValueError(f"{name} is on device {x.device}; flashrt needs CUDA tensors: move it with {name}.cuda()")


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


_KINDS = {"f32": "float32", "i32": "int32", "i64": "int64"}  # new_many's kinds besides "like", as dtype names


def new_many(x, specs: list) -> list:
    """For each (shape, kind, fill) in specs, a new contiguous array in the library and on the device of x
    (a torch tensor or CuPy array): of x's dtype (kind "like"), fp32 ("f32"), int32 ("i32") or int64 ("i64");
    uninitialised, or filled with `fill`."""
    if is_torch(x):
        import torch
        device, out = x.device, []
        for shape, kind, fill in specs:
            a = torch.empty(shape, dtype=x.dtype if kind == "like" else getattr(torch, _KINDS[kind]), device=device)
            out.append(a if fill is None else a.fill_(fill))
        return out
    import cupy
    with cupy.cuda.Device(x.device.id):
        out = [cupy.empty(shape, dtype=x.dtype if kind == "like" else _KINDS[kind]) for shape, kind, _ in specs]
        for a, (_, _, fill) in zip(out, specs):
            if fill is not None:
                a.fill(fill)
    return out


def data_ptr(x) -> int:
    """Device address of a torch tensor or CuPy array (cheaper than describe())."""
    return x.data_ptr() if is_torch(x) else x.data.ptr


def data_ptrs(xs) -> list[int]:
    """data_ptr of each of xs, all from one library, with one library dispatch."""
    return [x.data_ptr() for x in xs] if xs and is_torch(xs[0]) else [x.data.ptr for x in xs]


def check_beside(a: Array, q: Array, name: str) -> None:
    """`a` (an argument of a call on q) is an array of q's library on q's device."""
    if a.lib != q.lib or a.device != q.device:
        raise ValueError(f"{name} must be a {q.lib} array on cuda:{q.device} like q, got {a.lib} on "
                         f"{'cuda:%d' % a.device if a.device >= 0 else 'the host'}")


def check_contiguous(a: Array, name: str) -> None:
    """`a` is C-contiguous (an axis of size 1 may have any stride)."""
    contiguous = [math.prod(a.shape[i + 1:]) for i in range(len(a.shape))]
    if any(n > 1 and st != c for n, st, c in zip(a.shape, a.strides, contiguous)):
        raise ValueError(f"{name} must be contiguous, got strides {a.strides}; pass {name}.contiguous()")


def to_numpy(a: Array):
    """A host copy of a small array (synchronises with the device)."""
    if a.lib == "torch":
        return a.obj.detach().cpu().numpy()
    import cupy
    return cupy.asnumpy(a.obj)


def stream(x) -> int:
    """The raw handle of the stream to launch on: the current stream of x's library (x a torch tensor or
    CuPy array) on its device."""
    if not is_torch(x):
        import cupy
        with cupy.cuda.Device(x.device.id):
            return cupy.cuda.get_current_stream().ptr
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~1 us instead of ~5
    if raw is not None:
        return raw(x.device.index)
    return torch.cuda.current_stream(x.device.index).cuda_stream
