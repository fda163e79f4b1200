"""`flashrt` command line: prewarm (twice), cache info/clear, check without a GPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_GPU

REPO = Path(__file__).resolve().parents[1]


def run(*args, cache_dir, extra_env=None):
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(cache_dir), **(extra_env or {})}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "flashrt.cli", *args], env=env, capture_output=True, text=True,
                          timeout=900)


def test_prewarm_twice_then_info_and_clear(tmp_path):
    first = run("prewarm", "--arch", "sm_80", "--head-dims", "64,96", "--dtypes", "bf16", "--jobs", "2",
                cache_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    assert str(tmp_path) in first.stdout
    # 2 head dims x (4 tiled families x 2 masks + 3 elementwise), and the mask arrays' check
    assert "compiled 23, already cached 0" in first.stdout
    assert "23/23" in first.stderr  # progress bar
    second = run("prewarm", "--arch", "sm_80", "--head-dims", "64,96", "--dtypes", "bf16", cache_dir=tmp_path)
    assert "compiled 0, already cached 23" in second.stdout
    info = run("cache", "info", cache_dir=tmp_path)
    assert "entries:   23" in info.stdout and "sm_80: 23" in info.stdout
    cleared = run("cache", "clear", cache_dir=tmp_path)
    assert "removed" in cleared.stdout
    assert "entries:   0" in run("cache", "info", cache_dir=tmp_path).stdout


def test_prewarm_rejects_bad_arguments(tmp_path):
    r = run("prewarm", "--arch", "sm_80", "--head-dims", "12", cache_dir=tmp_path)
    assert r.returncode != 0 and "multiples of 8" in r.stderr
    r = run("prewarm", "--arch", "volta", cache_dir=tmp_path)
    assert r.returncode != 0 and "sm_80 or sm_90a" in r.stderr


def test_no_compile_names_the_prewarm_command(tmp_path):
    code = ("from flashrt import cache, tiles; "
            "cache.lookup(tiles.tiling('fwd', 64, 'bf16', True, 'sm_90a', 232448))")
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(tmp_path), "FLASHRT_NO_COMPILE": "1",
           "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "flashrt prewarm --arch sm_90a --head-dims 64 --dtypes bf16" in r.stderr


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU; `flashrt check` runs attention instead")
def test_check_without_gpu_says_so_and_compiles(tmp_path):
    r = run("check", "--arch", "sm_80", "--jobs", "2", cache_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU found" in r.stdout
    assert "compiled 23" in r.stdout


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
    assert "removed 2 files" in cleared.stdout  # the entry and its lock
    info = run("cache", "info", cache_dir=cache_dir)
    assert "entries:   1" in info.stdout and "stale" not in info.stdout
    cache._memory.clear()
    assert cache.lookup(spec)[1] == "disk"
