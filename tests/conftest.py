import os
import tempfile

import pytest


def _gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


HAS_GPU = _gpu_count() > 0


def pytest_configure(config):
    # GPU tests share one cache folder per session (so kernels compile once), never the user's cache.
    if HAS_GPU and not os.environ.get("FLASHRT_CACHE_DIR"):
        os.environ["FLASHRT_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashrt-test-cache-")


_compiling = []  # test_compile.py, once its background compiles have started


@pytest.hookimpl(trylast=True)  # (after -k / -m deselection)
def pytest_collection_modifyitems(config, items):
    # The tests that read test_compile.py's compiled variants run last, and their compiles start now, in the
    # background (test_compile.py: start_compiling), while the other tests run.
    late = [item for item in items if "compiled" in getattr(item, "fixturenames", ())
            and hasattr(getattr(item, "module", None), "start_compiling")]
    if late:
        items[:] = [item for item in items if item not in late] + late
        if not config.option.collectonly:
            _compiling.append(late[0].module)
            late[0].module.start_compiling()
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to CuPy); run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session):
    # (a session that ends before test_compile.py's tests read the compiles, -x or Ctrl-C: stop the workers)
    for module in _compiling:
        module.stop_compiling()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty kernel cache for one test."""
    from flashrt import cache
    d = tmp_path / "cache"
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(d))
    monkeypatch.delenv("FLASHRT_NO_COMPILE", raising=False)
    cache._memory.clear()
    cache._warned.clear()
    yield d
    cache._memory.clear()
    cache._warned.clear()
