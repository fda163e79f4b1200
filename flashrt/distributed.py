"""Context parallelism over torch.distributed, forward and backward, on any number of GPUs: ring attention,
and the all-to-all form (ulysses_attention).

    import flashrt.distributed as fd
    q, k, v = (fd.shard_sequence(x, group) for x in (q, k, v))        # (B, S/world, H, D) each, zigzag
    out = fd.ring_attention(q, k, v, group=group, causal=True)          # this rank's rows of the output
    pos = fd.position_ids(S, group, device=q.device)                   # global positions, for RoPE

Each rank holds a shard of the sequence (flashrt/ring.py: the layouts and the step plan). The keys and values
travel around the ring while the held block is computed, so the transfer hides behind the kernels: by the copy
engines into the neighbour's memory where every rank is on one host with peer access (flashrt/p2p.py), else by NCCL
point-to-point (torch.distributed.batch_isend_irecv). The steps' (out, lse) parts combine by their lse after the
ring (flashrt.combine: fp32 sums, one rounding); the backward runs the steps in reverse order from the keys the
forward held last, each key shard's dK/dV parts travelling with it as one accumulator to its owner (_ring_backward).
The order of every addition is fixed, so with deterministic=True results are bitwise reproducible for a given
world size.

The forward and backward are torch custom ops (flashrt::ring_fwd, flashrt::ring_bwd) with an autograd
formula: torch.compile sees one opaque op (no graph break), and DDP / FSDP see ordinary autograd.
"""
from __future__ import annotations

import math
from typing import Optional

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as _exc:
    if _exc.name != "torch":
        raise
    from . import _torch_missing
    raise _torch_missing("flashrt.distributed") from _exc

from . import api, masks, p2p, ring, torch_ops
from .api import _sink_grad_of  # (imported: the CPU tests stand in for `api`)
from .ring import LAYOUTS  # noqa: F401  (part of this module's interface)


def _group(group):
    """A ProcessGroup from None (the default group), a ProcessGroup, or a 1-D DeviceMesh."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("flashrt.distributed needs torch.distributed initialised (torch.distributed."
                               "init_process_group('nccl')) or an explicit group")
        return dist.group.WORLD
    if hasattr(group, "get_group"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"pass a 1-D DeviceMesh (mesh['cp'] of a larger mesh), got a {group.ndim}-D mesh")
        return group.get_group()
    return group


def _world_rank(group, world, rank) -> tuple[int, int]:
    if world is None or rank is None:
        g = _group(group)
        return dist.get_world_size(g), dist.get_rank(g)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world), got rank {rank}, world {world}")
    return world, rank


def shard_sequence(x: torch.Tensor, group=None, *, layout: str = "zigzag", dim: int = 1, world: int | None = None,
                   rank: int | None = None) -> torch.Tensor:
    """This rank's shard of a whole sequence `x` along `dim` (a contiguous copy): the tokens ring_attention
    expects from it. `world`/`rank` may be given instead of a group (no torch.distributed needed)."""
    world, rank = _world_rank(group, world, rank)
    ranges = ring.local_ranges(layout, world, rank, x.shape[dim])
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


def unshard_sequence(x: torch.Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard `x` (an all-gather; every rank gets it). No gradient."""
    g = _group(group)
    world = dist.get_world_size(g)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=g)
    return merge_shards(parts, layout=layout, dim=dim)


def merge_shards(parts: list, *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The whole sequence from the list of every rank's shard, in rank order (unshard_sequence without the
    all-gather)."""
    world = len(parts)
    n = parts[0].shape[dim] * world
    pieces = []
    for r, part in enumerate(parts):
        offset = 0
        for a, b in ring.local_ranges(layout, world, r, n):
            pieces.append((a, part.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim=dim)


def position_ids(seqlen: int, group=None, *, layout: str = "zigzag", device=None, world: int | None = None,
                 rank: int | None = None) -> torch.Tensor:
    """The global positions (int64) of this rank's tokens of a `seqlen`-token sequence, for RoPE."""
    world, rank = _world_rank(group, world, rank)
    return torch.cat([torch.arange(a, b, device=device) for a, b in ring.local_ranges(layout, world, rank, seqlen)])


# ---------------------------------------------------------------------------------------------------------------
# The ring


def _peers(g) -> tuple[int, int]:
    """Global ranks of the next and the previous rank of group g."""
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    return dist.get_global_rank(g, (rank + 1) % world), dist.get_global_rank(g, (rank - 1) % world)


def _pass_on(g, tensors: tuple, back: bool = False) -> tuple[tuple, list]:
    """Start sending `tensors` to the next rank and receiving their like from the previous one (back: to the
    previous, from the next). Every transfer of the ring goes through here (scripts/bench_cp.py's "no comm" replaces
    it with the tensors themselves)."""
    if not tensors:
        return (), []
    if tensors[0].is_cuda and not _capturing():
        t = p2p.transport(g, tensors[0].device)  # (the copy engines where every rank can: flashrt/p2p.py)
        if t is not None:
            return t.pass_on(tensors, back)
    nxt, prv = _peers(g)
    dst, src = (prv, nxt) if back else (nxt, prv)
    received = tuple(torch.empty_like(t) for t in tensors)
    ops = [dist.P2POp(dist.isend, t, dst, g) for t in tensors] + [dist.P2POp(dist.irecv, t, src, g)
                                                                  for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()  # (makes the current stream wait for NCCL's; no host synchronisation)


_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}


def _dtype_code(t) -> int:
    return _DTYPE_CODES.get(t.dtype, 0)


def _agree(g, device, sig: list, names: str, what: str) -> None:
    """Raise on every rank at once unless every rank's `sig` (ints) is the same: an all-gather and one host
    synchronisation. Shapes that differ between ranks would otherwise hang the transfers or mix tensors."""
    mine = torch.tensor(sig, dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(g) * len(sig), dtype=torch.int64, device=device)  # (flat: gloo too)
    dist.all_gather_into_tensor(every, mine, group=g)
    rows = every.view(-1, len(sig)).tolist()
    if any(r != rows[0] for r in rows):
        raise ValueError(f"{what} needs the same shapes and options on every rank; per rank [{names}]: "
                         + "; ".join(f"rank {i}: {r}" for i, r in enumerate(rows)))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _take_report():
    """The failure an earlier flashrt call's device check reported (masks.raise_reported), taken instead of raised:
    raised on one rank in the middle of the ring, it would leave the other ranks waiting on its transfers."""
    try:
        masks.raise_reported()
    except ValueError as exc:
        return exc
    return None


def _check_ranks(g, q, k, v, causal: bool, layout: str, segment_ids, cu_seqlens, pending, sinks: bool = False) -> None:
    """ring_attention's arguments agree on every rank (_agree), and no rank holds a reported failure (`pending`):
    that rank raises it, the others say that another rank holds one."""
    a = segment_ids if segment_ids is not None else cu_seqlens  # (a fixed length: the all-gather needs one)
    ids = (0, 0, 0, 0) if a is None else (1 if a is segment_ids else 2, a.dim(), a.numel(), a.dtype == torch.int32)
    sig = [*q.shape, *k.shape, *v.shape, _dtype_code(q), _dtype_code(k), _dtype_code(v), int(causal),
           ring.LAYOUTS.index(layout), *ids, int(sinks)]
    names = "q, k, v shapes (4 each), their dtypes, causal, layout, ids (kind, dims, size, int32), sinks"
    flags = torch.tensor([pending is not None], dtype=torch.int64, device=q.device)
    _agree(g, q.device, sig, names, "ring_attention")
    dist.all_reduce(flags, group=g)
    if pending is not None:
        raise pending
    if int(flags):
        raise ValueError("ring_attention: another rank holds a failure reported by an earlier flashrt call's device "
                         "check (its ValueError says what); no rank started the ring")


def _ids_per_rank(g, layout: str, local_len: int, segment_ids, cu_seqlens) -> tuple | None:
    """The query-side and key-side document ids of every rank's shard ((B, local_len) int32 each), or None.

    With cu_seqlens, tokens outside [cu[0], cu[-1]) (padding) take query and key ids that match nothing, so they
    attend to nothing and are attended by nothing (out 0, lse -inf, zero gradients), as flashrt's varlen rows are."""
    if segment_ids is None and cu_seqlens is None:
        return None
    world = dist.get_world_size(g)
    n = local_len * world
    if cu_seqlens is not None:  # packed sequences: document i holds tokens [cu[i], cu[i+1])
        cu = cu_seqlens.to(torch.int64)
        token = torch.arange(n, device=cu.device)
        doc = torch.searchsorted(cu[1:].contiguous(), token, right=True)
        docs = cu.numel() - 1
        before, after = token < cu[0], token >= cu[-1]
        q_ids = torch.where(before, -2, torch.where(after, docs, doc)).to(torch.int32)[None]
        k_ids = torch.where(before, -1, torch.where(after, docs + 1, doc)).to(torch.int32)[None]
        return tuple([shard_sequence(x, layout=layout, world=world, rank=r) for r in range(world)]
                     for x in (q_ids, k_ids))
    parts = [torch.empty_like(segment_ids) for _ in range(world)]
    dist.all_gather(parts, segment_ids.contiguous(), group=g)
    return parts, parts


def _check_ids(ids, layout: str, cu_seqlens) -> None:
    """Document ids that decrease along the whole sequence (or cu_seqlens that do) would give wrong answers: one
    host synchronisation; every rank holds the same data, so every rank raises."""
    if cu_seqlens is not None:
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
        return
    whole = merge_shards(ids[0], layout=layout)
    if bool((whole[:, 1:] < whole[:, :-1]).any()):
        raise ValueError("segment_ids must not decrease along the whole sequence (each rank passes its shard, laid "
                         "out as shard_sequence makes it)")


def _combine(outs: list, lses: list) -> tuple:
    """(out, lse) of attention over the union of disjoint key ranges from each range's (out (B, s, H, D), lse
    (B, H, s)), in list order: flashrt.combine on the GPU (the sum in fp32, rounded once into the parts' dtype); on the
    CPU (the tests' float64 stand-ins for the kernels) the same sum in torch. A row no part saw: 0 and -inf."""
    if outs[0].is_cuda:
        from .decoding import combine
        return combine(list(outs), list(lses))
    every = torch.stack(list(lses))
    lse = torch.logsumexp(every, 0)
    safe = torch.where(lse == -math.inf, 0.0, lse)  # rows that saw no key: every weight 0
    weights = torch.exp(every - safe).transpose(2, 3).unsqueeze(-1)  # (n, B, s, H, 1)
    return (weights * torch.stack(list(outs))).sum(0), lse


def _merge_steps(parts: list, rows: int) -> tuple:
    """This rank's (out, lse) from its steps' (q0, q1, out, lse), in step order; step 0's covers every row. Each
    run of rows that the same steps cover is combined once (_combine) and written over step 0's rows."""
    out, lse = parts[0][2], parts[0][3]
    cuts = sorted({0, rows} | {p[0] for p in parts} | {p[1] for p in parts})
    for a, b in zip(cuts, cuts[1:]):
        over = [p for p in parts if p[0] <= a and b <= p[1]]
        if len(over) == 1:  # step 0's alone
            continue
        o, o_lse = _combine([p[2][:, a - p[0]:b - p[0]] for p in over],
                            [p[3][:, :, a - p[0]:b - p[0]] for p in over])
        if (a, b) == (0, rows):
            return o, o_lse
        out[:, a:b].copy_(o)
        lse[:, :, a:b].copy_(o_lse)
    return out, lse


def _masks(step, ids, rank) -> dict:
    if ids is None:
        return {}
    return dict(segment_ids_q=ids[0][rank][:, step.q0:step.q1].contiguous(),
                segment_ids_k=ids[1][step.src][:, step.k0:step.k1].contiguous())


def _ring_forward(q, k, v, g, causal: bool, layout: str, scale, ids, reports: list, sinks=None, padding=None):
    """This rank's (out, lse). Before each kernel call, a failure an earlier call reported is taken into
    `reports` (_take_report), to be raised after the ring. sinks (H,): flashrt.forward's, given to step 0's call
    (every row; the combine after the steps is order-free, so the sink counts once); `padding` (B, S_local) bool:
    rows that are no token (cu_seqlens' padding), whose lse goes back to -inf. The steps' parts are kept and
    combined once after the ring (_merge_steps): one rounding at any world size. Returns (out, lse, the keys and
    values held at the last step: rank+1's, where _ring_backward starts)."""
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    S = q.shape[1]
    steps = ring.ring_steps(layout, world, rank, S, causal)
    held = (k.contiguous(), v.contiguous())
    parts = []  # (q0, q1, out, lse) of each step that computes
    for i, step in enumerate(steps):
        if i + 1 < world:
            coming, works = _pass_on(g, held)
        if step is not None:
            reports.append(_take_report())
            kh, vh = (t[:, step.k0:step.k1] for t in held)
            o, lse = api.forward(q[:, step.q0:step.q1], kh, vh, causal=step.causal, softmax_scale=scale,
                                 sinks=sinks if i == 0 else None, validate=False,
                                 **_masks(step, ids, rank))  # (the ids are checked up front)
            parts.append((step.q0, step.q1, o, lse))
        if i + 1 < world:
            _wait(works)
            held = coming
    out, lse = _merge_steps(parts, S)
    if padding is not None:
        lse.masked_fill_(padding[:, None, :], -math.inf)
    return out.to(q.dtype), lse, held


def _ring_backward(dout, q, k, v, out, lse, last, g, causal: bool, layout: str, scale, impl: str,
                   deterministic: bool, ids, reports: list, sinks=None):
    """The forward's steps in reverse order: step world-1 first, with `last` (the keys and values the forward held
    last, rank+1's), then each earlier step's keys from the next rank (which held them one step before), down to
    step 0's own. A key shard's dK/dV parts travel with it as one accumulator, from rank s+world-1 down to its owner s,
    and reach s while s computes its own step 0, whose part is added last: no transfer waits after the last kernel,
    and two ranks pass no keys at all. An accumulator of one part travels in the kernels' dtype (exact), of more in
    fp32; the owner's sum is rounded once. Reports are taken into `reports` as in _ring_forward. Returns (dq, dk, dv,
    this rank's share of dsinks or None): out and lse include the sinks, so the steps' kernels need nothing more."""
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    S = q.shape[1]
    steps = ring.ring_steps(layout, world, rank, S, causal)
    own = (k.contiguous(), v.contiguous())
    held = own if world == 1 else last
    # dQ: each step adds its rows (in fp32 where a row adds more than two parts; two bf16 parts round once)
    dq = torch.zeros_like(q, dtype=torch.float32 if world > 2 else q.dtype)
    part = incoming = None  # the previous step's (key rows, dK, dV), and its keys' accumulator from the next rank
    works = []
    for i in reversed(range(world)):
        _wait(works)  # the previous step's transfers: this step's keys, the previous keys' accumulator
        # to the previous rank, and their like from the next: the previous step's keys' accumulator, its part added
        # (holding world - 1 - i parts); from step 2 on, these keys (the previous rank's at its step i - 1)
        acc = _accumulate(incoming, part, own, S, world - 1 - i > 1) if i + 1 < world else ()
        got, works = _pass_on(g, acc + (held if i >= 2 else ()), back=True)
        received, coming = got[:len(acc)], got[len(acc):]
        step, part = steps[i], None
        if step is not None:
            reports.append(_take_report())
            qs, ks = slice(step.q0, step.q1), slice(step.k0, step.k1)
            dq_s, dk_s, dv_s = api.backward(dout[:, qs], q[:, qs], held[0][:, ks], held[1][:, ks], out[:, qs],
                                            lse[:, :, qs].contiguous(), causal=step.causal, softmax_scale=scale,
                                            impl=impl, deterministic=deterministic, validate=False,
                                            **_masks(step, ids, rank))
            dq[:, qs] += dq_s
            part = (ks, dk_s, dv_s)
        incoming = received or None
        held = own if i == 1 else coming or held  # (the transfers complete before the next step: _wait above)
    _wait(works)
    dk, dv = part[1:]  # step 0's: this rank's keys, every row
    for mine, others in zip((dk, dv), incoming or ()):  # the others' accumulator, in fp32 and rounded once
        mine += others
    return dq.to(q.dtype), dk, dv, _sink_grad(sinks, dout, out, lse)


def _accumulate(acc, part, like, S: int, fp32: bool) -> tuple:
    """(dK, dV) of a key shard: `acc` (its parts so far, or None) plus `part` ((key rows, dK, dV) or None), in fp32
    or, for one part, in the kernels' dtype (0 + x is exact). `like`: the shard's keys and values (the shapes)."""
    if not fp32 and acc is None and part is not None and (part[0].start, part[0].stop) == (0, S):
        return part[1:]
    if acc is None:
        acc = tuple(torch.zeros_like(t, dtype=torch.float32 if fp32 else None) for t in like)
    elif fp32:
        acc = tuple(t.float() for t in acc)
    if part is not None:
        for a, p in zip(acc, part[1:]):
            a[:, part[0]] += p
    return acc


def _sink_grad(sinks, dout, out, lse):
    """This rank's share of dsinks (H,) fp32 (its rows), or None without sinks."""
    if sinks is None:
        return None
    return _sink_grad_of(sinks, lse, (dout.float() * out.float()).sum(-1).transpose(1, 2))


# ---------------------------------------------------------------------------------------------------------------
# The custom ops: the group travels by name (op schemas take no ProcessGroup), the ids as optional tensors.


def _resolve(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


@torch.library.custom_op("flashrt::ring_fwd", mutates_args=())
def _ring_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, causal: bool, layout: str,
              softmax_scale: Optional[float], impl: str, deterministic: bool, segment_ids: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor], check: bool,
              sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, and the keys and values the ring held last, which the backward starts with)."""
    g = _resolve(group_name)
    reports = [_take_report()]
    check = check and not _capturing()
    if check:
        _check_ranks(g, q, k, v, causal, layout, segment_ids, cu_seqlens, reports.pop(), sinks is not None)
    ids = _ids_per_rank(g, layout, q.shape[1], segment_ids, cu_seqlens)
    if check and ids is not None:
        _check_ids(ids, layout, cu_seqlens)
    # (cu_seqlens' padding: q and k ids differ there, -2 / -1 before cu[0] and docs / docs + 1 after cu[-1])
    rank = dist.get_rank(g)
    padding = ids[0][rank] != ids[1][rank] if cu_seqlens is not None and sinks is not None else None
    out, lse, (k_last, v_last) = _ring_forward(q, k, v, g, causal, layout, softmax_scale, ids, reports, sinks,
                                               padding)
    _raise_first(reports)
    mine = {t.untyped_storage().data_ptr() for t in (q, k, v)}  # (one rank: its own; an op's outputs alias no input)
    k_last, v_last = (t.clone() if t.untyped_storage().data_ptr() in mine else t for t in (k_last, v_last))
    return out, lse, k_last, v_last


def _raise_first(reports: list) -> None:
    """After the ring (every rank took part in every transfer): the first failure taken, if any."""
    for r in reports:
        if r is not None:
            raise r


@_ring_fwd.register_fake
def _ring_fwd_fake(q, k, v, group_name, causal, layout, softmax_scale, impl, deterministic, segment_ids, cu_seqlens,
                   check, sinks):
    B, S, H, _ = q.shape
    return (q.new_empty((B, S, H, v.shape[-1])), q.new_empty((B, H, S), dtype=torch.float32), k.new_empty(k.shape),
            v.new_empty(v.shape))


@torch.library.custom_op("flashrt::ring_bwd", mutates_args=())
def _ring_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, k_last: torch.Tensor, v_last: torch.Tensor, group_name: str, causal: bool,
              layout: str, softmax_scale: Optional[float], impl: str, deterministic: bool,
              segment_ids: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
              sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, this rank's share of dsinks); dsinks is empty (0,) without sinks (an op returns no None)."""
    g = _resolve(group_name)
    ids = _ids_per_rank(g, layout, q.shape[1], segment_ids, cu_seqlens)
    reports = [_take_report()]
    dq, dk, dv, dsinks = _ring_backward(torch_ops._kernel_ready(dout), q, k, v, o, lse, (k_last, v_last), g, causal,
                                        layout, softmax_scale, impl, deterministic, ids, reports, sinks)
    _raise_first(reports)
    return dq, dk, dv, lse.new_empty((0,)) if dsinks is None else dsinks


@_ring_bwd.register_fake
def _ring_bwd_fake(dout, q, k, v, o, lse, k_last, v_last, group_name, causal, layout, softmax_scale, impl,
                   deterministic, segment_ids, cu_seqlens, sinks):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            lse.new_empty((0,) if sinks is None else sinks.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, group_name, causal, layout, softmax_scale, impl, deterministic, segment_ids, cu_seqlens, _, sinks = inputs
    out, lse, k_last, v_last = output  # (the keys held last: one more K / V shard kept for the backward)
    ctx.save_for_backward(q, k, v, out, lse, k_last, v_last, segment_ids, cu_seqlens, sinks)
    ctx.options = (group_name, causal, layout, softmax_scale, impl, deterministic)
    ctx.mark_non_differentiable(lse, k_last, v_last)


def _backward(ctx, dout, _dlse, _dk_last, _dv_last):
    q, k, v, out, lse, k_last, v_last, segment_ids, cu_seqlens, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.flashrt.ring_bwd.default(dout, q, k, v, out, lse, k_last, v_last, *ctx.options,
                                                            segment_ids, cu_seqlens, sinks)
    return dq, dk, dv, *(None,) * 9, None if sinks is None else dsinks


_ring_fwd.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(q, k, v, *, group=None, causal: bool = False, layout: str = "zigzag",
                   softmax_scale: Optional[float] = None, impl: str = "auto", deterministic: bool = True,
                   segment_ids: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                   sinks: Optional[torch.Tensor] = None, return_lse: bool = False, check: bool = True):
    """Attention over a sequence sharded across the ranks of `group` (None: the default group; or a 1-D
    DeviceMesh), differentiable.

    q (B, S_local, H, D), k (B, S_local, Hkv, D) and v (B, S_local, Hkv, Dv) are this rank's shard (v's head_dim
    may differ, as flashrt.attention's), laid out as shard_sequence makes it (`layout`: "zigzag" balances a causal
    mask; "contiguous"); returns this rank's rows of the output (B, S_local, H, Dv) (and lse (B, H, S_local) fp32
    with return_lse=True, without a gradient). Every rank must call it with the same shapes and options.
    causal: each query sees the keys at or before its global position.
    segment_ids: (B, S_local) int32, this rank's shard of document ids that do not decrease along the whole
      sequence: a query sees only keys of its own document (packed documents split over shards).
    cu_seqlens: instead, the whole packed sequence's (n+1,) int32 document offsets (every rank the same);
      q, k, v may then be packed (S_local, H, D) (returned the same way, lse (H, S_local)). Tokens outside
      [cu[0], cu[-1]) (the padding to 2*world chunks) are no document: out 0, lse -inf, zero gradients.
    sinks: (H,) attention-sink logits (flashrt.forward's sinks; any floating dtype, computed in fp32),
      differentiable: each rank's gradient is its own rows' share, and the sum over the group's ranks is the
      whole gradient (reduce it over the context-parallel ranks, as FSDP over a dp x cp mesh does for every
      replicated parameter).
    impl, deterministic: the backward's kernels (flashrt.backward). With deterministic=True the same inputs
      give bitwise the same results on the same world size.
    Memory: with a gradient, the keys and values the forward held last (another rank's shard) are kept for the
      backward, which starts from them (one more k, v shard per rank; at two ranks the backward then passes no keys).
      The forward holds each step's output until it combines them after the ring: up to 2 x world outputs at once.
    check: before the ring, all-gather every rank's shapes and options and raise on every rank on a mismatch,
      or when a rank holds a failure that an earlier flashrt call's device check reported, and check that the
      document ids do not decrease (one host synchronisation, two with ids; skipped while a CUDA graph is
      captured). Without it, such a failure is raised after the ring, on its rank, and bad ids give wrong
      answers (never an access outside the tensors).
    """
    ring.check_layout(layout)
    api._check_impl(impl)
    if segment_ids is not None and cu_seqlens is not None:
        raise ValueError("pass segment_ids or cu_seqlens, not both")
    if causal not in (False, True):
        raise ValueError(f"causal must be True or False (the global positions align both ways), got {causal!r}")
    packed = q.dim() == 3
    if packed:
        if cu_seqlens is None:
            raise ValueError(f"q has shape {tuple(q.shape)}: packed (S_local, H, D) tensors need cu_seqlens")
        q, k, v = q[None], k[None], v[None]
    elif cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens describes one packed sequence: q must be (S_local, H, D) or (1, S_local, H, D), "
                         f"got {tuple(q.shape)}; for a batch of sequences, pass segment_ids (B, S_local)")
    if (k.dim() != 4 or q.dim() != 4 or v.dim() != 4 or k.shape[:-1] != v.shape[:-1] or k.shape[:2] != q.shape[:2]
            or k.shape[-1] != q.shape[-1]):
        raise ValueError(f"k must be (B, S_local, Hkv, D) and v (B, S_local, Hkv, Dv), with q's batch, S_local and D: "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    g = _group(group)
    q, k, v = torch_ops._autocast(q, k, v)
    if sinks is not None:
        if sinks.shape != (q.shape[2],) or sinks.device != q.device or not sinks.is_floating_point():
            raise ValueError(f"sinks must have shape ({q.shape[2]},) (one logit per query head), a floating dtype and "
                             f"q's device {q.device}, got {tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")
        sinks = sinks.float().contiguous()
    scale = None if softmax_scale is None else float(softmax_scale)
    out, lse, _, _ = torch.ops.flashrt.ring_fwd.default(q, k, v, g.group_name, bool(causal), layout, scale, impl,
                                                        bool(deterministic), segment_ids, cu_seqlens, bool(check),
                                                        sinks)
    if packed:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------------------------
# All-to-all (Ulysses): trade the sequence shard for a head shard, attend on the whole sequence, trade back.


def _heads_to_sequence(x, g, world: int, layout: str):
    """(B, S/world, H, D) of this rank's tokens -> (B, S, H/world, D): every token of this rank's head group,
    in sequence order."""
    from torch.distributed import _functional_collectives as funcol
    B, n, H, D = x.shape
    send = x.reshape(B, n, world, H // world, D).permute(2, 0, 1, 3, 4).contiguous()
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, g))  # (world: source rank, ...)
    if layout == "zigzag":  # rank r holds chunks r and 2*world-1-r
        got = got.reshape(world, B, 2, n // 2, H // world, D)
        got = torch.cat([got[:, :, 0], got[:, :, 1].flip(0)])  # (2*world chunks in order, B, n/2, h, D)
    return got.permute(1, 0, 2, 3, 4).reshape(B, n * world, H // world, D)


def _sequence_to_heads(x, g, world: int, layout: str):
    """The inverse of _heads_to_sequence."""
    from torch.distributed import _functional_collectives as funcol
    B, S, h, D = x.shape
    n = S // world
    if layout == "zigzag":
        chunks = x.reshape(B, 2 * world, n // 2, h, D).transpose(0, 1)
        x = torch.stack([chunks[:world], chunks[world:].flip(0)], dim=2)  # (world, B, 2, n/2, h, D)
    else:
        x = x.reshape(B, world, n, h, D).transpose(0, 1)
    send = x.reshape(world, B, n, h, D).contiguous()
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, g))  # (world: head group, ...)
    return got.permute(1, 2, 0, 3, 4).reshape(B, n, world * h, D)


def ulysses_attention(q, k, v, *, group=None, causal=False, layout: str = "zigzag",
                      softmax_scale: Optional[float] = None, impl: str = "auto", deterministic: bool = True,
                      softcap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
                      sinks: Optional[torch.Tensor] = None, check: bool = True, **mask_args):
    """Attention over a sequence sharded across the ranks of `group` by all-to-all (DeepSpeed-Ulysses):
    q, k, v are this rank's shard (as ring_attention takes them, v's head_dim its own); four all-to-alls trade it
    for every token of H/world heads, flashrt.attention runs there, and the output comes back as this rank's rows.

    H must be a multiple of the world size; with fewer KV heads than ranks, each KV head is repeated to one
    per rank (Hkv must divide the world size, or be a multiple of it). Mask arguments (window, segment_ids_q/k,
    block ids, causal="top_left", ...) describe the whole sequence, as flashrt.attention takes them, the same
    on every rank; a mask_mod or score_mod expression may not name the head (h): each rank holds its own head
    group (the expressions' q and k are positions in the whole sequence). softcap, alibi_slopes ((H,) or (B, H)) and
    sinks ((H,), differentiable) as flashrt.attention takes them, for all H heads and the same on every rank: each
    rank uses its head group's slopes and sinks, so that a rank's sinks gradient is its heads' (zero elsewhere) and
    the sum over the ranks is the whole gradient, as ring_attention's.
    Differentiable and traceable by torch.compile (torch's functional all-to-all).
    check: all-gather every rank's shapes first and raise on every rank on a mismatch (one host synchronisation;
    skipped under torch.compile and while a CUDA graph is captured).
    """
    masks.check_names(mask_args, "ulysses_attention")
    for name in ("mask_mod", "score_mod", "score_mod_grad"):
        expr = mask_args.get(name)
        if isinstance(expr, str) and "h" in masks._IDENTIFIER.findall(expr):
            raise ValueError(f"ulysses_attention cannot take a {name} that names the head (h): each rank attends "
                             f"with its own group of heads, numbered from 0 (neither ring_attention nor "
                             f"ulysses_attention takes a per-head {name} yet)")
    ring.check_layout(layout)
    g = _group(group)
    world = dist.get_world_size(g)
    B, n, H, D = q.shape
    Hkv = k.shape[2]
    if H % world:
        raise ValueError(f"ulysses_attention needs the query heads ({H}) to be a multiple of the ranks ({world}); "
                         f"use ring_attention")
    if Hkv % world and world % Hkv:
        raise ValueError(f"ulysses_attention needs the KV heads ({Hkv}) to divide the ranks ({world}) or be a "
                         f"multiple of them; use ring_attention")
    if layout == "zigzag" and n % 2:
        raise ValueError(f"the zigzag layout needs an even number of tokens per rank (2 chunks each), got {n}")
    if check and not torch.compiler.is_compiling() and not _capturing():
        _agree(g, q.device, [*q.shape, *k.shape, *v.shape, _dtype_code(q), _dtype_code(k), _dtype_code(v),
                             masks.CAUSAL_MODES.index(causal), ring.LAYOUTS.index(layout)],
               "q, k, v shapes (4 each), their dtypes, causal, layout", "ulysses_attention")
    h0, h1 = dist.get_rank(g) * (H // world), (dist.get_rank(g) + 1) * (H // world)  # this rank's head group
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (H,):
            raise ValueError(f"sinks must have shape ({H},) (one logit per query head, every rank's), got "
                             f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
        sinks = sinks[h0:h1]
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape not in ((H,), (B, H)):
            raise ValueError(f"alibi_slopes must have shape ({H},) or ({B}, {H}) (every rank's query heads), got "
                             f"{tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else alibi_slopes}")
        alibi_slopes = alibi_slopes[..., h0:h1]
    if Hkv < world:
        k, v = (t.repeat_interleave(world // Hkv, dim=2) for t in (k, v))
    q, k, v = (_heads_to_sequence(t, g, world, layout) for t in (q, k, v))
    out = torch_ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, impl=impl,
                              deterministic=deterministic, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                              **mask_args)
    return _sequence_to_heads(out, g, world, layout)
