"""flashrt.distributed on every visible GPU (2 to 8; NCCL): ring_attention against single-GPU flashrt on the
gathered sequence and a float64 reference (causal or not, zigzag and contiguous, GQA, documents split over
shards by segment ids and packed cu_seqlens), bitwise repeatability, DDP, ulysses_attention, torch.compile, and
the errors. Each test spawns one process per GPU (torch.multiprocessing); a failure on a rank fails the test with
that rank's traceback."""
import os
import tempfile

import pytest

torch = pytest.importorskip("torch")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 GPUs for NCCL ring tests, {_gpus()} visible")]
WORLD = min(max(_gpus(), 2), 8)  # every visible GPU (the code is written for any world size)


def _spawn(fn, *args, world=WORLD, backend="nccl"):
    """fn(rank, *args) in `world` processes, rank r on GPU r mod the GPUs (gloo: several ranks may share one)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(fn, os.path.join(d, "rendezvous"), args, world, backend), nprocs=world, join=True)


def _entry(rank, fn, path, args, world, backend):
    import torch.distributed as dist
    gpu = rank % _gpus()
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=world,
                            **({"device_id": torch.device("cuda", gpu)} if backend == "nccl" else {}))
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _inputs(B, S, H, Hkv, D, seed, Dv=None):
    """q, k, v, dout of the whole sequence (v and dout at Dv, default D)."""
    g = torch.Generator(device="cuda").manual_seed(seed)  # the same whole sequence on every rank
    make = lambda h, d: torch.randn(B, S, h, d, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    return make(H, D), make(Hkv, D), make(Hkv, Dv or D), make(H, Dv or D)


def _reference(q, k, v, dout, causal, segment_ids=None):
    """float64 (out, dq, dk, dv) of the whole sequence, as torch tensors."""
    import cupy
    from flashrt import reference
    arrays = [cupy.asarray(t.float()) for t in (q, k, v, dout)]
    B, S = q.shape[:2]
    mask = None
    if segment_ids is not None:
        ids = cupy.asarray(segment_ids)
        mask = reference.visible(B, S, S, segment_ids_q=ids, segment_ids_k=ids, xp=cupy)
    out, _, dq, dk, dv = reference.attention(*arrays[:3], causal=causal, dout=arrays[3], mask=mask)
    return [torch.as_tensor(x, device="cuda") for x in (out, dq, dk, dv)]


def _rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


def _ring_vs_single(rank, cases, check=True):
    import flashrt
    import flashrt.distributed as fd
    failures = []
    for i, (B, S, H, Hkv, D, causal, layout, docs, *Dv) in enumerate(cases):  # (Dv: v's head_dim, if not D)
        q, k, v, dout = _inputs(B, S, H, Hkv, D, seed=100 + i, Dv=Dv[0] if Dv else None)
        ids = None
        if docs:  # documents of uneven lengths, several of them split over the shards
            bounds = torch.tensor([0, S // 8, S // 3, S // 2 + 5, S], device="cuda")
            ids = (torch.searchsorted(bounds[1:], torch.arange(S, device="cuda"), right=True)
                   .to(torch.int32)[None].repeat(B, 1).contiguous())
        mask = dict(segment_ids_q=ids, segment_ids_k=ids) if docs else {}
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        single = flashrt.attention(*whole, causal=causal, **mask)
        single_grads = torch.autograd.grad(single, whole, dout)
        local = [fd.shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
        seg = fd.shard_sequence(ids, layout=layout) if docs else None
        out = fd.ring_attention(*local, causal=causal, layout=layout, segment_ids=seg, check=check)
        grads = torch.autograd.grad(out, local, fd.shard_sequence(dout, layout=layout))
        ring_all = [fd.unshard_sequence(t, layout=layout) for t in (out, *grads)]
        ref = _reference(q, k, v, dout, causal, ids)
        for name, got, want, r in zip(("out", "dq", "dk", "dv"), ring_all, (single, *single_grads), ref):
            e_ring, e_single = _rel(got, r), _rel(want, r)
            if not (e_ring <= 2 * e_single + 1e-3 and e_ring < 2e-2):
                failures.append(f"case {cases[i]} {name}: ring error {e_ring:.2e}, single-GPU {e_single:.2e}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _sinks_vs_single(rank):
    """ring_attention with sinks against flashrt.attention with them on the gathered sequence: out, dq / dk / dv,
    and dsinks, whose per-rank shares add up to the single-GPU gradient."""
    import torch.distributed as dist
    import flashrt
    import flashrt.distributed as fd
    B, S, H, Hkv, D = 1, 2048, 8, 2, 128
    q, k, v, dout = _inputs(B, S, H, Hkv, D, seed=77)
    sinks = torch.linspace(-2.0, 4.0, H, device="cuda")
    whole = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    single, lse = flashrt.attention(*whole[:3], causal=True, sinks=whole[3], return_lse=True)
    single_grads = torch.autograd.grad(single, whole, dout)
    # dsinks is a signed sum of per-row terms that can cancel: its error is bounded against the terms' scale
    delta = (dout.double() * single.detach().double()).sum(-1).mT
    terms = torch.exp(sinks.double().view(1, -1, 1) - lse.double()) * delta
    scale = terms.abs().sum((0, 2))
    local = [fd.shard_sequence(t).requires_grad_() for t in (q, k, v)]
    learned = sinks.clone().requires_grad_()
    out = fd.ring_attention(*local, causal=True, sinks=learned)
    grads = torch.autograd.grad(out, [*local, learned], fd.shard_sequence(dout))
    total = grads[3].clone()
    dist.all_reduce(total)
    failures = [name for name, got, want in zip(("out", "dq", "dk", "dv"),
                                                [fd.unshard_sequence(t) for t in (out, *grads[:3])],
                                                (single, *single_grads[:3]))
                if _rel(got, want.double()) > 2e-2]
    if float(((total.double() - single_grads[3].double()).abs() / scale).max()) > 5e-3:
        failures.append(f"dsinks {total.tolist()} against {single_grads[3].tolist()} (terms' scale {scale.tolist()})")
    assert not failures, f"rank {rank}: {failures}"


def test_ring_with_sinks_matches_single_gpu():
    _spawn(_sinks_vs_single)


def test_ring_matches_single_gpu():
    cases = [(2, 1024, 4, 4, 64, causal, layout, False) for causal in (False, True) for layout in ("zigzag",
                                                                                                 "contiguous")]
    cases += [(1, 2048, 8, 2, 128, True, "zigzag", False),   # GQA
              (1, 512, 2, 1, 256, True, "zigzag", False),    # MQA, head_dim 256
              (2, 1024, 4, 2, 64, True, "zigzag", True),     # documents split over shards
              (1, 1024, 4, 4, 128, False, "contiguous", True),
              (1, 1024, 4, 2, 192, True, "zigzag", False, 128),  # v's head_dim of its own (MLA's 192 / 128)
              (2, 512, 4, 4, 64, False, "contiguous", True, 96)]
    _spawn(_ring_vs_single, cases)


def _copy_engine_vs_nccl(rank):
    """The ring's transfers by the copy engines (flashrt/p2p.py, the default group) and by NCCL (a second group made
    with FLASHRT_NO_COPY_ENGINE=1): bitwise the same out and gradients, over calls queued back to back with no host
    synchronisation (the slots' flags order them), at shapes that grow the slots and shrink again."""
    import torch.distributed as dist
    import flashrt.distributed as fd
    from flashrt import p2p
    os.environ["FLASHRT_NO_COPY_ENGINE"] = "1"
    nccl = dist.new_group(list(range(WORLD)))
    fd.ring_attention(*(fd.shard_sequence(t) for t in _inputs(1, 256, 2, 2, 64, seed=1)[:3]), group=nccl)
    del os.environ["FLASHRT_NO_COPY_ENGINE"]
    assert p2p.uses_copy_engines(nccl) is False
    cases = [(1, 1024, 4, 4, 64, True), (2, 2048, 8, 2, 128, True), (1, 1024, 4, 4, 64, False),
             (1, 4096, 4, 4, 128, True), (1, 1024, 4, 4, 64, True)]
    results = {}
    for name, group in (("copy engine", None), ("nccl", nccl)):
        runs = []
        for i, (B, S, H, Hkv, D, causal) in enumerate(cases * 2):
            q, k, v, dout = _inputs(B, S, H, Hkv, D, seed=200 + i)
            local = [fd.shard_sequence(t).requires_grad_() for t in (q, k, v)]
            out = fd.ring_attention(*local, group=group, causal=causal, check=False)
            runs.append([out, *torch.autograd.grad(out, local, fd.shard_sequence(dout))])
            if i == 0 and group is None:
                first = p2p._transports[dist.group.WORLD.group_name][1]
        results[name] = runs
    world = dist.group.WORLD
    assert p2p.uses_copy_engines(world), f"the default group took NCCL: {p2p.why.get(world.group_name)}"
    assert p2p._transports[world.group_name][1] is first, "the transport was made again (the group not recognised)"
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(results["copy engine"], results["nccl"])):
        for what, x, y in zip(("out", "dq", "dk", "dv"), a, b):
            assert torch.equal(x, y), f"rank {rank}, call {i} {(cases * 2)[i]}: {what} differs from NCCL's"


def test_ring_by_copy_engines_matches_nccl():
    _spawn(_copy_engine_vs_nccl)


def _four_ranks_on_shared_gpus(rank):
    import torch.distributed as dist
    from flashrt import p2p
    cases = [(1, 2048, 4, 2, 64, True, "zigzag", False), (2, 1024, 4, 4, 128, False, "contiguous", False),
             (1, 4096, 8, 2, 128, True, "zigzag", False)]
    _ring_vs_single(rank, cases, check=False)
    world = dist.group.WORLD
    assert p2p.uses_copy_engines(world), f"the ring took NCCL: {p2p.why.get(world.group_name)}"


def test_ring_of_four_by_copy_engines_on_shared_gpus():
    """A ring of 4 ranks (gloo for the group's setup, two ranks a GPU) whose transfers all go by the copy engines
    (flashrt/p2p.py): each rank's next and previous are different ranks, as on 4 or 8 GPUs; outputs and gradients
    against single-GPU flashrt and float64."""
    _spawn(_four_ranks_on_shared_gpus, world=4, backend="gloo")


def _packed_and_repeatable(rank):
    import flashrt
    import flashrt.distributed as fd
    S, H, D = 1536, 4, 64
    q, k, v, dout = (t[0] for t in _inputs(1, S, H, H, D, seed=7))
    cu = torch.tensor([0, 100, 700, 701, 1300, S], dtype=torch.int32, device="cuda")
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    single = flashrt.attention(*whole, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=600,
                               max_seqlen_k=600)
    single_grads = torch.autograd.grad(single, whole, dout)
    results = []
    for _ in range(2):
        local = [fd.shard_sequence(t, dim=0).requires_grad_() for t in (q, k, v)]
        out, lse = fd.ring_attention(*local, causal=True, cu_seqlens=cu, return_lse=True)
        assert out.shape == local[0].shape and lse.shape == (H, S // WORLD)
        grads = torch.autograd.grad(out, local, fd.shard_sequence(dout, dim=0))
        results.append([out, lse, *grads])
    for a, b in zip(*results):  # bitwise the same, run after run
        assert torch.equal(a, b)
    for got, want in zip(results[0][:1] + results[0][2:], (single, *single_grads)):
        got = fd.unshard_sequence(got, dim=0)
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got - want).abs().max()


def test_packed_documents_and_bitwise_repeatability():
    _spawn(_packed_and_repeatable)


def _errors(rank):
    import flashrt.distributed as fd
    q, k, v, _ = _inputs(1, 512 if rank == 0 else 1024, 2, 2, 64, seed=1)
    with pytest.raises(ValueError, match="same shapes and options on every rank"):
        fd.ring_attention(q, k, v, causal=True)
    q, k, v, _ = _inputs(1, 255, 2, 2, 64, seed=1)
    with pytest.raises(ValueError, match="even number of tokens"):
        fd.ring_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="equal chunks"):
        fd.shard_sequence(torch.zeros(1, 510, device="cuda"))
    with pytest.raises(ValueError, match="layout must be"):
        fd.ring_attention(q, k, v, layout="striped")


def test_errors_name_the_problem():
    _spawn(_errors)


def _training_step(rank, wrapper):
    """A causal attention layer under DistributedDataParallel or FSDP2 (fully_shard), each rank on its shard of
    one sequence, fp32 weights under bf16 autocast: the ranks' averaged parameter gradients times the world size
    equal the whole sequence's on one GPU (each rank's loss is its tokens' share of the sum)."""
    import flashrt
    import flashrt.distributed as fd
    S, H, D = 1024, 4, 64
    E = H * D

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = torch.nn.Linear(E, 3 * E), torch.nn.Linear(E, E)

        def forward(self, x, attend):
            q, k, v = self.qkv(x).unflatten(-1, (3, H, D)).unbind(2)
            return self.proj(attend(q, k, v).flatten(-2))

    torch.manual_seed(0)
    single, sharded = Layer().cuda(), Layer().cuda()
    sharded.load_state_dict(single.state_dict())
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(sharded, device_ids=[rank])
    else:
        from torch.distributed.fsdp import fully_shard
        model = fully_shard(sharded)
    g = torch.Generator(device="cuda").manual_seed(5)
    x, w = torch.randn(1, S, E, device="cuda", generator=g), torch.randn(1, S, E, device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (single(x, lambda q, k, v: flashrt.attention(q, k, v, causal=True)).float() * w).sum().backward()
        out = model(fd.shard_sequence(x), lambda q, k, v: fd.ring_attention(q, k, v, causal=True))
        (out.float() * fd.shard_sequence(w)).sum().backward()
    for (name, a), b in zip(single.named_parameters(), sharded.parameters()):
        grad = b.grad.full_tensor() if hasattr(b.grad, "full_tensor") else b.grad  # (FSDP2: a sharded DTensor)
        err = float((grad * WORLD - a.grad).norm() / a.grad.norm())
        assert err < 2e-2, (wrapper, name, err)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_training_step_under_ddp_and_fsdp2(wrapper):
    _spawn(_training_step, wrapper)


def _ulysses(rank):
    import flashrt
    import flashrt.distributed as fd
    cases = [(2, 1024, 4, 4, 64, True, "zigzag", {}), (1, 1024, 4, 1, 128, True, "contiguous", {}),
             (1, 2048, 8, 2, 64, False, "zigzag", {"window": (100, 37)}),
             (1, 1024, 4, 2, 192, True, "zigzag", {}, 128)]  # (v's head_dim of its own)
    for i, (B, S, H, Hkv, D, causal, layout, mask, *Dv) in enumerate(cases):
        q, k, v, dout = _inputs(B, S, H, Hkv, D, seed=40 + i, Dv=Dv[0] if Dv else None)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        single = flashrt.attention(*whole, causal=causal, **mask)
        single_grads = torch.autograd.grad(single, whole, dout)
        local = [fd.shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
        out = fd.ulysses_attention(*local, causal=causal, layout=layout, **mask)
        grads = torch.autograd.grad(out, local, fd.shard_sequence(dout, layout=layout))
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (single, *single_grads)):
            got = fd.unshard_sequence(got, layout=layout)
            err = float((got.double() - want.double()).norm() / want.double().norm())
            assert err < 1e-2, (cases[i], name, err)
    # softcap, ALiBi and sinks: each rank's head group takes its slopes and sinks; the sinks' gradient summed over
    # the ranks is the single GPU's
    q, k, v, dout = _inputs(2, 1024, 8, 2, 128, seed=47)
    g = torch.Generator(device="cuda").manual_seed(48)
    slopes = torch.rand(2, 8, device="cuda", generator=g)
    for kw in (dict(sinks=True, alibi_slopes=slopes, causal=True), dict(softcap=5.0, sinks=True)):
        sinks = torch.randn(8, device="cuda", generator=g).requires_grad_()
        kw = dict(kw, sinks=sinks)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        single = flashrt.attention(*whole, **kw)
        single_grads = torch.autograd.grad(single, [*whole, sinks], dout)
        local = [fd.shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out = fd.ulysses_attention(*local, **kw)
        grads = list(torch.autograd.grad(out, [*local, sinks], fd.shard_sequence(dout)))
        torch.distributed.all_reduce(grads[3])
        for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (single, *single_grads)):
            got = got if name == "dsinks" else fd.unshard_sequence(got)
            err = float((got.double() - want.double()).norm() / want.double().norm())
            assert err < 1e-2, (kw.keys(), name, err)
    q, k, v, _ = _inputs(1, 256, 3, 3, 64, seed=1)
    with pytest.raises(ValueError, match="multiple of the ranks"):
        fd.ulysses_attention(q, k, v)


def test_ulysses_matches_single_gpu():
    _spawn(_ulysses)


def _compiled(rank):
    """torch.compile(fullgraph=True) traces both: the ring is one opaque op (bitwise the eager result); Ulysses'
    exchanges and reshapes are traced, and where KV heads are repeated to one per rank Inductor may fuse the
    gradient's sum over the copies with the adds around it (one rounding instead of two): close, not bitwise."""
    import flashrt.distributed as fd
    q, k, v, dout = (fd.shard_sequence(t) for t in _inputs(1, 1024, 4, 2, 128, seed=3))

    def ring_layer(q, k, v):
        return fd.ring_attention(q * 1.0, k, v, causal=True) * 2.0

    def ulysses_layer(q, k, v):
        return fd.ulysses_attention(q * 1.0, k, v, causal=True) * 2.0

    for layer, exact in ((ring_layer, True), (ulysses_layer, False)):
        results = []
        for f in (layer, torch.compile(layer, fullgraph=True)):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            out = f(*x)
            results.append([out, *torch.autograd.grad(out, x, dout)])
        for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
            if exact:
                assert torch.equal(a, b), (layer.__name__, name)
            else:
                assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2), (layer.__name__, name)


def test_torch_compile_fullgraph():
    _spawn(_compiled)
