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


def test_argument_errors_come_before_any_communication():
    torch = pytest.importorskip("torch")
    fd = pytest.importorskip("flashrt.distributed")
    q = torch.zeros(2, 8, 2, 8)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="one packed sequence"):
        fd.ring_attention(q, q, q, cu_seqlens=cu)
    with pytest.raises(ValueError, match="need cu_seqlens"):
        fd.ring_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="not both"):
        fd.ring_attention(q, q, q, cu_seqlens=cu, segment_ids=torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="causal must be True or False"):
        fd.ring_attention(q, q, q, causal="top_left")
    with pytest.raises(TypeError, match="unexpected keyword argument 'return_lse'"):
        fd.ulysses_attention(q, q, q, return_lse=True)
    # a rank's heads are numbered from 0: no expression that names h (no process group needed to say so)
    for name, kw in (("mask_mod", dict(mask_mod="k <= q || h == 0")), ("score_mod", dict(score_mod="s + h")),
                     ("score_mod_grad", dict(score_mod="s * s", score_mod_grad="2.f * s * (h + 1)"))):
        with pytest.raises(ValueError, match=f"ulysses_attention cannot take a {name} that names the head"):
            fd.ulysses_attention(q, q, q, **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'score_mod'"):  # (ring attention has none)
        fd.ring_attention(q, q, q, score_mod="s")


@pytest.mark.parametrize("w", [1, 3])
def test_combine_is_the_lse_weighted_sum(w):
    torch = pytest.importorskip("torch")
    fd = pytest.importorskip("flashrt.distributed")
    g = torch.Generator().manual_seed(w)
    B, S, H, D = 2, 5, 3, 4
    outs = [torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(w + 1)]
    lses = [torch.randn(B, H, S, generator=g, dtype=torch.float64) for _ in range(w + 1)]
    lses[-1][0, 0, :2] = -torch.inf  # a part that saw no key for some rows
    out, lse = fd._combine(outs, lses)
    every = torch.stack(lses)
    want_lse = torch.logsumexp(every, 0)
    weights = torch.exp(every - want_lse).permute(0, 1, 3, 2)[..., None]
    assert torch.allclose(lse, want_lse) and torch.allclose(out, (weights * torch.stack(outs)).sum(0))
    empty, empty_lse = torch.zeros(B, S, H, D, dtype=torch.float64), torch.full((B, H, S), -torch.inf,
                                                                                dtype=torch.float64)
    out, lse = fd._combine([empty, torch.ones_like(empty)], [empty_lse, empty_lse.clone()])
    assert (out == 0).all() and (lse == -torch.inf).all()  # no key anywhere: 0 and -inf, no NaN


def test_merge_steps_combines_each_run_of_rows_once():
    """_merge_steps: rows covered by step 0 alone keep its part; the rest take the combine of every step covering
    them (zigzag causal: the tail half of a rank's rows sees the later ranks' keys)."""
    torch = pytest.importorskip("torch")
    fd = pytest.importorskip("flashrt.distributed")
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 8, 3, 4
    part = lambda a, b: (a, b, torch.randn(B, b - a, H, D, generator=g, dtype=torch.float64),  # noqa: E731
                         torch.randn(B, H, b - a, generator=g, dtype=torch.float64))
    parts = [part(0, S), part(0, S), part(S // 2, S), part(S // 2, S)]
    want_head = fd._combine([p[2][:, :S // 2] for p in parts[:2]], [p[3][:, :, :S // 2] for p in parts[:2]])
    want_tail = fd._combine([parts[0][2][:, S // 2:], parts[1][2][:, S // 2:], parts[2][2], parts[3][2]],
                            [parts[0][3][:, :, S // 2:], parts[1][3][:, :, S // 2:], parts[2][3], parts[3][3]])
    out, lse = fd._merge_steps(parts, S)
    assert torch.equal(out, torch.cat([want_head[0], want_tail[0]], 1))
    assert torch.equal(lse, torch.cat([want_head[1], want_tail[1]], 2))
    alone = part(0, S)
    out, lse = fd._merge_steps([alone, part(S // 2, S)], S)
    assert out.data_ptr() == alone[2].data_ptr()  # written over step 0's part


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


def _float64_attention(q, k, v, *, causal=False, softmax_scale=None, impl="auto", deterministic=True, softcap=None,
                       alibi_slopes=None, sinks=None):
    """flashrt.attention's contract with softcap, ALiBi (bottom-right, as causal) and sinks, in float64 torch
    autograd on the CPU: the stand-in for torch_ops.attention in ulysses_attention's CPU test."""
    import torch
    B, Sq, H, D = q.shape
    group = H // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) * (softmax_scale or D ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(Sq)[:, None], torch.arange(k.shape[1])[None]
    if alibi_slopes is not None:
        s = s - alibi_slopes.double().expand(B, H)[..., None, None] * (j - i - (k.shape[1] - Sq)).abs()
    if causal:
        s = s.masked_fill(j > i + k.shape[1] - Sq, -torch.inf)
    if sinks is not None:  # one more column with no value
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, Sq, 1)], -1)
    p = torch.softmax(s, -1)[..., :k.shape[1]]
    return torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(group, 2))


def _ulysses_mods_on_cpu(rank, path, world, layout):
    import torch
    import torch.distributed as dist
    import flashrt.distributed as fd
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    fd.torch_ops.attention = _float64_attention  # (this process only)
    try:
        B, S, H, Hkv, D = 2, 8 * world, 2 * world, world, 4
        g = torch.Generator().manual_seed(3)
        q, k, v, dout = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv, H))
        slopes = torch.rand(B, H, generator=g, dtype=torch.float64)
        for kw in (dict(sinks=True), dict(sinks=True, alibi_slopes=slopes, causal=True), dict(softcap=2.0),
                   dict(alibi_slopes=slopes[0], causal=True)):
            sinks = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_() if kw.get("sinks") else None
            kw = dict(kw, sinks=sinks)
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            want = _float64_attention(*whole, **kw)
            want_grads = torch.autograd.grad(want, [*whole, *([sinks] if sinks is not None else [])], dout)
            local = [fd.shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
            out = fd.ulysses_attention(*local, layout=layout, **kw)
            got = torch.autograd.grad(out, [*local, *([sinks] if sinks is not None else [])],
                                      fd.shard_sequence(dout, layout=layout))
            assert torch.allclose(out, fd.shard_sequence(want, layout=layout)), kw
            for name, a, b in zip(("dq", "dk", "dv"), got[:3], want_grads[:3]):
                assert torch.allclose(a, fd.shard_sequence(b, layout=layout)), (kw, name)
            if sinks is not None:  # this rank's heads only; the sum over the ranks is the whole gradient
                h = H // world
                mine = torch.zeros(H, dtype=torch.float64)
                mine[rank * h:(rank + 1) * h] = want_grads[3][rank * h:(rank + 1) * h]
                assert torch.allclose(got[3], mine), kw
                total = got[3].clone()
                dist.all_reduce(total)
                assert torch.allclose(total, want_grads[3]), kw
        with pytest.raises(ValueError, match=rf"sinks must have shape \({H},\)"):
            fd.ulysses_attention(*local, sinks=torch.zeros(H // world))
        with pytest.raises(ValueError, match=rf"alibi_slopes must have shape \({H},\) or \({B}, {H}\)"):
            fd.ulysses_attention(*local, alibi_slopes=torch.zeros(H + 1))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (4, "contiguous")])
def test_ulysses_with_sinks_alibi_and_softcap_on_cpu(world, layout, tmp_path):
    """ulysses_attention's softcap, ALiBi slopes and sinks over gloo, a float64 autograd stand-in for the kernels:
    each rank's head group takes its slopes and sinks; out and the q/k/v gradients match attention over the whole
    sequence, and a rank's sinks gradient is its heads' (their sum over the ranks, the whole one)."""
    pytest.importorskip("torch")
    mp = pytest.importorskip("torch.multiprocessing")
    pytest.importorskip("flashrt.distributed")
    mp.spawn(_ulysses_mods_on_cpu, args=(str(tmp_path / "rendezvous"), world, layout), nprocs=world)


class _Float64Attention:
    """flashrt.forward / backward's contract in float64 torch on the CPU (exact up to rounding), standing in for
    the kernels so that the ring's schedule, merges and gradient routing can be checked over gloo."""

    @staticmethod
    def _check_impl(impl):
        from flashrt import api
        api._check_impl(impl)

    @staticmethod
    def _probs(q, k, causal, segment_ids_q=None, segment_ids_k=None, softmax_scale=None):
        import torch
        group = q.shape[2] // k.shape[2]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) * (softmax_scale or q.shape[-1] ** -0.5)
        keep = torch.ones(s.shape[-2:], dtype=torch.bool)
        if causal:  # (the ring asks for it only on square blocks)
            keep = torch.tril(keep)
        keep = keep[None, None]
        if segment_ids_q is not None:
            keep = keep & (segment_ids_q[:, None, :, None] == segment_ids_k[:, None, None, :])
        s = s.masked_fill(~keep, -torch.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(lse == -torch.inf, 0.0, lse)[..., None])
        return p, lse, group

    def forward(self, q, k, v, *, causal, softmax_scale=None, validate=True, sinks=None, **ids):
        import torch
        p, lse, group = self._probs(q, k, causal, softmax_scale=softmax_scale, **ids)
        out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(group, 2))
        if sinks is not None:  # one more column of the softmax, with no value
            folded = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
            out, lse = out * torch.exp(lse - folded).transpose(1, 2)[..., None], folded
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale=None, impl, deterministic, validate, **ids):
        import torch
        scale = softmax_scale or q.shape[-1] ** -0.5
        group = q.shape[2] // k.shape[2]
        ke, ve = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
        p0, _, _ = self._probs(q, k, causal, softmax_scale=softmax_scale, **ids)
        p = torch.where(p0 > 0, torch.exp(s - lse[..., None]), 0.0)  # normalised by the whole row's lse
        dp = torch.einsum("bqhd,bkhd->bhqk", dout, ve)
        ds = p * (dp - (dout * out).sum(-1).transpose(1, 2)[..., None])
        fold = lambda g: g.unflatten(2, (k.shape[2], group)).sum(3)  # noqa: E731
        return (torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale, fold(torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale),
                fold(torch.einsum("bhqk,bqhd->bkhd", p, dout)))


def _ring_on_cpu(rank, path, world, layout, causal, docs):
    """docs: None, "segments" (segment_ids split over shards) or "cu" (packed offsets with padding before cu[0]
    and after cu[-1], which must see nothing and be seen by nothing)."""
    import torch
    import torch.distributed as dist
    import flashrt.distributed as fd
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    fd.api = _Float64Attention()  # (this process only)
    try:
        B, S, H, Hkv, D = 2 if docs != "cu" else 1, 12 * world, 4, 2, 8
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv, H))
        ids = torch.tensor([0] * (S // 3) + [1] * (S // 2) + [2] * (S - S // 3 - S // 2), dtype=torch.int32)
        ids = ids[None].repeat(B, 1)
        cu = torch.tensor([2, S // 3, S // 2 + 1, S - 3], dtype=torch.int32)
        per_rank = None
        if docs == "segments":
            shards = [fd.shard_sequence(ids, layout=layout, world=world, rank=r) for r in range(world)]
            per_rank = (shards, shards)
        elif docs == "cu":
            per_rank = fd._ids_per_rank(dist.group.WORLD, layout, S // world, None, cu)
        local = [fd.shard_sequence(t, layout=layout) for t in (q, k, v, dout)]
        reports = []
        out, lse, last = fd._ring_forward(*local[:3], dist.group.WORLD, causal, layout, None, per_rank, reports)
        want_last = [fd.shard_sequence(t, layout=layout, world=world, rank=(rank + 1) % world) for t in (k, v)]
        assert all(torch.equal(a, b) for a, b in zip(last, want_last))  # rank + 1's keys: the backward's first
        grads = fd._ring_backward(local[3], *local[:3], out, lse, last, dist.group.WORLD, causal, layout, None,
                                  "auto", True, per_rank, reports)
        assert reports and not any(reports)
        if docs == "cu":  # the reference: the stand-in itself over the whole sequence, padding rows and keys apart
            t = torch.arange(S)
            doc = torch.searchsorted(cu[1:].long(), t, right=True)
            pad = (t < cu[0]) | (t >= cu[-1])
            ids_q, ids_k = torch.where(pad, -2, doc)[None], torch.where(pad, -1, doc)[None]
            attn = _Float64Attention()
            want, want_lse = attn.forward(q, k, v, causal=causal, segment_ids_q=ids_q, segment_ids_k=ids_k)
            want_grads = attn.backward(dout, q, k, v, want, want_lse, causal=causal, impl="auto", deterministic=True,
                                       validate=False, segment_ids_q=ids_q, segment_ids_k=ids_k)
            assert (want[:, pad] == 0).all() and (want_lse[:, :, pad] == -torch.inf).all()
            assert (want_grads[0][:, pad] == 0).all() and (want_grads[1][:, pad] == 0).all()
            # sinks merged last: every token's row takes its head's sink (lse' = logaddexp(lse, sink), out scaled
            # by exp(lse - lse')); the padding stays no row (out 0, lse -inf) and adds nothing to dsinks
            sinks = torch.tensor([1.0, -0.5, 0.25, 3.0])
            padding = fd.shard_sequence(pad[None], layout=layout)  # (this rank's share of the test's own padding)
            assert torch.equal(padding, per_rank[0][rank] != per_rank[1][rank])  # (before cu[0] and after cu[-1])
            out_s, lse_s, _ = fd._ring_forward(*local[:3], dist.group.WORLD, causal, layout, None, per_rank,
                                               reports, sinks, padding)
            folded = torch.logaddexp(lse, sinks.double().view(1, -1, 1))
            tokens = ~padding[:, None, :].expand_as(lse)
            assert torch.allclose(lse_s[tokens], folded[tokens]) and (lse_s[~tokens] == -torch.inf).all()
            assert torch.allclose(out_s, out * torch.exp(lse - folded).nan_to_num().transpose(1, 2)[..., None],
                                  rtol=1e-5, atol=1e-6)
            *_, dsinks = fd._ring_backward(local[3], *local[:3], out_s, lse_s, last, dist.group.WORLD, causal, layout,
                                           None, "auto", True, per_rank, reports, sinks)
            rows = torch.exp(sinks.double().view(1, -1, 1) - lse_s) * (local[3] * out_s).sum(-1).transpose(1, 2)
            assert torch.allclose(dsinks.double(), -rows.nan_to_num().sum((0, 2)), rtol=1e-5, atol=1e-6)
        else:
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            mask = torch.tril(torch.ones(S, S, dtype=torch.bool)) if causal else torch.ones(S, S, dtype=torch.bool)
            mask = mask[None, None] & ((ids[:, None, :, None] == ids[:, None, None, :]) if docs else True)
            s = torch.einsum("bqhd,bkhd->bhqk", whole[0], whole[1].repeat_interleave(2, 2)) * D ** -0.5
            want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(~mask, -torch.inf), -1),
                                whole[2].repeat_interleave(2, 2))
            want_grads = torch.autograd.grad(want, whole, dout)
        for name, got, full in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
            expect = fd.shard_sequence(full.detach(), layout=layout)
            # (the ring's accumulators are fp32, as for the kernels' 16-bit parts)
            assert torch.allclose(got, expect, rtol=1e-5, atol=1e-6), (name, (got - expect).abs().max())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, layout, causal, docs", [
    (3, "zigzag", True, "segments"), (4, "contiguous", True, None), (3, "contiguous", False, "segments"),
    (4, "zigzag", True, None), (2, "zigzag", True, "cu"), (3, "contiguous", False, "cu")])
def test_ring_schedule_merges_and_gradient_routing_on_cpu(world, layout, causal, docs, tmp_path):
    """flashrt.distributed's ring (gloo, CPU processes, float64 stand-ins for the kernels): out, dq, dk and dv of
    every rank's shard equal whole-sequence attention's, for odd and even world sizes, both layouts, documents
    split over shards (segment ids, or packed offsets with padding that sees nothing), and the steps a contiguous
    causal ring skips."""
    pytest.importorskip("torch")
    mp = pytest.importorskip("torch.multiprocessing")
    pytest.importorskip("flashrt.distributed")
    mp.spawn(_ring_on_cpu, args=(str(tmp_path / "rendezvous"), world, layout, causal, docs), nprocs=world)


def _ring_op_on_cpu(rank, path, world):
    """ring_attention itself (the custom op, its autograd formula, the cross-rank checks) over gloo with the
    float64 stand-ins; and the checks' errors, raised on every rank."""
    import torch
    import torch.distributed as dist
    import flashrt.distributed as fd
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    fd.api = _Float64Attention()
    try:
        B, S, H, D = 2, 8 * world, 2, 8
        g = torch.Generator().manual_seed(1)
        q, k, v, dout = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(4))
        ids = (torch.arange(S) // 5).to(torch.int32)[None].repeat(B, 1)
        attn = _Float64Attention()
        want, want_lse = attn.forward(q, k, v, causal=True, segment_ids_q=ids, segment_ids_k=ids)
        want_grads = attn.backward(dout, q, k, v, want, want_lse, causal=True, impl="auto", deterministic=True,
                                   validate=False, segment_ids_q=ids, segment_ids_k=ids)
        local = [fd.shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out, lse = fd.ring_attention(*local, causal=True, segment_ids=fd.shard_sequence(ids), return_lse=True)
        grads = torch.autograd.grad(out, local, fd.shard_sequence(dout))
        assert torch.allclose(lse, fd.shard_sequence(want_lse, dim=2), rtol=1e-5, atol=1e-6)
        for got, full in zip((out, *grads), (want, *want_grads)):
            assert torch.allclose(got, fd.shard_sequence(full), rtol=1e-5, atol=1e-6)
        # attention sinks: merged last; each rank's dsinks is its rows' share, their sum the whole gradient
        sinks = torch.tensor([0.5, 2.0], dtype=torch.float64)
        whole = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        s = torch.einsum("bqhd,bkhd->bhqk", whole[0], whole[1]) * D ** -0.5
        seen = torch.tril(torch.ones(S, S, dtype=torch.bool)) & (ids[:, None, :, None] == ids[:, None, None, :])
        s = torch.cat([s.masked_fill(~seen, -torch.inf), whole[3].view(1, H, 1, 1).expand(B, H, S, 1)], -1)
        want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1)[..., :-1], whole[2])
        want_lse = torch.logsumexp(s, -1)
        want_grads = torch.autograd.grad(want, whole, dout)
        learned = sinks.clone().requires_grad_()
        out, lse = fd.ring_attention(*local, causal=True, segment_ids=fd.shard_sequence(ids), sinks=learned,
                                     return_lse=True)
        grads = torch.autograd.grad(out, [*local, learned], fd.shard_sequence(dout))
        total = grads[3].clone()
        dist.all_reduce(total, group=dist.group.WORLD)
        assert torch.allclose(lse, fd.shard_sequence(want_lse.detach(), dim=2), rtol=1e-5, atol=1e-6)
        for got, full in zip((out, *grads[:3]), (want, *want_grads[:3])):
            assert torch.allclose(got, fd.shard_sequence(full.detach()), rtol=1e-5, atol=1e-6)
        assert torch.allclose(total.double(), want_grads[3], rtol=1e-5, atol=1e-6)
        # packed documents: the padding before cu[0] and after cu[-1] keeps lse -inf; every token takes its sink
        cu = torch.tensor([3, 7, S - 2], dtype=torch.int32)
        x1 = [fd.shard_sequence(t[:1]).detach() for t in (q, k, v)]
        _, lse0 = fd.ring_attention(*x1, causal=True, cu_seqlens=cu, return_lse=True)
        _, lse1 = fd.ring_attention(*x1, causal=True, cu_seqlens=cu, sinks=sinks, return_lse=True)
        t = torch.arange(S)
        pad = fd.shard_sequence(((t < cu[0]) | (t >= cu[-1]))[None])[0]
        assert bool(pad.any()) or rank == 1  # (rank 0 holds both ends in the zigzag layout)
        assert (lse1[:, :, pad] == -torch.inf).all()
        assert torch.allclose(lse1[:, :, ~pad], torch.logaddexp(lse0, sinks.view(1, -1, 1))[:, :, ~pad])
        x = [t.detach() for t in local]
        bad = fd.shard_sequence(ids).clone()
        if rank == 1:
            bad[:, 0] = 99  # decreasing on one rank only
        with pytest.raises(ValueError, match="must not decrease"):
            fd.ring_attention(*x, causal=True, segment_ids=bad)
        with pytest.raises(ValueError, match="same shapes and options on every rank"):
            fd.ring_attention(*(t[:, :4] if rank == 0 else t for t in x), causal=True)
        with pytest.raises(ValueError, match="same shapes and options on every rank"):  # sinks on one rank only
            fd.ring_attention(*x, causal=True, sinks=sinks if rank == 0 else None)
        for bad in (sinks[:1], sinks.long()):
            with pytest.raises(ValueError, match=r"sinks must have shape \(2,\) \(one logit per query head\)"):
                fd.ring_attention(*x, causal=True, sinks=bad)
        if rank == 1:  # a failure that an earlier call's device check reported, on one rank
            reports = [ValueError("a reported failure")]
            fd._take_report = lambda: reports.pop() if reports else None
        with pytest.raises(ValueError, match="a reported failure" if rank == 1 else "another rank holds a failure"):
            fd.ring_attention(*x, causal=True)
    finally:
        dist.destroy_process_group()


def test_ring_attention_op_and_its_checks_on_cpu(tmp_path):
    """The whole call path over gloo: the custom op and its autograd agree with whole-sequence attention, and a
    mismatch, decreasing ids or a reported failure on one rank raise on every rank before any transfer."""
    pytest.importorskip("torch")
    mp = pytest.importorskip("torch.multiprocessing")
    pytest.importorskip("flashrt.distributed")
    mp.spawn(_ring_op_on_cpu, args=(str(tmp_path / "rendezvous"), 2), nprocs=2)
