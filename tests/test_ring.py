"""The context-parallel plan (flashrt/ring.py) checked pair by pair against the global mask, and the torch
sharding helpers of flashrt.distributed on the CPU. GPU runs: tests/test_gpu_distributed.py."""
import numpy as np
import pytest

from flashrt import ring


def _positions(layout, world, rank, n):
    return np.concatenate([np.arange(a, b) for a, b in ring.local_ranges(layout, world, rank, n)])


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ring_steps_cover_exactly_the_visible_pairs(layout, causal, world):
    local = 6
    n = local * world
    held = np.concatenate([_positions(layout, world, r, n) for r in range(world)])
    assert sorted(held) == list(range(n))  # every token on exactly one rank
    for rank in range(world):
        steps = ring.ring_steps(layout, world, rank, local, causal)
        assert len(steps) == world
        assert steps[0] is not None and (steps[0].q0, steps[0].q1) == (0, local)  # own keys: every row
        pq = _positions(layout, world, rank, n)
        for i, step in enumerate(steps):
            src = (rank - i) % world
            pk = _positions(layout, world, src, n)
            want = pq[:, None] >= pk[None, :] if causal else np.ones((local, local), bool)
            got = np.zeros((local, local), bool)
            if step is not None:
                assert step.src == src
                qi = np.arange(step.q0, step.q1)[:, None] - step.q0
                kj = np.arange(step.k0, step.k1)[None, :] - step.k0
                got[step.q0:step.q1, step.k0:step.k1] = (kj <= qi) if step.causal else True
            assert (got == want).all(), (layout, world, rank, src, step)


def test_zigzag_balances_causal_work():
    world, local = 4, 8
    work = []
    for rank in range(world):
        steps = ring.ring_steps("zigzag", world, rank, local, True)
        work.append(sum((s.q1 - s.q0) * (s.k1 - s.k0) / (2 if s.causal else 1) for s in steps if s))
    assert len(set(work)) == 1


@pytest.mark.parametrize("seqlen, layout, world", [(10, "zigzag", 2), (9, "contiguous", 2), (12, "zigzag", 4)])
def test_indivisible_sequences_are_refused(seqlen, layout, world):
    with pytest.raises(ValueError, match="equal chunks"):
        ring.local_ranges(layout, world, 0, seqlen)


def test_odd_local_length_is_refused_for_zigzag():
    with pytest.raises(ValueError, match="even number of tokens"):
        ring.ring_steps("zigzag", 2, 0, 7, True)
    with pytest.raises(ValueError, match="layout must be"):
        ring.ring_steps("striped", 2, 0, 8, True)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_shard_merge_and_positions(layout):
    torch = pytest.importorskip("torch")
    fd = pytest.importorskip("flashrt.distributed")
    world, n = 3, 24
    x = torch.arange(2 * n).reshape(2, n)
    shards = [fd.shard_sequence(x, layout=layout, world=world, rank=r) for r in range(world)]
    for r, s in enumerate(shards):
        pos = fd.position_ids(n, layout=layout, world=world, rank=r)
        assert torch.equal(s, x[:, pos]) and s.is_contiguous()
    assert torch.equal(fd.merge_shards(shards, layout=layout), x)
    with pytest.raises(ValueError, match="rank must be"):
        fd.shard_sequence(x, layout=layout, world=2, rank=2)


@pytest.mark.parametrize("w", [1, 3])
def test_merge_is_the_lse_weighted_sum(w):
    torch = pytest.importorskip("torch")
    fd = pytest.importorskip("flashrt.distributed")
    g = torch.Generator().manual_seed(w)
    B, S, H, D = 2, 5, 3, 4
    outs = [torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(w + 1)]
    lses = [torch.randn(B, H, S, generator=g, dtype=torch.float64) for _ in range(w + 1)]
    lses[-1][0, 0, :2] = -torch.inf  # a part that saw no key for some rows
    acc, acc_lse = outs[0].clone(), lses[0].clone()
    for o, lse in zip(outs[1:], lses[1:]):
        fd._merge(acc, acc_lse, o, lse)
    every = torch.stack(lses)
    want_lse = torch.logsumexp(every, 0)
    weights = torch.exp(every - want_lse).permute(0, 1, 3, 2)[..., None]
    assert torch.allclose(acc_lse, want_lse) and torch.allclose(acc, (weights * torch.stack(outs)).sum(0))
    empty, empty_lse = torch.zeros(B, S, H, D, dtype=torch.float64), torch.full((B, H, S), -torch.inf,
                                                                                dtype=torch.float64)
    fd._merge(empty, empty_lse, torch.ones_like(empty), torch.full_like(empty_lse, -torch.inf))
    assert (empty == 0).all() and (empty_lse == -torch.inf).all()  # no key anywhere: 0 and -inf, no NaN


def _all_to_all_round_trip(rank, path, world):
    import torch
    import torch.distributed as dist
    import flashrt.distributed as fd
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        B, S, H, D = 2, 8 * world, 2 * world, 3
        x = torch.arange(B * S * H * D, dtype=torch.float32).reshape(B, S, H, D)
        h = H // world
        for layout in ring.LAYOUTS:
            local = fd.shard_sequence(x, layout=layout)
            whole = fd._heads_to_sequence(local, dist.group.WORLD, world, layout)
            assert torch.equal(whole, x[:, :, rank * h:(rank + 1) * h]), layout  # every token, this rank's heads
            assert torch.equal(fd._sequence_to_heads(whole, dist.group.WORLD, world, layout), local), layout
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_all_to_all_round_trip_on_cpu(world, tmp_path):
    """ulysses_attention's exchanges (gloo, CPU processes): a rank's sequence shard becomes the whole sequence of
    its head group, in sequence order for both layouts, and back."""
    pytest.importorskip("torch")
    mp = pytest.importorskip("torch.multiprocessing")
    pytest.importorskip("flashrt.distributed")
    mp.spawn(_all_to_all_round_trip, args=(str(tmp_path / "rendezvous"), world), nprocs=world)
