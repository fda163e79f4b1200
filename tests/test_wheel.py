"""A non-editable install carries kernels_cu/ inside the package, py.typed, and the licence in its metadata."""
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _can_build_offline() -> bool:
    """The installed setuptools meets pyproject.toml's build requirement (>= 77: PEP 639 licence metadata) and
    builds wheels by itself (>= 70.1), so the build needs no download."""
    try:
        major, minor = (int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (77, 0)


def test_wheel_contains_kernel_sources(tmp_path):
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(REPO)]
    if _can_build_offline():
        cmd.insert(4, "--no-build-isolation")
    subprocess.run(cmd, check=True, cwd=tmp_path, timeout=600)
    wheel = next(tmp_path.glob("flashrt-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    root = REPO / "kernels_cu"
    sources = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in (".cu", ".cuh")}
    assert len(sources) > 10 and {f"flashrt/kernels_cu/{n}" for n in sources} <= names
    assert not any("probe" in n for n in names), "the probes are not the library's"
    assert "flashrt/cache.py" in names and "flashrt/cli.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    assert "flashrt/py.typed" in names
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    licences = [n for n in names if n.startswith(dist_info + "/") and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert licences, f"no LICENSE in {dist_info}"
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(licences[0]) == (REPO / "LICENSE").read_bytes()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "Classifier: Typing :: Typed" in metadata
