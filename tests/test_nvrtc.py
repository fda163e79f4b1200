"""NVRTC faults: a missing or unsupported library, which NVRTC is chosen among several, compile errors with
FLASHRT_DUMP_SOURCE, cubin arch."""
import ctypes
import importlib.metadata
import os
import sys
import types

import pytest

from flashrt import _env, cache, nvrtc
from flashrt.nvrtc import Candidate
from flashrt.spec import KernelSpec

SPEC = KernelSpec("fwd", 64, "bf16", 64, 64, 4, False, "sm_80")
ERROR = "#error flashrt-test: broken on purpose"


@pytest.fixture
def reload_nvrtc():
    """Forget the loaded NVRTC before and after a test that changes how it is found."""
    nvrtc._lib.cache_clear()
    yield
    nvrtc._lib.cache_clear()


def test_missing_nvrtc_names_the_pip_extra(monkeypatch, reload_nvrtc):
    from cuda import pathfinder

    def not_found(*args, **kwargs):
        raise OSError("no such library")

    major = nvrtc._cupy_cuda()[0]  # CuPy is installed (and imported by conftest): cupy-cuda12x here, 13x on the GPU
    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", not_found)
    monkeypatch.setattr(ctypes, "CDLL", not_found)
    with pytest.raises(nvrtc.NvrtcUnavailable) as info:
        nvrtc.version()
    msg = str(info.value)
    # the extra of CuPy's CUDA major, from an index and a checkout
    assert f'pip install "flashrt[cuda{major}]"' in msg and f'pip install ".[cuda{major}]"' in msg and "CuPy" in msg
    assert f"libnvrtc.so.{major}: no such library" in msg  # says what was tried
    assert "cuda.pathfinder: no such library" in msg

    nvrtc._lib.cache_clear()
    monkeypatch.setattr(nvrtc, "_cupy_cuda", lambda: None)  # no CuPy: both extras
    with pytest.raises(nvrtc.NvrtcUnavailable) as info:
        nvrtc.version()
    msg = str(info.value)
    assert 'pip install "flashrt[cuda12]"' in msg and 'pip install "flashrt[cuda13]"' in msg
    assert 'pip install ".[cuda12]"' in msg and '".[cuda13]"' in msg


def test_unsupported_nvrtc_major_names_the_pip_extra(monkeypatch, reload_nvrtc):
    real_major = nvrtc.version()[0]
    nvrtc._lib.cache_clear()
    monkeypatch.setattr(nvrtc, "_SUPPORTED_MAJORS", (real_major + 50,))  # (none installed has it)
    # (the message names the NVRTC it loaded: with CUDA 12 and 13 wheels both installed, torch's beside CuPy's, the
    # newest when none is supported)
    with pytest.raises(nvrtc.NvrtcUnavailable, match=r"NVRTC 1[23]\.\d+ \(.*\) is not supported.*"
                                                     r'pip install "flashrt\[cuda12\]"'):
        nvrtc.version()


# ---------------------------------------------------------------------------
# Which NVRTC among several. Only one NVRTC is installed here: every candidate path "opens" the real library, and the
# order in which they were tried says which one was chosen.
# ---------------------------------------------------------------------------
SITE = os.path.join(os.sep, "site-packages", "nvidia")
NVRTC13 = Candidate(13, os.path.join(SITE, "cu13", "lib", "libnvrtc.so.13"), "site-packages")  # torch's CUDA 13 wheel
NVRTC12 = Candidate(12, os.path.join(SITE, "cuda_nvrtc", "lib", "libnvrtc.so.12"), "site-packages")


@pytest.fixture
def world(monkeypatch, reload_nvrtc):
    """set(found=[candidates], cupy=[CuPy wheels installed], driver=(major, minor) | None, env=FLASHRT_NVRTC); returns
    the list of paths opened, in order. CuPy counts as not imported (its metadata is asked)."""
    real = nvrtc.library_path()
    nvrtc._lib.cache_clear()
    real_open, opened = nvrtc._open, []

    def fake_open(path):
        opened.append(path)
        return real_open(real)

    def configure(found, cupy=(), driver=None, env=None):
        monkeypatch.setattr(nvrtc, "candidates", lambda: list(found))
        monkeypatch.setitem(sys.modules, "cupy", None)

        def version(dist):
            if dist in cupy:
                return "14.0.0"
            raise importlib.metadata.PackageNotFoundError(dist)

        monkeypatch.setattr(importlib.metadata, "version", version)
        monkeypatch.setattr(nvrtc, "_driver_cuda", lambda: driver)
        monkeypatch.setattr(nvrtc, "_open", fake_open)
        if env is None:
            monkeypatch.delenv("FLASHRT_NVRTC", raising=False)
        else:
            monkeypatch.setenv("FLASHRT_NVRTC", env)
        return opened

    configure.real = real
    return configure


def test_choice_says_what_was_loaded_and_why(reload_nvrtc):
    version, path, reason = nvrtc.choice()
    assert version == nvrtc.version() and path == nvrtc.library_path() and reason


def test_cupy_cuda12x_with_nvrtc_12_and_13_loads_12(world):
    # pip install ".[cuda12,torch]": torch's CUDA 13 NVRTC is found first (as cuda.pathfinder would take it),
    # and the driver supports CUDA 13, but CuPy is cupy-cuda12x.
    opened = world([NVRTC13, NVRTC12], cupy=("cupy-cuda12x",), driver=(13, 0))
    assert nvrtc.choice()[1:] == (NVRTC12.path, "matches cupy-cuda12x")
    assert opened == [NVRTC12.path]


def test_cupy_cuda13x_loads_13(world):
    opened = world([NVRTC12, NVRTC13], cupy=("cupy-cuda13x",), driver=(13, 0))
    assert nvrtc.choice()[1:] == (NVRTC13.path, "matches cupy-cuda13x")
    assert opened == [NVRTC13.path]


def test_without_a_match_the_next_candidate_loads(world, monkeypatch):
    gone = Candidate(12, "libnvrtc.so.12", "system")
    opened = world([gone, NVRTC13], cupy=("cupy-cuda12x",))
    calls = []

    def first_fails(path):
        calls.append(path)
        if path == gone.path:
            raise OSError("no such library")
        return ctypes.CDLL(world.real)

    monkeypatch.setattr(nvrtc, "_open", first_fails)
    assert nvrtc.choice()[1:] == (NVRTC13.path, "none for cupy-cuda12x; newest found")
    assert calls == [gone.path, NVRTC13.path] and not opened


def test_plan_order_cupy_then_driver_then_newest():
    found = [NVRTC13, NVRTC12]
    plan = lambda cupy, driver: [(c.major, why) for c, why in nvrtc._plan(found, cupy, driver)]  # noqa: E731
    assert plan((12, "cupy-cuda12x"), (13, 0)) == [(12, "matches cupy-cuda12x"),
                                                  (13, "none for cupy-cuda12x; matches the driver's CUDA 13.0")]
    assert plan(None, (12, 8)) == [(12, "matches the driver's CUDA 12.8"), (13, "none for the driver's CUDA 12.8; "
                                                                                "newest found")]
    assert plan(None, None) == [(13, "newest found"), (12, "newest found")]
    assert plan((11, "cupy-cuda11x"), None)[0] == (13, "newest found")  # no NVRTC 11: flashrt needs 12 or 13
    # CuPy's major first, even past the driver's (launch.check_driver then says which build to install)
    assert plan((13, "cupy-cuda13x"), (12, 2)) == [(13, "matches cupy-cuda13x"),
                                                  (12, "none for cupy-cuda13x; matches the driver's CUDA 12.2")]
    old = Candidate(11, "/usr/local/cuda-11.8/lib64/libnvrtc.so.11.2", "CUDA_HOME")
    assert [c.major for c, _ in nvrtc._plan([old, NVRTC13, NVRTC12], None, (12, 4))] == [12, 13, 11]


def test_cupy_major_from_the_imported_cupy_or_its_wheel(monkeypatch):
    runtime = types.SimpleNamespace(runtimeGetVersion=lambda: 13010)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    assert nvrtc._cupy_cuda() == (13, "CuPy's CUDA 13.1 runtime")
    monkeypatch.setitem(sys.modules, "cupy", None)  # not imported: the wheel's name

    def version(installed):
        def get(dist):
            if dist in installed:
                return "14.0.0"
            raise importlib.metadata.PackageNotFoundError(dist)
        return get

    monkeypatch.setattr(importlib.metadata, "version", version({"cupy-cuda12x"}))
    assert nvrtc._cupy_cuda() == (12, "cupy-cuda12x")
    monkeypatch.setattr(importlib.metadata, "version", version(set()))
    assert nvrtc._cupy_cuda() is None
    monkeypatch.setattr(importlib.metadata, "version", version({"cupy-cuda12x", "cupy-cuda13x"}))
    assert nvrtc._cupy_cuda() is None  # two CuPy wheels: no answer


def test_flashrt_nvrtc_major_wins(world):
    opened = world([NVRTC12, NVRTC13], cupy=("cupy-cuda12x",), driver=(12, 8), env="13")
    assert nvrtc.choice()[1:] == (NVRTC13.path, "FLASHRT_NVRTC=13")
    assert opened == [NVRTC13.path]


def test_flashrt_nvrtc_path_wins(world, monkeypatch):
    world([NVRTC13], cupy=("cupy-cuda13x",), env=None)
    monkeypatch.setenv("FLASHRT_NVRTC", world.real)
    monkeypatch.setattr(nvrtc, "_open", ctypes.CDLL)
    assert nvrtc.choice()[1:] == (world.real, f"FLASHRT_NVRTC={world.real}")
    assert "FLASHRT_NVRTC" in _env.VARIABLES


@pytest.mark.parametrize("value, pattern", [
    ("twelve", r"FLASHRT_NVRTC must be a CUDA major version \(12 or 13\) or the path of an NVRTC library.*'twelve'"),
    ("11", r"FLASHRT_NVRTC=11: flashrt supports NVRTC 12 and 13"),
    (os.path.join(os.sep, "nonexistent", "libnvrtc.so.12"), r"FLASHRT_NVRTC=.*libnvrtc\.so\.12: no such file"),
    ("13", r"FLASHRT_NVRTC=13 asks for NVRTC 13, but none could be loaded \(found: NVRTC 12 \(.*\)\); "
           r'install the NVRTC of CUDA 13: pip install "flashrt\[cuda13\]" \(from a flashrt checkout: '
           r'pip install "\.\[cuda13\]"\), or unset FLASHRT_NVRTC'),
], ids=["word", "major", "path", "absent"])
def test_bad_flashrt_nvrtc_is_a_clear_error(world, value, pattern):
    world([NVRTC12], cupy=("cupy-cuda12x",), env=value)
    with pytest.raises(nvrtc.NvrtcUnavailable, match=pattern):
        nvrtc.choice()


def test_flashrt_nvrtc_naming_another_library_is_a_clear_error(world, monkeypatch):
    libc = next((p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6", "/usr/lib/libc.so.6")
                 if os.path.isfile(p)), None)
    if libc is None or sys.platform != "linux":
        pytest.skip("needs a libc.so.6 at a known path")
    world([NVRTC12], env=libc)
    monkeypatch.setattr(nvrtc, "_open", ctypes.CDLL)
    with pytest.raises(nvrtc.NvrtcUnavailable, match=r"libc\.so\.6 is not an NVRTC library \(it has no nvrtcVersion\)"):
        nvrtc.choice()


@pytest.mark.skipif(sys.platform != "linux", reason="the wheels' Linux layout")
def test_candidates_lists_every_wheel_then_the_system_names(tmp_path, monkeypatch):
    for rel in ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/lib/libnvrtc-builtins.so.13.0",
                "nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cuda_nvrtc/lib/libnvrtc.alt.so.12",
                "nvidia/cuda_runtime/lib/libcudart.so.12", "cuda/lib64/libnvrtc.so.12.4.99"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    monkeypatch.setattr(nvrtc, "_site_dirs", lambda: [str(tmp_path)])
    for var in ("CONDA_PREFIX", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert nvrtc.candidates() == [
        Candidate(13, str(tmp_path / "nvidia/cu13/lib/libnvrtc.so.13"), "site-packages"),
        Candidate(12, str(tmp_path / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"), "site-packages"),
        Candidate(12, str(tmp_path / "cuda/lib64/libnvrtc.so.12.4.99"), "CUDA_HOME"),
        Candidate(13, "libnvrtc.so.13", "system"), Candidate(12, "libnvrtc.so.12", "system"),
        Candidate(None, "libnvrtc.so", "system")]


def _broken_sources() -> tuple[dict, int]:
    """Kernel sources with an #error in common/common.cuh, and that line's number."""
    sources = dict(cache.kernel_sources())
    lines = sources["common/common.cuh"].splitlines()
    at = lines.index("#pragma once") + 1
    sources["common/common.cuh"] = "\n".join(lines[:at] + [ERROR] + lines[at:]) + "\n"
    return sources, at + 1


def test_compile_error_carries_name_options_log_and_dump(cache_dir, monkeypatch):
    cache.entry_key(SPEC)  # hash the real sources before they are swapped
    sources, line = _broken_sources()
    monkeypatch.setattr(cache, "kernel_sources", lambda: sources)

    with pytest.raises(nvrtc.CompileError) as info:
        cache.lookup(SPEC)
    err = info.value
    assert err.name == SPEC.name and err.options == SPEC.options()
    assert f"common/common.cuh({line})" in err.log and "broken on purpose" in err.log
    msg = str(err)
    assert SPEC.name in msg and "-DFRT_HEAD_DIM=64" in msg and err.log.strip() in msg
    assert "set FLASHRT_DUMP_SOURCE=1" in msg
    assert not (cache_dir / "source").exists()

    monkeypatch.setenv("FLASHRT_DUMP_SOURCE", "1")
    with pytest.raises(nvrtc.CompileError) as info:
        cache.lookup(SPEC)
    dump = cache_dir / "source" / f"{SPEC.name}.cu"
    assert f"source: {dump}\n" in str(info.value)
    # The dump holds every header it needs: alone, it fails the same way, at the same file and line.
    with pytest.raises(nvrtc.CompileError) as again:
        nvrtc.compile_cubin(dump.read_text(), SPEC.name, SPEC.options(), {})
    assert again.value.log == info.value.log
    assert not list(cache_dir.glob("*.cubin")), "a failed compile left a cache entry"


def test_dumped_source_compiles_alone_to_the_same_cubin(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASHRT_DUMP_SOURCE", "1")
    cubin, status = cache.lookup(SPEC)
    assert status == "compiled"
    text = (cache_dir / "source" / f"{SPEC.name}.cu").read_text()
    assert text.startswith(f"// {SPEC.name}: NVRTC options {' '.join(SPEC.options())}\n")
    for header in cache.kernel_sources():
        assert f'#include "{header}"' not in text, f"{header} was not inlined"
    assert nvrtc.compile_cubin(text, SPEC.name, SPEC.options(), {})[0] == cubin
    assert cache.clear() >= 2 and not list((cache_dir / "source").iterdir()), "clear left the dump behind"


def test_cubin_sm_reads_the_arch_from_the_elf_header():
    src = 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }'
    archs = {"sm_80": 80, "sm_86": 86, "sm_90a": 90, "sm_100": 100, "sm_120": 120}  # sm_100+: ELF ABI 8
    supported = nvrtc.supported_archs()
    for arch, sm in archs.items():
        if sm in supported:
            cubin = nvrtc.compile_cubin(src, "k", [f"--gpu-architecture={arch}"], {})[0]
            assert nvrtc.cubin_sm(cubin) == sm, arch
    assert nvrtc.cubin_sm(b"not an ELF file" * 8) is None
    assert nvrtc.cubin_sm(b"\x7fELF\x02" + bytes(59)) is None  # an ELF, but not for EM_CUDA
