"""The on-disk cubin cache and its faults: corrupt, truncated, wrong-arch and stale entries, read-only
and full disks, locks held by hung or killed processes, 8 processes prewarming at once; no-compile mode.
Each fault ends in a correct kernel and an intact cache, with at most one warning."""
import dataclasses
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from flashrt import cache, cli, nvrtc
from flashrt.spec import KernelSpec

SPEC = KernelSpec("fwd", 64, "bf16", 64, 64, 4, False, "sm_80")
OTHER = KernelSpec("fwd", 64, "fp16", 64, 64, 4, False, "sm_80")
THIRD = KernelSpec("fwd", 64, "bf16", 64, 64, 4, True, "sm_80")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good() -> bytes:
    """SPEC's cubin, compiled without the cache (NVRTC's output is deterministic)."""
    return nvrtc.compile_cubin(SPEC.translation_unit(), SPEC.name, SPEC.options(), cache.kernel_sources())[0]


def _only_entry(d: Path) -> Path:
    files = list(d.glob("*.cubin"))
    assert len(files) == 1, files
    return files[0]


def _entry(spec: KernelSpec) -> Path:
    return cache.entry_path(spec, cache.entry_key(spec))


def _cache_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, cache.CacheWarning)]


def test_compile_then_hit(cache_dir, good):
    cubin, status = cache.lookup(SPEC)
    assert status == "compiled" and cubin == good
    assert cache.lookup(SPEC) == (cubin, "memory")
    cache._memory.clear()
    assert cache.lookup(SPEC) == (cubin, "disk")
    entry = _only_entry(cache_dir)
    assert entry.name.startswith(SPEC.name + "-")
    header, payload = cache.decode_entry(entry.read_bytes())
    assert payload == cubin and header["name"] == SPEC.name and header["arch"] == "sm_80"
    assert header["nvrtc"] == list(nvrtc.version())
    assert entry.stat().st_mode & 0o777 == 0o644, "other users cannot read the entry"
    assert not list(cache_dir.glob("*.tmp")), "temporary files left behind"


def test_key_covers_version_sources_options_and_nvrtc(cache_dir, monkeypatch):
    base = cache.entry_key(SPEC)
    assert cache.entry_key(SPEC) == base
    assert cache.entry_key(THIRD) != base
    assert cache.entry_key(KernelSpec("fwd", 64, "bf16", 64, 64, 4, False, "sm_90a")) != base
    for module, name, value in [(cache, "__version__", "0.0.0-other"), (cache, "source_hash", lambda f: "0" * 64),
                                (nvrtc, "version", lambda: (99, 0))]:
        with monkeypatch.context() as m:
            m.setattr(module, name, value)
            assert cache.entry_key(SPEC) != base, name


def test_key_hashes_only_the_files_a_variant_compiles(monkeypatch):
    """An edit to one kernel file misses the variants that include it, and only those."""
    check, fwd = KernelSpec("mask_check", 64, "bf16", 0, 0, 16, False, "sm_90a"), SPEC
    assert check.source_file == "helpers/mask_check.cu" and fwd.source_file != check.source_file
    before = cache.entry_key(check), cache.entry_key(fwd)
    for edited in ("helpers/mask_check.cu", "attention/params.cuh"):
        sources = dict(cache.kernel_sources())
        sources[edited] += "\n// an edit\n"
        with monkeypatch.context() as m:
            m.setattr(cache, "kernel_sources", lambda: sources)
            cache.source_hash.cache_clear()
            after = cache.entry_key(check), cache.entry_key(fwd)
        cache.source_hash.cache_clear()
        assert after[0] != before[0], edited
        assert (after[1] != before[1]) == (edited == "attention/params.cuh"), edited  # fwd includes params.cuh
    assert (cache.entry_key(check), cache.entry_key(fwd)) == before


def _corrupt_truncate(raw: bytes) -> bytes:
    return raw[: len(raw) - 100]


def _corrupt_flip(raw: bytes) -> bytes:
    b = bytearray(raw)
    b[-50] ^= 0xFF
    return bytes(b)


def _corrupt_header(raw: bytes) -> bytes:
    return raw.replace(b'"sha256"', b'"sha257"', 1)


def _corrupt_header_json(raw: bytes) -> bytes:
    return raw.replace(b'"key":', b'"key"', 1)


def _corrupt_header_not_object(raw: bytes) -> bytes:
    magic, _, payload = raw.split(b"\n", 2)
    return magic + b"\n[1, 2]\n" + payload


def _corrupt_cut_in_header(raw: bytes) -> bytes:
    return raw[: len(cache._MAGIC) + 20]


def _corrupt_empty(raw: bytes) -> bytes:
    return b""


def _corrupt_garbage(raw: bytes) -> bytes:
    return b"not a cubin at all"


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_header, _corrupt_header_json,
                                     _corrupt_header_not_object, _corrupt_cut_in_header, _corrupt_empty,
                                     _corrupt_garbage])
def test_corrupt_entry_is_recompiled_with_one_warning(cache_dir, corrupt, good):
    cache.lookup(SPEC)
    entry = _only_entry(cache_dir)
    entry.write_bytes(corrupt(entry.read_bytes()))
    cache._memory.clear()
    with pytest.warns(cache.CacheWarning, match="unusable") as record:
        cubin, status = cache.lookup(SPEC)
    assert len(record) == 1
    assert status == "compiled" and cubin == good
    assert cache.decode_entry(entry.read_bytes())[1] == good, "the entry was not repaired"


@pytest.mark.parametrize("how", ["file", "payload"])
def test_entry_for_another_arch_is_recompiled(cache_dir, how, good):
    """`file`: an sm_86 entry copied over SPEC's: its header's key differs. `payload`: an sm_86 cubin under
    SPEC's own key with a valid checksum (what a bug or a hand-made entry could write): the ELF header says
    sm_86. The 'a' of sm_90a is not checked: its ELF flag moved between CUDA toolkits."""
    foreign = cache.lookup(KernelSpec(**dict(SPEC.key_fields(), arch="sm_86")))[0]
    foreign_entry = _only_entry(cache_dir)
    if how == "file":
        foreign_entry.rename(_entry(SPEC))
        expected = "key mismatch"
    else:
        header, _ = cache.decode_entry(foreign_entry.read_bytes())
        meta = {k: v for k, v in header.items() if k not in ("key", "sha256", "size")}
        _entry(SPEC).write_bytes(cache.encode_entry(cache.entry_key(SPEC), foreign, meta))
        expected = "its cubin is for sm_86, expected sm_80"
    with pytest.warns(cache.CacheWarning, match=expected) as record:
        cubin, status = cache.lookup(SPEC)
    assert len(record) == 1 and status == "compiled" and cubin == good
    assert cache.decode_entry(_entry(SPEC).read_bytes(), cache.entry_key(SPEC))[1] == good, "entry not repaired"


def test_entry_of_an_older_flashrt_is_a_miss(cache_dir, monkeypatch, good):
    with monkeypatch.context() as older:
        older.setattr(cache, "__version__", "0.0.1")
        old_entry = _entry(SPEC)
        cache.lookup(SPEC)
    cache._memory.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        assert cache.lookup(SPEC) == (good, "compiled")
    headers = dict(cache.entries())
    assert len(headers) == 2 and headers[old_entry]["flashrt"] == "0.0.1"
    assert [cache.is_stale(h) for h in headers.values()] == [p == old_entry for p in headers]
    assert cache.clear(stale_only=True) == 2  # the old entry and its lock
    assert [p for p, _ in cache.entries()] == [_entry(SPEC)]


def test_unwritable_cache_dir_compiles_in_memory_with_one_warning(tmp_path, monkeypatch, cache_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(blocker / "cache"))  # a folder under a file cannot exist
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cache.lookup(SPEC)[1] == "compiled"
        assert cache.lookup(OTHER)[1] == "compiled"
        assert cache.lookup(SPEC)[1] == "memory"
    msgs = _cache_warnings(record)
    assert len(msgs) == 1 and "not writable" in msgs[0]


def _fail_writes_under(monkeypatch, d: Path, error: int) -> None:
    """Make every open for writing under `d` fail with `error`, as on a read-only mount.

    The lock file and tempfile.mkstemp both go through os.open. (chmod cannot stand in for a read-only
    mount: tests may run as root, who ignores it.)"""
    real_open = os.open

    def guarded(path, flags, *args, **kwargs):
        if str(path).startswith(str(d)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(error, os.strerror(error), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded)


def test_read_only_cache_serves_its_entries_and_compiles_the_rest_in_memory(cache_dir, monkeypatch, good):
    cache.lookup(SPEC)
    cache._memory.clear()
    before = sorted(cache_dir.iterdir())
    _fail_writes_under(monkeypatch, cache_dir, errno.EROFS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cache.lookup(SPEC) == (good, "disk")
        assert cache.lookup(OTHER)[1] == "compiled"
        assert cache.lookup(THIRD)[1] == "compiled"
    msgs = _cache_warnings(record)
    assert len(msgs) == 1 and "not writable" in msgs[0] and "FLASHRT_CACHE_DIR" in msgs[0]
    assert sorted(cache_dir.iterdir()) == before


def test_full_disk_returns_the_kernel_warns_once_and_leaves_no_partial_file(cache_dir, monkeypatch, good):
    cache.lookup(OTHER)  # the folder and one good entry exist; then the disk fills up
    before = sorted(p for p in cache_dir.iterdir() if p.suffix != ".lock")
    real_fsync = os.fsync
    partial = []

    def full(fd):  # the temp file holds the entry's bytes when the disk turns out to be full
        partial.append(os.fstat(fd).st_size)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cache.lookup(SPEC) == (good, "compiled")
        assert cache.lookup(THIRD)[1] == "compiled"
    msgs = _cache_warnings(record)
    assert len(msgs) == 1 and "No space left on device" in msgs[0] and "FLASHRT_CACHE_DIR" in msgs[0]
    assert len(partial) == 2 and all(partial), "the write never reached a temp file"
    after = sorted(p for p in cache_dir.iterdir() if p.suffix != ".lock")
    assert after == before, "a partial or temp file was left behind"
    monkeypatch.setattr(os, "fsync", real_fsync)
    cache._memory.clear()
    assert cache.lookup(SPEC) == (good, "compiled")  # space again: the entry is written
    assert cache.decode_entry(_entry(SPEC).read_bytes(), cache.entry_key(SPEC))[1] == good


def _lock_path(spec: KernelSpec) -> Path:
    return Path(str(_entry(spec)) + ".lock")


def test_lock_held_by_a_hung_process_times_out_naming_the_lock(cache_dir, monkeypatch, good):
    import fcntl
    lock = _lock_path(SPEC)
    cache_dir.mkdir()
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)  # flock locks of two open()s exclude each other
    fcntl.flock(holder, fcntl.LOCK_EX)
    monkeypatch.setattr(cache, "LOCK_TIMEOUT_S", 0.3)
    try:
        t0 = time.monotonic()
        with pytest.warns(cache.CacheWarning, match=re.escape(f"for the lock {lock}: a live process")) as record:
            assert cache.lookup(SPEC) == (good, "compiled")
        assert time.monotonic() - t0 >= 0.3 and len(record) == 1
    finally:
        os.close(holder)
    assert cache.decode_entry(_entry(SPEC).read_bytes(), cache.entry_key(SPEC))[1] == good


def test_lock_of_a_killed_process_blocks_nobody(cache_dir, monkeypatch, good):
    """flock locks die with their process: a compile killed mid-way leaves its .lock file, which blocks
    nobody, so there is no stale lock to clean up."""
    lock = _lock_path(SPEC)
    cache_dir.mkdir()
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    holder.stdout.close()
    assert lock.exists()
    monkeypatch.setattr(cache, "LOCK_TIMEOUT_S", 30.0)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        assert cache.lookup(SPEC) == (good, "compiled")
    assert time.monotonic() - t0 < 15, "waited on the dead process's lock"


def test_slow_compile_is_reported(cache_dir, monkeypatch, caplog):
    real_compile = nvrtc.compile_cubin

    def slow_compile(*args, **kwargs):
        time.sleep(0.5)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(nvrtc, "compile_cubin", slow_compile)
    monkeypatch.setattr(cache, "SLOW_COMPILE_S", 0.05)
    with caplog.at_level(logging.WARNING, logger="flashrt"):
        cache.lookup(SPEC)
    assert [r.getMessage() for r in caplog.records] == [
        f"flashrt: still compiling {SPEC.name} after 0s; NVRTC is slow on this machine or hung"]


def test_no_compile_turns_a_miss_into_an_error_naming_prewarm(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASHRT_NO_COMPILE", "1")
    with pytest.raises(cache.CacheMiss, match=r"flashrt prewarm --arch sm_80 --head-dims 64 --dtypes bf16"):
        cache.lookup(SPEC)
    monkeypatch.delenv("FLASHRT_NO_COMPILE")
    cache.lookup(SPEC)
    cache._memory.clear()
    monkeypatch.setenv("FLASHRT_NO_COMPILE", "1")
    assert cache.lookup(SPEC)[1] == "disk"


def test_eight_processes_prewarm_the_same_matrix(cache_dir):
    """Each kernel is compiled by exactly one process (the others wait on its lock, then read its entry),
    with no warning, and the cache ends with one intact entry per kernel."""
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "flashrt.cli", "prewarm", "--arch", "sm_80", "--head-dims", "32,64",
            "--dtypes", "bf16", "--jobs", "2"]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert not [err for _, err in results if "Warning" in err]
    specs = cli.matrix("sm_80", cli.SMEM_OPTIN[80], [32, 64], ["bf16"])
    counts = [tuple(map(int, re.search(r"compiled (\d+), already cached (\d+)", out).groups()))
              for out, _ in results]
    assert all(c + d == len(specs) for c, d in counts), counts
    assert sum(c for c, _ in counts) == len(specs), f"some kernel compiled more than once: {counts}"
    assert sorted(h["key"] for _, h in cache.entries()) == sorted(cache.entry_key(s) for s in specs)
    for spec in specs:
        cubin, status = cache.lookup(spec)
        assert status == "disk" and nvrtc.cubin_sm(cubin) == 80 and spec.name.encode() in cubin
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
    assert {"key", "sha256", "size", "spec", "options", "nvrtc", "compile_s", "flashrt"} <= set(header)


# ---------------------------------------------------------------------------
# FLASHRT_RECORD: manifests of the variants a process looks up
# ---------------------------------------------------------------------------
def _manifest_names(path: Path) -> list[str]:
    return [cache.spec_from_fields(f).name for f in json.loads(path.read_text())]


def test_record_reads_the_variable_only_on_a_memory_miss(cache_dir, monkeypatch, tmp_path):
    calls = []
    real = cache._env.record
    monkeypatch.setattr(cache._env, "record", lambda: calls.append(1) or real())
    cache.lookup(SPEC)  # compiled, variable unset: nothing written, read once
    for _ in range(5):
        assert cache.lookup(SPEC)[1] == "memory"
    assert len(calls) == 1 and not list(tmp_path.glob("*.json"))
    manifest = tmp_path / "m.json"
    monkeypatch.setenv("FLASHRT_RECORD", str(manifest))
    cache._memory.clear()
    assert cache.lookup(SPEC)[1] == "disk"  # a disk hit is recorded too
    assert cache.lookup(SPEC)[1] == "memory"
    assert len(calls) == 2 and _manifest_names(manifest) == [SPEC.name]


def test_record_merges_with_the_file_and_deduplicates(cache_dir, monkeypatch, tmp_path):
    manifest = tmp_path / "sub" / "m.json"
    manifest.parent.mkdir()
    foreign = dict(cache.spec_fields(OTHER), arch="sm_86")
    manifest.write_text(json.dumps([foreign, {"kept": "as is"}]))  # another process's entries, one not a variant
    monkeypatch.setenv("FLASHRT_RECORD", str(manifest))
    for spec in (SPEC, THIRD, SPEC):
        cache.lookup(spec)
        cache._memory.clear()
    cache._recorded.clear()  # as a new process would: the file still holds each variant once
    cache.lookup(SPEC)
    entries = json.loads(manifest.read_text())
    assert len(entries) == 4 and {"kept": "as is"} in entries and foreign in entries
    variants = [cache.spec_from_fields(f).name for f in entries if "kept" not in f]
    assert variants == sorted([SPEC.name, THIRD.name, KernelSpec(**dict(OTHER.key_fields(), arch="sm_86")).name])
    assert entries[-1] == {"kept": "as is"}  # sorted by name, what is no variant last
    assert not list(manifest.parent.glob("*.tmp")) and manifest.read_text().endswith("]\n")


def test_record_into_a_file_that_is_no_manifest_warns_once_and_leaves_it(cache_dir, monkeypatch, tmp_path):
    manifest = tmp_path / "notes.json"
    manifest.write_text('{"mine": true}')
    monkeypatch.setenv("FLASHRT_RECORD", str(manifest))
    with pytest.warns(cache.CacheWarning, match=r"cannot record kernel variants in FLASHRT_RECORD=.*a JSON dict") \
            as record:
        assert cache.lookup(SPEC)[1] == "compiled"
        assert cache.lookup(OTHER)[1] == "compiled"
    assert len(_cache_warnings(record)) == 1 and manifest.read_text() == '{"mine": true}'


def test_no_compile_miss_is_recorded_and_names_the_manifest_route(cache_dir, monkeypatch, tmp_path):
    manifest = tmp_path / "m.json"
    monkeypatch.setenv("FLASHRT_RECORD", str(manifest))
    monkeypatch.setenv("FLASHRT_NO_COMPILE", "1")
    with pytest.raises(cache.CacheMiss) as miss:
        cache.lookup(SPEC)
    message = str(miss.value)
    assert SPEC.name in message and "FLASHRT_RECORD=" in message and "flashrt prewarm --manifest " in message
    assert "flashrt prewarm --arch" in message  # (a plain variant: by kind as well)
    assert _manifest_names(manifest) == [SPEC.name]
    scored = dataclasses.replace(SPEC, score_mod=("s * 0.5f", "", ()))
    with pytest.raises(cache.CacheMiss) as miss:  # an expression's variant: the manifest route only
        cache.lookup(scored)
    assert "its score_mod expression is part of the variant" in str(miss.value)
    assert "flashrt prewarm --arch" not in str(miss.value)


def test_processes_recording_into_one_manifest(cache_dir, tmp_path):
    """Four processes look up overlapping variants (small elementwise kernels) and record into one file at once: it
    ends with every variant once, as valid JSON."""
    manifest = tmp_path / "m.json"
    code = ("import sys; from flashrt import cache, tiles\n"
            "for d in map(int, sys.argv[1:]):\n"
            "    for f in ('bwd_preprocess', 'bwd_dq_convert'):\n"
            "        cache.lookup(tiles.tiling(f, d, 'bf16', False, 'sm_80', 166912))\n")
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(cache_dir), "FLASHRT_RECORD": str(manifest),
           "PYTHONPATH": str(REPO)}
    dims = [[8, 16, 24], [16, 24, 32], [24, 32, 40], [8, 40, 48]]
    procs = [subprocess.Popen([sys.executable, "-c", code, *map(str, d)], env=env, stderr=subprocess.PIPE, text=True)
             for d in dims]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs) and not any("Warning" in e for e in errors), errors
    names = _manifest_names(manifest)
    assert len(names) == len(set(names)) == 2 * 6
    assert names == sorted(names)


def test_spec_fields_round_trip_and_mask_mod_entries_are_not_stale():
    from flashrt import tiles
    spec = tiles.tiling("fwd", 64, "bf16", True, "sm_80", 166912, 16 | 2, "doc[q] == doc[k]", ("doc",))
    fields = json.loads(json.dumps(cache.spec_fields(spec)))  # through a file: mod_tensors is a list
    assert fields["mod_tensors"] == ["doc"] and cache.spec_from_fields(fields) == spec
    assert cache.spec_from_fields(fields).name == spec.name
    assert not cache.is_stale({"spec": fields, "key": cache.entry_key(spec)})
    for bad, message in ((dict(fields, causal="yes"), "field causal must be bool"),
                         (dict(fields, mod_tensors="doc"), "field mod_tensors must be a list of strings"),
                         ({k: v for k, v in fields.items() if k != "arch"}, "missing fields arch"),
                         (dict(fields, family="fwd_v2"), "unknown kernel family 'fwd_v2'")):
        with pytest.raises(ValueError, match=message):
            cache.spec_from_fields(bad)


def test_spec_fields_round_trip_a_score_mod():
    """KernelSpec.score_mod (expression, derivative, ((name, type), ...)) through JSON (nested lists) and back, the
    same variant and key."""
    from flashrt import tiles
    score = ("s + bias[h * 255 + k - q + 127] * on[b]", "1.f", (("bias", "float"), ("on", "int")))
    for family in ("fwd", "bwd_dkdv"):
        spec = tiles.tiling(family, 64, "bf16", True, "sm_80", 166912, 16, "doc[q] == doc[k]", ("doc",),
                            score_mod=score)
        grad = "1.f" if family == "bwd_dkdv" else ""  # (a forward variant compiles no derivative: it keeps none)
        fields = json.loads(json.dumps(cache.spec_fields(spec)))
        assert fields["score_mod"] == [score[0], grad, [["bias", "float"], ["on", "int"]]]
        back = cache.spec_from_fields(fields)
        assert back == spec and back.name == spec.name and back.score_mod == (score[0], grad, score[2])
        assert not cache.is_stale({"spec": fields, "key": cache.entry_key(spec)})
        assert cache.spec_from_fields(dict(fields, score_mod=[])).score_mod == ()  # (a plain variant's field)
    for bad in ([score[0], "", [["bias", "double"]]], [score[0], 3, []], ["", "", []]):
        with pytest.raises(ValueError, match="score_mod must be"):
            cache.spec_from_fields(dict(fields, score_mod=bad))


def test_clear_counts_entries_apart_from_their_locks(cache_dir):
    cache.lookup(SPEC)
    cache.lookup(OTHER)
    assert len(list(cache_dir.glob("*.lock"))) == 2
    assert cache.clear_counts() == {"entries": 2, "other": 2}
    assert cache.clear_counts() == {"entries": 0, "other": 0}


def test_exported_lists_the_usable_variants(cache_dir, monkeypatch):
    cache.lookup(SPEC)
    cache.lookup(KernelSpec(**dict(SPEC.key_fields(), arch="sm_86")))
    with monkeypatch.context() as older:
        older.setattr(cache, "__version__", "0.0.1")
        cache.lookup(THIRD)
    (cache_dir / "flashrt_junk-0123456789abcdef.cubin").write_bytes(b"junk")
    variants, skipped = cache.exported()
    assert [cache.spec_from_fields(f).name for f in variants] == sorted([SPEC.name, SPEC.name[:-5] + "sm_86"])
    assert skipped == {"stale": 1, "unusable": 1, "other_arch": 0, "no_spec": 0}
    variants, skipped = cache.exported("sm_80")
    assert [cache.spec_from_fields(f) for f in variants] == [SPEC] and skipped["other_arch"] == 1


def test_prefetch_looks_up_kernels_at_once_and_raises_the_first_failure_in_order(cache_dir, monkeypatch):
    """cache.prefetch (launch.Sequence's first use, api._compiled_score_mod): every spec compiled and kept, each once,
    on threads; a failing compile raises the first failure in the specs' order, and the others are kept."""
    from flashrt import tiles
    specs = [tiles.tiling("bwd_preprocess", d, "bf16", False, "sm_80", 100_000) for d in (64, 128, 256)]
    threads, calls = set(), []
    real = cache._compile_and_store

    def counting(spec, key, path):
        import threading
        threads.add(threading.get_ident())
        calls.append(spec.name)
        return real(spec, key, path)
    monkeypatch.setattr(cache, "_compile_and_store", counting)
    cache.prefetch(specs + specs[:1])
    assert sorted(calls) == sorted(s.name for s in specs) and all(cache.lookup(s)[1] == "memory" for s in specs)
    assert len(threads) > 1
    cache.prefetch(specs)  # all in memory: nothing compiled
    assert len(calls) == 3
    bad = dataclasses.replace(SPEC, score_mod=("s +", "", ()))
    worse = dataclasses.replace(SPEC, score_mod=("s + undefined_name", "", ()))
    good = dataclasses.replace(SPEC, score_mod=("s * 0.5f", "", ()))
    with pytest.raises(nvrtc.CompileError) as failed:
        cache.prefetch([good, bad, worse])
    assert failed.value.name == bad.name and cache.lookup(good)[1] == "memory"
