"""`flashrt` command line: prewarm (twice, by kind, from a manifest), cache info/export/clear, check without a
GPU, info, argument errors (one line, exit status 2), FLASHRT_RECORD manifests, `python -m flashrt`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_GPU
from flashrt import cache, cli, tiles
from flashrt._version import __version__
from flashrt.spec import DROPOUT_FAMILIES, MASK_BITS, PACKED_ROWS, SOFTCAP_FAMILIES

REPO = Path(__file__).resolve().parents[1]
SMEM80 = cli.SMEM_OPTIN[80]


def _env(cache_dir, extra_env=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHRT_RECORD", "FLASHRT_NO_COMPILE")}
    env.update({"FLASHRT_CACHE_DIR": str(cache_dir), **(extra_env or {})})
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(*args, cache_dir, extra_env=None, module="flashrt.cli"):
    return subprocess.run([sys.executable, "-m", module, *args], env=_env(cache_dir, extra_env),
                          capture_output=True, text=True, timeout=900)


def assert_usage_error(r, message: str) -> None:
    """argparse style: exit status 2, one line on stderr that holds `message`, no traceback, nothing on stdout."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.endswith("\n") and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr, r.stderr


def test_prewarm_twice_then_info_and_clear(tmp_path):
    first = run("prewarm", "--arch", "sm_80", "--head-dims", "64,96", "--dtypes", "bf16", "--jobs", "2",
                cache_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    assert str(tmp_path) in first.stdout
    # 2 head dims x (4 tiled families x 2 masks + 3 elementwise + 3 decode), 5 combines, the mask arrays' check
    assert "compiled 34, already cached 0" in first.stdout
    assert "34/34" in first.stderr and "\r" not in first.stderr  # progress: lines, not a bar (stderr is no TTY)
    assert first.stderr.count("\n") <= 11  # a line at every ~10%
    second = run("prewarm", "--arch", "sm_80", "--head-dims", "64,96", "--dtypes", "bf16", cache_dir=tmp_path)
    assert "compiled 0, already cached 34" in second.stdout
    info = run("cache", "info", cache_dir=tmp_path)
    assert "entries:   34" in info.stdout and "sm_80: 34" in info.stdout
    cleared = run("cache", "clear", cache_dir=tmp_path)
    assert "removed 34 entries (and 34 lock, temp or source files)" in cleared.stdout  # locks are no entries
    assert "entries:   0" in run("cache", "info", cache_dir=tmp_path).stdout


BAD_ARGUMENTS = [
    (["prewarm", "--arch", "volta"], "flashrt prewarm: error: argument --arch: 'volta' is not a GPU arch; name one "
                                     "like sm_80 or sm_90a"),
    (["prewarm", "--arch", "sm_9"], "flashrt needs sm_80 or newer (Ampere, Ada, Hopper); sm_9 is not a CUDA arch"),
    (["prewarm", "--arch", "sm_75"], "argument --arch: flashrt needs sm_80 or newer (Ampere, Ada, Hopper); sm_75 is "
                                     "Turing"),
    (["prewarm", "--arch", "sm_90"], "run flashrt's sm_90a kernels, never sm_90 ones: use --arch sm_90a"),
    (["prewarm", "--arch", "sm_86a"], "no arch-specific ('a') kernels for sm_86; use --arch sm_86"),
    (["prewarm", "--arch", "sm_80", "--head-dims", "64,abc"], "argument --head-dims: 'abc' is not a head dim"),
    (["prewarm", "--arch", "sm_80", "--head-dims", "12"], "unsupported head dim 12; head dims are multiples of 8"),
    (["prewarm", "--arch", "sm_80", "--head-dims", ""], "argument --head-dims: '' is not a head dim"),
    (["prewarm", "--arch", "sm_80", "--jobs", "0"], "argument --jobs: must be at least 1, got 0"),
    (["prewarm", "--arch", "sm_80", "--jobs", "-3"], "argument --jobs: must be at least 1, got -3"),
    (["prewarm", "--arch", "sm_80", "--jobs", "two"], "argument --jobs: 'two' is not a whole number"),
    (["prewarm", "--arch", "sm_80", "--dtypes", ""], "argument --dtypes: no dtype given; choose from bf16, fp16"),
    (["prewarm", "--arch", "sm_80", "--dtypes", "fp32"], "argument --dtypes: unsupported dtype fp32"),
    (["prewarm", "--arch", "sm_80", "--masks", "sliding"], "argument --masks: unknown mask sliding; choose from "
                                                           "causal, lengths, window, ids, segments"),
    (["prewarm", "--arch", "sm_80", "--masks", "mask_mod"], "mask_mod cannot be prewarmed by kind"),
    (["prewarm", "--manifest", "m.json", "--head-dims", "64"], "--manifest compiles exactly the manifest's "
                                                               "variants; drop --head-dims"),
    (["prewarm", "--manifest", "no-such.json"], "no manifest at no-such.json; record one by running the workload "
                                                "with FLASHRT_RECORD=no-such.json"),
    (["check", "--arch", "sm_75"], "flashrt check: error: argument --arch: flashrt needs sm_80 or newer"),
    (["cache", "export", "out.json", "--arch", "kepler"], "'kepler' is not a GPU arch"),
    (["cache"], "flashrt cache: error: the following arguments are required"),
    (["frobnicate"], "flashrt: error: argument {prewarm,cache,check,info}: invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("args,message", BAD_ARGUMENTS, ids=[" ".join(a) or "''" for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "m.json").write_text("[]")
    env = _env(tmp_path / "cache")
    r = subprocess.run([sys.executable, "-m", "flashrt", *args], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert_usage_error(r, message)
    assert not (tmp_path / "cache").exists(), "an argument error compiled something"


def test_arch_is_case_insensitive(tmp_path):
    r = run("prewarm", "--arch", "SM_90A", "--head-dims", "64", "--dtypes", "bf16", "--list", cache_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    names = r.stdout.split()
    assert names and all(n.endswith("_sm_90a") for n in names) and any("fwd_sm90_ws" in n for n in names)


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: prewarm compiles for it without --arch")
def test_prewarm_without_gpu_or_arch_says_so(tmp_path):
    assert_usage_error(run("prewarm", "--head-dims", "64", cache_dir=tmp_path),
                       "flashrt prewarm: error: no CUDA GPU found; name the GPU to compile for with --arch")


def test_no_compile_names_the_prewarm_command(tmp_path):
    code = ("from flashrt import cache, tiles; "
            "cache.lookup(tiles.tiling('fwd', 64, 'bf16', True, 'sm_90a', 232448))")
    r = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path, {"FLASHRT_NO_COMPILE": "1"}),
                       capture_output=True, text=True)
    assert r.returncode != 0 and "flashrt prewarm --arch sm_90a --head-dims 64 --dtypes bf16" in r.stderr
    assert "flashrt.cache.CacheMiss: flashrt: kernel flashrt_fwd_hd64_bf16_causal_" in r.stderr
    assert ("record a manifest with FLASHRT_RECORD=/path/manifest.json on a machine that runs the workload, then "
            "run: flashrt prewarm --manifest /path/manifest.json --arch sm_90a") in r.stderr


def test_no_compile_message_of_masked_and_mask_mod_variants(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASHRT_NO_COMPILE", "1")
    masked = tiles.tiling("fwd", 64, "bf16", True, "sm_80", SMEM80, MASK_BITS["window"] | MASK_BITS["block_ids"])
    with pytest.raises(cache.CacheMiss) as miss:
        cache.lookup(masked)
    assert masked.name in str(miss.value) and "FLASHRT_RECORD=" in str(miss.value)
    assert "flashrt prewarm --arch sm_80 --head-dims 64 --dtypes bf16 --masks causal,window,ids" in str(miss.value)
    mod = tiles.tiling("fwd", 64, "bf16", False, "sm_80", SMEM80, MASK_BITS["mod"], "k <= q")
    with pytest.raises(cache.CacheMiss, match="its mask_mod expression is part of the variant, so only a manifest "
                                              "prewarms it") as miss:
        cache.lookup(mod)
    assert "--manifest" in str(miss.value) and "--masks" not in str(miss.value)


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU; `flashrt check` runs attention instead")
def test_check_without_gpu_says_so_and_compiles(tmp_path):
    r = run("check", "--arch", "sm_80", "--jobs", "2", cache_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU found" in r.stdout
    assert "compiled 34" in r.stdout


def test_cache_info_shows_and_clear_removes_stale_entries(cache_dir, monkeypatch):
    from flashrt import cache
    from flashrt.spec import KernelSpec
    spec = KernelSpec("fwd", 64, "bf16", 64, 64, 4, False, "sm_80")
    with monkeypatch.context() as older:  # an entry left by an older flashrt
        older.setattr(cache, "__version__", "0.0.1")
        stale = cache.entry_path(spec, cache.entry_key(spec))
        cache.lookup(spec)
    cache._memory.clear()
    assert cache.lookup(spec)[1] == "compiled"
    info = run("cache", "info", "-v", cache_dir=cache_dir)
    assert "entries:   2" in info.stdout and "stale:     1" in info.stdout
    assert "flashrt cache clear --stale" in info.stdout
    assert f"{stale.name}  flashrt 0.0.1," in info.stdout and info.stdout.count("STALE") == 1
    cleared = run("cache", "clear", "--stale", cache_dir=cache_dir)
    assert "removed 1 entry (and 1 lock, temp or source file)" in cleared.stdout  # the entry and its lock
    info = run("cache", "info", cache_dir=cache_dir)
    assert "entries:   1" in info.stdout and "stale" not in info.stdout
    cache._memory.clear()
    assert cache.lookup(spec)[1] == "disk"


# ---------------------------------------------------------------------------
# Manifests: FLASHRT_RECORD, prewarm --manifest, cache export
# ---------------------------------------------------------------------------
def _small_specs():
    """Two variants that compile in about a second each: the mask arrays' check, a small forward."""
    return [tiles.check_spec("sm_80"), tiles.tiling("fwd", 64, "bf16", False, "sm_80", SMEM80)]


def _names(manifest: Path) -> list[str]:
    return sorted(cache.spec_from_fields(f).name for f in json.loads(manifest.read_text()))


def test_record_prewarm_manifest_then_no_compile_hits(tmp_path, monkeypatch):
    """A process records the variants it looks up; prewarm --manifest compiles exactly those into another cache,
    where a lookup with FLASHRT_NO_COMPILE=1 hits."""
    manifest, first, second = tmp_path / "run" / "manifest.json", tmp_path / "first", tmp_path / "second"
    specs = _small_specs()
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(first))
    monkeypatch.setenv("FLASHRT_RECORD", str(manifest))
    monkeypatch.delenv("FLASHRT_NO_COMPILE", raising=False)
    cache._memory.clear()
    try:
        for spec in specs + specs:
            cache.lookup(spec)
        monkeypatch.delenv("FLASHRT_RECORD")
        cache.lookup(tiles.check_spec("sm_86"))  # not recorded: the variable is unset now
    finally:
        cache._memory.clear()
    assert _names(manifest) == sorted(s.name for s in specs)
    assert [cache.spec_from_fields(f) for f in json.loads(manifest.read_text())] == sorted(specs, key=lambda s: s.name)

    r = run("prewarm", "--manifest", str(manifest), "--jobs", "2", cache_dir=second)
    assert r.returncode == 0, r.stderr
    assert "2 kernels from" in r.stdout and "for sm_80" in r.stdout
    assert "compiled 2, already cached 0" in r.stdout
    assert "2/2" in r.stderr and "\r" not in r.stderr  # not a terminal: progress lines, no carriage returns
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(second))
    monkeypatch.setenv("FLASHRT_NO_COMPILE", "1")
    assert sorted(h["name"] for _, h in cache.entries()) == sorted(s.name for s in specs)
    try:
        assert [cache.lookup(s)[1] for s in specs] == ["disk", "disk"]
        with pytest.raises(cache.CacheMiss):
            cache.lookup(tiles.check_spec("sm_86"))
    finally:
        cache._memory.clear()
    again = run("prewarm", "--manifest", str(manifest), cache_dir=second)
    assert "compiled 0, already cached 2" in again.stdout


def test_prewarm_manifest_for_another_arch_and_export_round_trip(tmp_path):
    manifest, exported = tmp_path / "m.json", tmp_path / "exported.json"
    cache.write_manifest(manifest, [cache.spec_fields(s) for s in _small_specs()])
    r = run("prewarm", "--manifest", str(manifest), "--arch", "sm_86", "--jobs", "2", cache_dir=tmp_path / "c")
    assert r.returncode == 0 and "compiled 2" in r.stdout and "for sm_86" in r.stdout, r.stderr
    r = run("cache", "export", str(exported), cache_dir=tmp_path / "c")
    assert r.returncode == 0 and f"wrote 2 variants to {exported}" in r.stdout, r.stderr
    assert _names(exported) == sorted(n.replace("_sm_80", "_sm_86") for n in _names(manifest))
    # exported -> prewarm --manifest into a fresh cache: the same entries
    r = run("prewarm", "--manifest", str(exported), cache_dir=tmp_path / "d")
    assert r.returncode == 0 and "compiled 2" in r.stdout, r.stderr
    r = run("cache", "export", str(tmp_path / "again.json"), cache_dir=tmp_path / "d")
    assert (tmp_path / "again.json").read_bytes() == exported.read_bytes()
    # --arch filters; nothing to export is an error that writes nothing
    assert_usage_error(run("cache", "export", str(tmp_path / "none.json"), "--arch", "sm_89",
                           cache_dir=tmp_path / "d"), "no usable entries in")
    assert not (tmp_path / "none.json").exists()
    r = run("prewarm", "--manifest", str(manifest), "--arch", "sm_90a", "--list", cache_dir=tmp_path / "d")
    assert r.returncode == 0 and r.stdout.split() == [n.replace("_sm_80", "_sm_90a") for n in _names(manifest)]


def test_bad_manifest_entries_are_one_line_each(tmp_path):
    good = cache.spec_fields(tiles.check_spec("sm_80"))
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps([good, dict(good, head_dim=12), dict(good, colour="red"), "fwd",
                                    dict(good, warps="16")]))
    r = run("prewarm", "--manifest", str(manifest), cache_dir=tmp_path / "c")
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "c").exists()
    lines = r.stderr.splitlines()
    assert len(lines) == 4 and all(line.startswith(f"flashrt prewarm: error: {manifest}: entry ") for line in lines)
    assert "entry 2: head_dim must be a multiple of 8" in lines[0]
    assert "entry 3: not a KernelSpec: unknown fields colour" in lines[1]
    assert "entry 4: a variant is a JSON object" in lines[2]
    assert 'entry 5: field warps must be int, got "16"' in lines[3]
    # a variant that does not exist on the arch --arch names: the recorded arch is in the message
    sm90 = tiles.tiling("fwd_sm90_ws", 128, "bf16", False, "sm_90a", cli.SMEM_OPTIN[90])
    manifest.write_text(json.dumps([cache.spec_fields(sm90)]))
    assert_usage_error(run("prewarm", "--manifest", str(manifest), "--arch", "sm_80", cache_dir=tmp_path / "c"),
                       "entry 1 (recorded for sm_90a): invalid tiling for")
    for text, message in (("{not json", "is not a flashrt manifest (not JSON"),
                          ('{"a": 1}', "a JSON dict, expected a list"),
                          ("[]", "holds no variants"), ("", "holds no variants")):
        manifest.write_text(text)
        assert_usage_error(run("prewarm", "--manifest", str(manifest), cache_dir=tmp_path / "c"), message)


def test_masks_add_the_masked_variants(tmp_path):
    base = run("prewarm", "--arch", "sm_80", "--head-dims", "64", "--dtypes", "bf16", "--list", cache_dir=tmp_path)
    masked = run("prewarm", "--arch", "sm_80", "--head-dims", "64", "--dtypes", "bf16", "--masks", "window,ids,causal",
                 "--list", cache_dir=tmp_path)
    assert base.returncode == 0 and masked.returncode == 0, masked.stderr
    base, masked = set(base.stdout.split()), set(masked.stdout.split())
    added = masked - base
    assert base < masked and not list(tmp_path.rglob("*.cubin")), "--list compiled something"
    for tags in ("full_win", "full_blk", "full_win_blk", "causal_win", "causal_blk", "causal_win_blk"):
        got = {n.split("_bf16_")[0] for n in added if f"_{tags}_" in n}
        assert got == {"flashrt_fwd_hd64", "flashrt_bwd_dq_hd64", "flashrt_bwd_dkdv_hd64", "flashrt_bwd_fused_hd64"}, \
            (tags, got)
    assert len(added) == 4 * 3 * 2  # 4 masked families x (win, blk, both) x (causal or not)
    # exactly the kernels a masked call looks up (tiles.tiling with the call's mask bits)
    bits = MASK_BITS["window"] | MASK_BITS["block_ids"]
    assert tiles.tiling("bwd_fused", 64, "bf16", True, "sm_80", SMEM80, bits).name in added
    # without causal: only the non-causal masked variants; lengths and segments have their tags
    r = run("prewarm", "--arch", "sm_80", "--head-dims", "64", "--dtypes", "bf16", "--masks", "lengths,segments",
            "--list", cache_dir=tmp_path)
    added = set(r.stdout.split()) - base
    assert len(added) == 4 * 3 and all("_full_" in n for n in added)
    assert {n for n in added if "_full_len_seg_" in n} and {n for n in added if "_full_seg_" in n}


def test_softcap_and_alibi_add_their_variants(tmp_path):
    args = ("prewarm", "--arch", "sm_90a", "--head-dims", "128", "--dtypes", "bf16", "--list")
    base, mods = run(*args, cache_dir=tmp_path), run(*args, "--softcap", "--alibi", cache_dir=tmp_path)
    assert base.returncode == 0 and mods.returncode == 0, mods.stderr
    base = set(base.stdout.split())
    added = set(mods.stdout.split()) - base
    assert not list(tmp_path.rglob("*.cubin")), "--list compiled something"
    assert all(("_cap_" in n) != ("_alibi_" in n) for n in added), added  # one or the other, never both
    # every family that computes scores, causal and not, both at the same tilings (tiles._SCORE_MOD_PREFERENCES);
    # decode's three packed-row tilings (not causal: its mask is a run-time argument)
    families = set(SOFTCAP_FAMILIES)
    for tag in ("_cap_", "_alibi_"):
        names = {n for n in added if tag in n}
        assert {n.split("_hd128")[0].removeprefix("flashrt_") for n in names} == families
        assert len(names) == 2 * len(families - set(PACKED_ROWS)) + 3 * len(PACKED_ROWS)
    assert {n.replace("_alibi_", "_cap_") for n in added if "_alibi_" in n} == {n for n in added if "_cap_" in n}
    assert tiles.tiling("bwd_dq_sm90", 128, "bf16", True, "sm_90a", cli.SMEM_OPTIN[90], alibi=True).name in added
    assert_usage_error(run("prewarm", "--manifest", str(tmp_path / "m.json"), "--alibi", cache_dir=tmp_path),
                       "drop --alibi")


def test_masked_prewarm_compiles_them(tmp_path):
    r = run("prewarm", "--arch", "sm_80", "--head-dims", "8", "--dtypes", "bf16", "--masks", "window", "--jobs", "2",
            cache_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    names = [h["name"] for _, h in _entries(tmp_path)]
    assert "compiled 24, already cached 0" in r.stdout and len(names) == 24
    assert sum("_full_win_" in n for n in names) == 4


def _entries(d: Path):
    return [(p, cache.decode_entry(p.read_bytes())[0]) for p in sorted(d.glob("*.cubin"))]


def test_progress_bar_only_on_a_terminal(capsys):
    bar = cli._Progress(40, tty=True)
    for i in range(1, 41):
        bar(i)
    err = capsys.readouterr().err
    assert err.count("\r") == 40 and "] 40/40 " in err and err.endswith("\n") and err.count("\n") == 1
    lines = cli._Progress(40, tty=False)
    for i in range(1, 41):
        lines(i)
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("\n") == 10 and "  40/40 (100%)" in err and "  4/40 (10%)" in err


# ---------------------------------------------------------------------------
# flashrt info, python -m flashrt, pipes
# ---------------------------------------------------------------------------
def test_info_runs_without_gpu_and_lists_every_variable(tmp_path):
    r = run("info", cache_dir=tmp_path / "c", extra_env={"FLASHRT_RECORD": "/tmp/x.json", "FLASHRT_TYPO": "1"},
            module="flashrt")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = r.stdout
    assert out.startswith(f"flashrt {__version__} (") and "\nPython " in out and "\nNVRTC " in out
    assert "\nCuPy " in out or "\nCuPy: not importable" in out
    assert "\ntorch " in out or "\ntorch: not installed" in out
    if not HAS_GPU:
        assert "\nGPUs: none" in out
    assert f"\ncache: {tmp_path / 'c'}: 0 entries, 0.0 MiB (not created yet)" in out
    from flashrt import _env
    for name, doc in _env.VARIABLES.items():
        assert f"\n  {name}" in out and " ".join(doc.split()) in out, name
    assert "\n  FLASHRT_RECORD=/tmp/x.json\n" in out and "\n  FLASHRT_NO_SM90 (unset)\n" in out
    assert "FLASHRT_TYPO=1  (not a flashrt variable: ignored)" in out


def test_python_m_flashrt_is_the_flashrt_command(tmp_path):
    r = run("--help", cache_dir=tmp_path, module="flashrt")
    assert r.returncode == 0 and r.stdout.startswith("usage: flashrt ") and "prewarm" in r.stdout, r.stderr
    r = run("--version", cache_dir=tmp_path, module="flashrt")
    assert r.stdout.strip() == f"flashrt {__version__}"
    r = run("prewarm", "--help", cache_dir=tmp_path, module="flashrt")
    for text in ("FLASHRT_RECORD=", "--manifest", "mask_mod cannot be prewarmed by kind", "INFO on the 'flashrt' "
                 "logger", "a line at every ~10%"):
        assert text in r.stdout, text
    r = run("cache", "export", "--help", cache_dir=tmp_path, module="flashrt")
    assert "older entries" in r.stdout and "Skipped: stale entries" in r.stdout


def test_cache_info_into_a_closed_pipe_is_quiet(tmp_path):
    d = tmp_path / "cache"
    d.mkdir()
    for i in range(3000):  # unusable entries: ~200 kB of `cache info -v`, far more than a pipe buffer
        (d / f"flashrt_junk_{i}-0123456789abcdef.cubin").write_bytes(b"x")
    p = subprocess.Popen([sys.executable, "-m", "flashrt", "cache", "info", "-v"], env=_env(d),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().startswith(b"cache dir:")
    p.stdout.close()  # `| head -1`
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert err == "" and p.returncode == 1


def test_verbose_prewarm_logs_each_compile(tmp_path):
    manifest = tmp_path / "m.json"
    cache.write_manifest(manifest, [cache.spec_fields(tiles.check_spec("sm_80"))])
    r = run("prewarm", "--manifest", str(manifest), "-v", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr
    assert f"flashrt: compiled {tiles.check_spec('sm_80').name} in " in r.stderr


# ---------------------------------------------------------------------------
# GPU: a masked workload, recorded, prewarmed from its manifest, then run without compiling
# ---------------------------------------------------------------------------
_MASKED_WORKLOAD = """
import sys
sys.path.insert(0, {repo!r})
import cupy
import flashrt
B, S, H, D = 2, 256, 4, 64
rng = cupy.random.default_rng(0)
q, k, v, do = (rng.standard_normal((B, S, H, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
ids = cupy.ascontiguousarray(cupy.repeat(cupy.arange(S // 64, dtype=cupy.int32), 64)[None].repeat(B, axis=0))
masks = dict(causal=True, window=(96, 0), block_ids_q=ids, block_ids_k=ids)
out, lse = flashrt.forward(q, k, v, **masks)
dq, dk, dv = flashrt.backward(do, q, k, v, out, lse, **masks)
flashrt.synchronize()
assert all(bool(cupy.isfinite(x).all()) for x in (out, dq, dk, dv))
print("ok")
"""


@pytest.mark.gpu
def test_recorded_masked_workload_runs_from_its_manifest_without_compiling(tmp_path):
    from flashrt import launch
    arch = launch.device(0).arch
    script = _MASKED_WORKLOAD.format(repo=str(REPO))
    manifest, fresh = tmp_path / "manifest.json", tmp_path / "fresh-cache"
    base = {k: v for k, v in os.environ.items() if k not in ("FLASHRT_RECORD", "FLASHRT_NO_COMPILE")}
    # 1. record (the session's cache, or any: a variant read from disk is recorded as well as a compiled one)
    record = subprocess.run([sys.executable, "-c", script], env={**base, "FLASHRT_RECORD": str(manifest)},
                            capture_output=True, text=True, timeout=900)
    assert record.returncode == 0 and "ok" in record.stdout, record.stderr
    names = _names(manifest)
    assert any("_win_blk_" in n for n in names) and any(n.startswith("flashrt_mask_check_") for n in names), names
    assert all(n.endswith("_" + arch) for n in names), names
    # 2. prewarm exactly those into a fresh cache, for this GPU's arch
    prewarm = run("prewarm", "--manifest", str(manifest), "--arch", arch, cache_dir=fresh, module="flashrt")
    assert prewarm.returncode == 0, prewarm.stderr
    assert f"compiled {len(names)}, already cached 0" in prewarm.stdout, prewarm.stdout
    # 3. the workload on the fresh cache, compiling nothing (a miss would raise CacheMiss)
    env = {**base, "FLASHRT_CACHE_DIR": str(fresh), "FLASHRT_NO_COMPILE": "1"}
    again = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "ok" in again.stdout, again.stderr
    assert sorted(h["name"] for _, h in _entries(fresh)) == names, "the run compiled or the prewarm added something"


def test_dropout_adds_its_variants(tmp_path):
    args = ("prewarm", "--arch", "sm_90a", "--head-dims", "128,256", "--dtypes", "bf16", "--list")
    base, drop = run(*args, cache_dir=tmp_path), run(*args, "--dropout", cache_dir=tmp_path)
    assert base.returncode == 0 and drop.returncode == 0, drop.stderr
    added = set(drop.stdout.split()) - set(base.stdout.split())
    assert added and all("_drop8_" in n or "_drop16_" in n for n in added), added
    assert sum("_drop8_" in n for n in added) == sum("_drop16_" in n for n in added)  # (both resolutions)
    # every family that computes P but decode's, causal and not; the warp-specialised forward only at 128
    # (tiles._DROPOUT_MASK_LIMITS), fwd_sm90 at 256 in its place
    assert {n.split("_hd")[0].removeprefix("flashrt_") for n in added} == set(DROPOUT_FAMILIES)
    assert not any(n.startswith("flashrt_fwd_sm90_ws_hd256") for n in added)
    assert any(n.startswith("flashrt_fwd_sm90_hd256") for n in added)
    assert_usage_error(run("prewarm", "--manifest", str(tmp_path / "m.json"), "--dropout", cache_dir=tmp_path),
                       "drop --dropout")
