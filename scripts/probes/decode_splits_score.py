"""Score tiles.decode_splits offline against measured split counts, no GPU:
python scripts/probes/decode_splits_score.py.

Reads the per-count timings of benchmarks/results/h200-2026-11-27-decode-splits.md (runs 1-4: us per call at 1, 2,
4, ... splits, H200, bf16, Sq = 1) and the head_dim 64 runs of h200-2026-11-27-decode-stages.md ("Depth against split
count": TB/s at the library's count, one split and two), and for each shape compares the count decode_splits picks now
(sm_90a, 132 SMs) with the fastest measured one: prints the shapes where the pick is 4% or more off, or not measured,
and the geometric mean and maximum of time(pick) / time(best). A change to the split model can be scored here before
a sweep on the device (docs/perf-notes.md, Decode: splits and the combine). The older runs predate Q in the last stage
(head_dim <= 128 blocks 2-4% smaller since), so their head_dim 64 rows are approximate.
"""
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from flashrt import tiles  # noqa: E402
from flashrt.spec import SM90_SMEM_OPTIN  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SMS = 132


def sweep_rows() -> dict:
    """(H, Hkv, D, B, S) -> {splits: us} from the decode-splits sweep's H200 runs."""
    text = (RESULTS / "h200-2026-11-27-decode-splits.md").read_text().split("## Run 5")[0]
    rows, counts = {}, [1, 2, 4, 8, 16, 32, 64, 128]
    for line in text.splitlines():
        m = re.match(r"\| (\d+)/(\d+) \| (\d+) \| (\d+) x (\d+) \| [^|]*\|(.*)", line)
        if not m:
            continue
        cells = [c.strip() for c in m.group(6).split("|")]
        cells = cells[:next((i for i, c in enumerate(cells) if c.startswith("{")), len(cells))]
        while cells and not cells[-1]:
            cells.pop()
        times = {c: float(v) for c, v in zip(counts, cells[:-3]) if v}  # (the last three: pick, best, ratio)
        extra = re.search(r"\{(.*)\}", line)
        if extra:
            times.update({int(k): float(v) for k, v in (kv.split(":") for kv in extra.group(1).split(","))})
        rows.setdefault(tuple(map(int, m.groups()[:5])), {}).update(times)  # (a shape may come twice)
    return rows


def stage_rows() -> dict:
    """The same from the ring-depth probe's split runs (time as 1 / TB/s): the library's count then, 1 and 2."""
    text = (RESULTS / "h200-2026-11-27-decode-stages.md").read_text()
    text = text.split("## Depth against split count")[1].split("## After")[0]
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| (\d+)/(\d+) D(\d+) \| (\d+) x (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", line)
        if m:
            H, Hkv, D, B, S, lib = map(int, m.groups()[:6])
            at_lib, one, two = map(float, m.groups()[6:9])
            times = {1: 1 / one, 2: 1 / two}
            times[lib] = min(times.get(lib, math.inf), 1 / at_lib)
            rows[(H, Hkv, D, B, S)] = times
    return rows


def main() -> None:
    ratios = []
    for (H, Hkv, D, B, S), times in {**sweep_rows(), **stage_rows()}.items():
        rows = H // Hkv
        spec = tiles.decode_spec(D, "bf16", rows, "sm_90a", SM90_SMEM_OPTIN)
        pick = tiles.decode_splits(spec, B, Hkv, rows, S, SMS, SM90_SMEM_OPTIN)
        best = min(times, key=times.get)
        if pick not in times:
            print(f"{H}/{Hkv} D{D} {B} x {S}: pick {pick} not measured (best {best})")
            continue
        ratios.append(times[pick] / times[best])
        if ratios[-1] >= 1.04:
            print(f"{H}/{Hkv} D{D} {B} x {S}: pick {pick} {ratios[-1]:.2f}x the best ({best})")
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"{len(ratios)} shapes: time(pick) / time(best) geometric mean {geo:.3f}, max {max(ratios):.2f}")


if __name__ == "__main__":
    main()
