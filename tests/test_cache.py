"""The on-disk cubin cache: keys, atomic entries, corruption, concurrency, read-only folders, no-compile mode."""
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from flashrt import cache, nvrtc
from flashrt.spec import KernelSpec

SPEC = KernelSpec("fwd", 64, "bf16", 64, 64, 4, False, "sm_80")
REPO = Path(__file__).resolve().parents[1]


def _only_entry(d: Path) -> Path:
    files = list(d.glob("*.cubin"))
    assert len(files) == 1, files
    return files[0]


def test_compile_then_hit(cache_dir):
    cubin, status = cache.lookup(SPEC)
    assert status == "compiled" and cubin[:4] == b"\x7fELF"
    assert cache.lookup(SPEC) == (cubin, "memory")
    cache._memory.clear()
    assert cache.lookup(SPEC) == (cubin, "disk")
    entry = _only_entry(cache_dir)
    assert entry.name.startswith(SPEC.name + "-")
    header, payload = cache.decode_entry(entry.read_bytes())
    assert payload == cubin and header["name"] == SPEC.name and header["arch"] == "sm_80"
    assert header["nvrtc"] == list(nvrtc.version())
    assert not list(cache_dir.glob("*.tmp")), "temporary files left behind"


def test_key_covers_version_sources_options_and_nvrtc(cache_dir, monkeypatch):
    base = cache.entry_key(SPEC)
    assert cache.entry_key(SPEC) == base
    assert cache.entry_key(KernelSpec("fwd", 64, "bf16", 64, 64, 4, True, "sm_80")) != base
    assert cache.entry_key(KernelSpec("fwd", 64, "bf16", 64, 64, 4, False, "sm_90a")) != base
    monkeypatch.setattr(cache, "__version__", "0.0.0-other")
    assert cache.entry_key(SPEC) != base
    monkeypatch.undo()
    monkeypatch.setattr(cache, "sources_hash", lambda: "0" * 64)
    assert cache.entry_key(SPEC) != base
    monkeypatch.undo()
    monkeypatch.setattr(nvrtc, "version", lambda: (99, 0))
    assert cache.entry_key(SPEC) != base


def _corrupt_truncate(raw: bytes) -> bytes:
    return raw[: len(raw) - 100]


def _corrupt_flip(raw: bytes) -> bytes:
    b = bytearray(raw)
    b[-50] ^= 0xFF
    return bytes(b)


def _corrupt_header(raw: bytes) -> bytes:
    return raw.replace(b'"sha256"', b'"sha257"', 1)


def _corrupt_garbage(raw: bytes) -> bytes:
    return b"not a cubin at all"


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_header, _corrupt_garbage])
def test_corrupt_entry_is_recompiled_with_one_warning(cache_dir, corrupt):
    good, _ = cache.lookup(SPEC)
    entry = _only_entry(cache_dir)
    entry.write_bytes(corrupt(entry.read_bytes()))
    cache._memory.clear()
    with pytest.warns(cache.CacheWarning, match="unusable") as record:
        cubin, status = cache.lookup(SPEC)
    assert len(record) == 1
    assert status == "compiled" and cubin == good
    assert cache.decode_entry(entry.read_bytes())[1] == good, "the entry was not repaired"


def test_entry_of_another_key_is_not_loaded(cache_dir):
    cache.lookup(SPEC)
    entry = _only_entry(cache_dir)
    raw = entry.read_bytes()
    header, payload = cache.decode_entry(raw)
    entry.write_bytes(cache.encode_entry("f" * 64, payload, {k: v for k, v in header.items()
                                                           if k not in ("key", "sha256", "size")}))
    cache._memory.clear()
    with pytest.warns(cache.CacheWarning, match="key mismatch"):
        assert cache.lookup(SPEC)[1] == "compiled"


def test_unwritable_cache_dir_compiles_in_memory_with_one_warning(tmp_path, monkeypatch, cache_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(blocker / "cache"))  # a folder under a file cannot exist
    other = KernelSpec("fwd", 64, "fp16", 64, 64, 4, False, "sm_80")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cache.lookup(SPEC)[1] == "compiled"
        assert cache.lookup(other)[1] == "compiled"
        assert cache.lookup(SPEC)[1] == "memory"
    msgs = [str(w.message) for w in record if issubclass(w.category, cache.CacheWarning)]
    assert len(msgs) == 1 and "not writable" in msgs[0]


def test_no_compile_turns_a_miss_into_an_error_naming_prewarm(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASHRT_NO_COMPILE", "1")
    with pytest.raises(cache.CacheMiss, match=r"flashrt prewarm --arch sm_80 --head-dims 64 --dtypes bf16"):
        cache.lookup(SPEC)
    monkeypatch.delenv("FLASHRT_NO_COMPILE")
    cache.lookup(SPEC)
    cache._memory.clear()
    monkeypatch.setenv("FLASHRT_NO_COMPILE", "1")
    assert cache.lookup(SPEC)[1] == "disk"


def test_concurrent_processes_compile_the_same_variant(cache_dir):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from flashrt import cache
        from flashrt.spec import KernelSpec
        cubin, status = cache.lookup(KernelSpec("fwd", 64, "bf16", 64, 64, 4, False, "sm_80"))
        print(status, len(cubin))
    """)
    env = {**__import__("os").environ, "FLASHRT_CACHE_DIR": str(cache_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    statuses = [r[0].split()[0] for r in results]
    sizes = {r[0].split()[1] for r in results}
    assert len(sizes) == 1
    assert statuses.count("compiled") >= 1 and set(statuses) <= {"compiled", "disk"}
    header, _ = cache.decode_entry(_only_entry(cache_dir).read_bytes(), cache.entry_key(SPEC))
    assert header["name"] == SPEC.name
    assert not list(cache_dir.glob("*.tmp"))


def test_clear_and_entries(cache_dir):
    cache.lookup(SPEC)
    (cache_dir / "unrelated.txt").write_text("keep me")
    entries = cache.entries()
    assert len(entries) == 1 and entries[0][1]["name"] == SPEC.name
    assert cache.clear() >= 1
    assert cache.entries() == [] and (cache_dir / "unrelated.txt").exists()


def test_header_is_json_with_compile_metadata(cache_dir):
    cache.lookup(SPEC)
    raw = _only_entry(cache_dir).read_bytes()
    header = json.loads(raw.split(b"\n")[1])
    assert {"key", "sha256", "size", "options", "nvrtc", "compile_s", "flashrt"} <= set(header)
