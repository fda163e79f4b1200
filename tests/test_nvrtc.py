"""NVRTC faults: a missing or unsupported library, compile errors with FLASHRT_DUMP_SOURCE, cubin arch."""
import ctypes

import pytest

from flashrt import cache, nvrtc
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

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", not_found)
    monkeypatch.setattr(ctypes, "CDLL", not_found)
    with pytest.raises(nvrtc.NvrtcUnavailable) as info:
        nvrtc.version()
    msg = str(info.value)
    assert "pip install 'flashrt[cuda12]'" in msg and "pip install 'flashrt[cuda13]'" in msg
    assert "libnvrtc.so.12: no such library" in msg  # says what was tried


def test_unsupported_nvrtc_major_names_the_pip_extra(monkeypatch, reload_nvrtc):
    real_major = nvrtc.version()[0]
    nvrtc._lib.cache_clear()
    monkeypatch.setattr(nvrtc, "_SUPPORTED_MAJORS", (real_major + 1,))
    with pytest.raises(nvrtc.NvrtcUnavailable, match=rf"NVRTC {real_major}\.\d+ \(.*\) is not supported.*"
                                                     r"pip install 'flashrt\[cuda12\]'"):
        nvrtc.version()


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
