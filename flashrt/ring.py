"""Context parallelism's plan, without torch: which tokens each rank holds, and what each ring step computes.

A sequence of S tokens is cut into chunks over `world` ranks:
  "contiguous": rank r holds tokens [r*S/world, (r+1)*S/world).
  "zigzag": the sequence is cut into 2*world chunks and rank r holds chunks r and 2*world-1-r (head and
    tail), in that order, so that under a causal mask every rank does the same work.
Either way a rank's tokens are in increasing global order, so a causal mask between two shards is, within
each (query slice, key slice) pair that the ring computes, either none or top-left causal (`ring_steps`).

At ring step i, rank r holds the keys and values of rank (r - i) mod world (they move one rank on per step).
flashrt/distributed.py runs these steps; tests/test_ring.py checks them against the mask, pair by pair.
"""
from __future__ import annotations

import dataclasses

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunks(layout: str, world: int) -> int:
    """How many equal chunks the whole sequence is cut into."""
    return 2 * world if layout == "zigzag" else world


def check_divisible(seqlen: int, layout: str, world: int, what: str = "the sequence") -> None:
    n = chunks(layout, world)
    if seqlen % n:
        raise ValueError(f"{what} has {seqlen} tokens, which do not divide into {n} equal chunks ({layout} layout "
                         f"over {world} ranks{', 2 chunks per rank' if layout == 'zigzag' else ''}); pad it to a "
                         f"multiple of {n}")


def local_ranges(layout: str, world: int, rank: int, seqlen: int) -> list[tuple[int, int]]:
    """The global [start, end) token ranges rank `rank` holds, in its local order, of a `seqlen`-token sequence."""
    check_layout(layout)
    check_divisible(seqlen, layout, world)
    c = seqlen // chunks(layout, world)
    if layout == "contiguous":
        return [(rank * c, (rank + 1) * c)]
    tail = 2 * world - 1 - rank
    return [(rank * c, (rank + 1) * c), (tail * c, (tail + 1) * c)]


@dataclasses.dataclass(frozen=True)
class Step:
    """One ring step on one rank: attend local queries [q0, q1) to the held keys [k0, k1) of rank `src`
    (local indices of each shard), top-left causal or not at all."""
    src: int
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def ring_steps(layout: str, world: int, rank: int, local_len: int, causal: bool) -> list[Step | None]:
    """Step i: what rank `rank` computes with rank (rank - i) mod world's keys; None when it sees none of them.

    Step 0 (its own keys) always covers every local query row."""
    check_layout(layout)
    if layout == "zigzag" and local_len % 2:
        raise ValueError(f"the zigzag layout needs an even number of tokens per rank (2 chunks each), got "
                         f"{local_len}; pad the sequence to a multiple of {2 * world}")
    n, half, steps = local_len, local_len // 2, []
    for i in range(world):
        src = (rank - i) % world
        if not causal:
            steps.append(Step(src, 0, n, 0, n, False))
        elif src == rank:
            steps.append(Step(src, 0, n, 0, n, True))
        elif layout == "contiguous":
            steps.append(Step(src, 0, n, 0, n, False) if src < rank else None)
        elif src < rank:  # every local query comes after src's head chunk and before its tail chunk
            steps.append(Step(src, 0, n, 0, half, False))
        else:  # only the local tail chunk comes after src's chunks, and after both
            steps.append(Step(src, half, n, 0, n, False))
    return steps
