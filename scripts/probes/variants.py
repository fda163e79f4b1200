"""A/B of compile-time variants in one probe process: after a probe patches what a kernel is built from (a KernelSpec
property, spec.NVRTC_OPTIONS, a tiles rule), fresh() drops what the library has loaded, planned and cached, so that
the next call compiles and plans the variant now patched in. What was dropped stays alive here: CUDA graphs captured
earlier still launch those kernels and use those plans' buffers."""
from flashrt import api, launch, tiles

_kept = []


def fresh() -> None:
    _kept.extend(list(launch._functions.values()) + list(api._PLANS.values()))
    launch._functions.clear()
    api._PLANS.clear()
    for f in vars(tiles).values():  # (cached specs hold their shared-memory size)
        if hasattr(f, "cache_clear"):
            f.cache_clear()
