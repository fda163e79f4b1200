"""Dense forward / backward time of two flashrt trees, in one process: an A/B of a change meant to leave speed alone.

    python scripts/probes/tree_ab.py --tree before=/tmp/a --tree after=/tmp/b [--rounds 5] [--unordered]

Each tree is a directory holding flashrt/ and kernels_cu/ (for example `git archive REV flashrt kernels_cu`). Each is
copied to a package of its own name (flashrt_<label>, with its kernels_cu/ inside: flashrt imports itself relatively),
so both load in one process. Kernels compile first, one process per (tree, head_dim) at once, into one cache (the keys
hash each tree's sources). Then every point (bf16, B*S = 16k tokens, H*D = 2048; head_dim 64 / 128 / 256, S 1k / 4k /
16k, dense and causal; forward and the default backward) is timed with CUDA events, the trees alternating within each
round on the same tensors. The table gives each tree's median over rounds and after / before; the same tree given twice
shows the method's own spread. The JSON of every round goes to --out.
"""
import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAD_DIMS = (64, 128, 256)
SEQLENS = (1024, 4096, 16384)
TOKENS, WIDTH = 16384, 2048


def shapes(head_dims):
    for D in head_dims:
        for S in SEQLENS:
            for causal in (False, True):
                yield TOKENS // S, S, WIDTH // D, D, causal


def points(packages, head_dims, rounds, reps, unordered=False):
    """{label: [{point: ms} per round]} for the packages {label: module}, alternating within every round; with
    `unordered`, the backward with deterministic=False too ("bwd-nd")."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mask_times import time_ms  # (scripts/: CUDA events after 3 warm-up calls, the median of reps)

    times = {label: [{} for _ in range(rounds)] for label in packages}
    labels = list(packages)
    for B, S, H, D, causal in shapes(head_dims):
        q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        saved = {label: fr.forward(q, k, v, causal=causal) for label, fr in packages.items()}
        tag = f"D={D} S={S} {'causal' if causal else 'dense'}"
        for r in range(rounds):
            for label in (labels if r % 2 == 0 else labels[::-1]):
                fr, (out, lse) = packages[label], saved[label]
                times[label][r][f"fwd {tag}"] = time_ms(lambda: fr.forward(q, k, v, causal=causal), reps)
                times[label][r][f"bwd {tag}"] = time_ms(
                    lambda: fr.backward(do, q, k, v, out, lse, causal=causal), reps)
                if unordered:
                    times[label][r][f"bwd-nd {tag}"] = time_ms(
                        lambda: fr.backward(do, q, k, v, out, lse, causal=causal, deterministic=False), reps)
    return times


def packaged(trees, root):
    """Copy each tree to root/flashrt_<label>/ (its kernels_cu/ inside); return {label: package name}."""
    names = {}
    for label, tree in trees:
        dest = Path(root) / f"flashrt_{label}"
        shutil.copytree(Path(tree) / "flashrt", dest)
        shutil.copytree(Path(tree) / "kernels_cu", dest / "kernels_cu")
        names[label] = dest.name
    return names


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", default=[], help="LABEL=DIR, twice (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    ap.add_argument("--out", default=None)
    ap.add_argument("--unordered", action="store_true", help="also time the backward with deterministic=False")
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)  # (a compile process: this package only)
    a = ap.parse_args()
    head_dims = [int(d) for d in a.head_dims.split(",")]
    if a.warm:
        points({a.warm: importlib.import_module(a.warm)}, head_dims, 1, 1, a.unordered)
        return
    trees = [t.split("=", 1) for t in a.tree]
    assert len(trees) == 2 and trees[0][0] != trees[1][0], "two --tree LABEL=DIR with different labels"
    root = tempfile.mkdtemp(prefix="tree_ab_")
    names = packaged(trees, root)
    sys.path.insert(0, root)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    warm = [subprocess.Popen([sys.executable, __file__, "--warm", name, "--head-dims", str(D)]
                             + (["--unordered"] if a.unordered else []), env=env)
            for name in names.values() for D in head_dims]
    assert all(p.wait() == 0 for p in warm), "a tree failed its first run"
    print(f"compiled and warmed in {time.time() - t0:.0f} s", file=sys.stderr)
    rounds = points({label: importlib.import_module(name) for label, name in names.items()}, head_dims, a.rounds,
                    a.reps, a.unordered)
    print(f"timed in {time.time() - t0:.0f} s", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps(rounds, indent=1))
    (base, _), (new, _) = trees
    print(f"| point | {base} ms | {new} ms | {new} / {base} | the ratio's range over rounds |")
    print("|---|---|---|---|---|")
    ratios = []
    for point in rounds[base][0]:
        mb = statistics.median(r[point] for r in rounds[base])
        mn = statistics.median(r[point] for r in rounds[new])
        per = [n[point] / b[point] for b, n in zip(rounds[base], rounds[new])]
        ratios.append(mn / mb)
        print(f"| {point} | {mb:.3f} | {mn:.3f} | {mn / mb:.3f} | {min(per):.3f}-{max(per):.3f} |")
    print(f"\n{new} / {base} over {len(ratios)} points: {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
