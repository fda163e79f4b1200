"""Validation and layout rules of the public API that need no GPU (array descriptors are plain data)."""
import pytest

from flashrt import api
from flashrt.interop import Array


def arr(shape, strides=None, ptr=0x10000, dtype="bf16", device=0):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return Array(None, "torch", ptr, tuple(shape), tuple(strides), dtype, device, 2)


def test_contiguous_and_packed_layouts_pass():
    api._check_layout(arr((2, 128, 8, 64)), "q")
    api._check_layout(arr((2, 128, 8, 64), strides=(128 * 3 * 8 * 64, 3 * 8 * 64, 64, 1)), "q")  # from qkv
    api._check_layout(arr((2, 128, 8, 64), strides=(8 * 128 * 64, 64, 128 * 64, 1)), "q")  # (B,H,S,D).T


def test_layout_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"k must be contiguous in its last .*k\.contiguous\(\)"):
        api._check_layout(arr((2, 4, 2, 64), strides=(512, 128, 1, 2)), "k")
    with pytest.raises(ValueError, match=r"v has stride 68 on axis 2.*multiples of 8"):
        api._check_layout(arr((2, 4, 2, 64), strides=(544, 136, 68, 1)), "v")
    with pytest.raises(ValueError, match=r"q's data pointer 0x10002 is not 16-byte aligned.*q\.clone\(\)"):
        api._check_layout(arr((2, 4, 2, 64), ptr=0x10002), "q")


def test_size_one_axes_ignore_their_stride():
    a = arr((1, 1, 1, 64), strides=(3, 5, 7, 1))
    api._check_layout(a, "q")
    assert api._strides(a) == (0, 0, 0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_softmax_scale_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="softmax_scale"):
        api._scale(bad, 64)
    assert api._scale(None, 64) == 0.125


def test_non_array_inputs_are_rejected():
    with pytest.raises(TypeError, match="q must be a torch CUDA tensor or a CuPy array"):
        api.forward([[1.0]], None, None)


def test_backward_impl_options_are_checked_before_any_work():
    # Rejected before the inputs are even looked at (None would fail there).
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'split', 'fused'\), got 'fast'"):
        api.backward(None, None, None, None, None, None, impl="fast")
    with pytest.raises(ValueError, match=r"impl must be one of"):
        api.backward(None, None, None, None, None, None, impl=None, deterministic=False)
