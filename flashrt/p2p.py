"""The ring's transfers by the GPUs' copy engines. Where every rank of a group runs on one host and reaches its two
neighbours' memory (NVLink or PCIe peer access), flashrt.distributed passes keys, values and dK/dV accumulators by
cudaMemcpyAsync into buffers of the neighbour's that CUDA IPC mapped here, instead of NCCL's send / receive kernels.
The copy engines need no SMs: the transfer runs beside the step kernels without slowing them or being slowed (2 x
H200: NCCL's K / V pass 0.60 ms alone and ~1.97 beside a step; by the copy engines 0.36 either way;
docs/perf-notes.md: Context parallelism).

A pass in one direction (to the next rank, or to the previous) has a sequence number n, the same on every rank
(passes are collective, in one order), and uses slot n % 2 of the receiver's two:
- send stream: wait until the receiver has copied out what this rank put in that slot two passes ago (the slot's
  "free" flag here reaches n - 2), copy each tensor into the slot, then write n to the receiver's "ready" flag;
- receive stream: wait for this rank's "ready" flag of the slot to reach n, copy the slot out into fresh tensors
  (the caller's to keep, as NCCL's receive buffers were), then write n to the sender's "free" flag.
The streams wait on and write the flags themselves (cuStreamWaitValue32 / cuStreamWriteValue32, the latter fenced):
no SMs, no host synchronisation, so the host runs ahead as with NCCL. Slots grow when a pass needs more (on every
rank at the same pass: a one-time host synchronisation and exchange of IPC handles).

NCCL stays with FLASHRT_NO_COPY_ENGINE=1, for a group whose ranks span hosts or lack peer access, and for passes
during CUDA graph capture (the sequence numbers would be baked into the graph).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import socket

import torch
import torch.distributed as dist

from . import _env, launch

_ALIGN = 256                 # each tensor's offset in a slot
_WAIT_GEQ = 0x0              # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0
_WRITE_FENCED = 0x0          # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write
_MEMCPY_DEFAULT = 4          # cudaMemcpyDefault (unified addressing: local or mapped peer memory)
_IPC_LAZY_PEER_ACCESS = 1    # cudaIpcMemLazyEnablePeerAccess
_READY, _FREE = 0, 1         # flags: int32 [kind][direction][slot]


def _flag(base: int, kind: int, direction: int, slot: int) -> int:
    return base + 4 * ((kind * 2 + direction) * 2 + slot)


class _StreamMemOps:
    """cuStreamWaitValue32 / cuStreamWriteValue32 from libcuda (CuPy does not wrap the stream memory operations)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.wait, self.write = (self._function(lib, name) for name in ("cuStreamWaitValue32",
                                                                        "cuStreamWriteValue32"))

    @staticmethod
    def _function(lib, name: str):
        for symbol in (name + "_v2", name):  # (the _v2 forms work on every device since CUDA 11.7)
            f = getattr(lib, symbol, None)
            if f is not None:
                f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                f.restype = ctypes.c_int
                return f
        raise OSError(f"libcuda has no {name}")

    @staticmethod
    def call(f, stream: int, address: int, value: int, flags: int) -> None:
        rc = f(stream, address, value & 0xFFFFFFFF, flags)
        if rc != 0:
            raise RuntimeError(f"{f.__name__} failed: CUresult {rc}")


log = logging.getLogger("flashrt")
_memops = None
_transports: dict = {}  # group name -> (the group, its _Transport or None: NCCL)
why: dict = {}          # group name -> why this rank could not use the copy engines (where it could not)


def _cupy():
    import cupy
    return cupy


@contextlib.contextmanager
def _current(index: int):
    """Device `index`'s context current on this thread for the runtime and driver calls inside (launch.make_current),
    the previous device set back after."""
    previous = launch.make_current(index)
    try:
        yield
    finally:
        if previous is not None:
            _cupy().cuda.runtime.setDevice(previous)


def transport(g, device: torch.device):
    """The group's copy-engine transport, or None (NCCL). Decided once per group by every rank together, at the
    group's first pass: each rank's host and GPU (by PCI bus id) are gathered, each rank opens its neighbours'
    memory, and the copy engines are used only where every rank succeeded."""
    key = getattr(g, "group_name", None) or id(g)
    known = _transports.get(key)
    if known is not None and known[0] is g:
        return known[1]
    if known is not None and known[1] is not None:  # (a group destroyed and its name given to a new one)
        torch.cuda.synchronize(known[1].device)
        dist.barrier(group=g)  # (every rank's copies into and out of the old slots are done before they go)
        known[1].close()
    global _memops
    cupy = _cupy()
    rt = cupy.cuda.runtime
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    try:
        facts = (_host(), rt.deviceGetPCIBusId(device.index), not _env.no_copy_engine())
    except Exception:  # (no bus id: this rank cannot name its GPU to the others)
        facts = (_host(), None, False)
    everyone = [None] * world
    dist.all_gather_object(everyone, facts, group=g)
    ok = all(f[0] == facts[0] and f[2] for f in everyone)
    if not ok:
        why[key] = ("a rank's GPU has no PCI bus id" if any(f[1] is None for f in everyone) else
                    "the ranks span hosts" if any(f[0] != facts[0] for f in everyone) else
                    "FLASHRT_NO_COPY_ENGINE=1 on a rank")
    t = None
    if ok:
        try:
            for r in ((rank + 1) % world, (rank - 1) % world):
                peer = rt.deviceGetByPCIBusId(everyone[r][1])
                if peer != device.index and not rt.deviceCanAccessPeer(device.index, peer):
                    raise RuntimeError("no peer access")
            _memops = _memops or _StreamMemOps()
            t = _Transport(g, device)
        except Exception as e:  # (this rank cannot: every rank keeps NCCL)
            why[key] = f"rank {rank}: {e!r}"
            t = None
        # (every step collective, taken by every rank: a failure on one is known to all)
        if not _everyone(g, t is not None) or not _everyone(g, t.open_peers()):
            if t is not None:
                t.close()
            t = None
    _transports[key] = (g, t)
    log.info("flashrt ring transfers of group %s (%d ranks): %s", key, world,
             "copy engines" if t is not None else f"NCCL ({why.get(key, 'another rank could not map its neighbours')})")
    return t


def uses_copy_engines(g) -> bool | None:
    """Whether group g's ring passes go by the copy engines (None: no pass yet)."""
    known = _transports.get(getattr(g, "group_name", None) or id(g))
    return None if known is None else known[1] is not None


def _everyone(g, ok: bool) -> bool:
    verdicts = [None] * dist.get_world_size(g)
    dist.all_gather_object(verdicts, ok, group=g)
    return all(verdicts)


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:  # (one per booted host, unlike a container's hostname)
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class _Work:
    """What distributed._wait waits on: the current stream waits for the pass's copies, both ways."""

    def __init__(self, event, device):
        self.event, self.device = event, device

    def wait(self):
        torch.cuda.current_stream(self.device).wait_event(self.event)


class _Transport:
    def __init__(self, g, device: torch.device):
        rt = _cupy().cuda.runtime
        self.g, self.device, self.index = g, device, device.index
        self.world, self.rank = dist.get_world_size(g), dist.get_rank(g)
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self.dst, self.src = (nxt, prv), (prv, nxt)   # per direction (0: to the next rank): sent to, received from
        self.send_stream, self.recv_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.seq = [0, 0]            # passes so far, per direction
        self.capacity = [0, 0]       # bytes of a slot, per direction
        self.slots = [0, 0]          # this rank's two receive slots, per direction
        self.peer_slots = [0, 0]     # the receiver's, mapped here
        self.opened: dict = {}       # rank -> {allocation name: mapped pointer}
        self.flags = 0
        with _current(self.index):
            self.flags = rt.malloc(2 * 2 * 2 * 4)
            rt.memset(self.flags, 0, 2 * 2 * 2 * 4)
            rt.deviceSynchronize()
        self.peer_flags: dict = {}

    def open_peers(self) -> bool:
        """Map the neighbours' flags (collective: every rank calls it once). False where this rank failed."""
        rt = _cupy().cuda.runtime
        try:
            mine = bytes(rt.ipcGetMemHandle(self.flags))
        except Exception:
            mine = None
        handles = [None] * self.world
        dist.all_gather_object(handles, mine, group=self.g)
        try:
            for r in set(self.dst):
                self.peer_flags[r] = self._open(r, "flags", handles[r])
        except Exception:  # (a rank without a handle too: None is no handle)
            return False
        return True

    def _open(self, rank: int, name: str, handle: bytes) -> int:
        rt = _cupy().cuda.runtime
        with _current(self.index):
            ptr = rt.ipcOpenMemHandle(handle, _IPC_LAZY_PEER_ACCESS)
        self.opened.setdefault(rank, {})[name] = ptr
        return ptr

    def close(self) -> None:
        rt = _cupy().cuda.runtime
        for mapped in self.opened.values():
            for ptr in mapped.values():
                rt.ipcCloseMemHandle(ptr)
        self.opened.clear()
        for ptr in (*self.slots, self.flags):
            if ptr:
                rt.free(ptr)

    def _grow(self, direction: int, need: int) -> None:
        """Slots of `need` bytes in this direction, on every rank at the same pass (they pass alike tensors)."""
        rt = _cupy().cuda.runtime
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.g)  # (no copy into or out of the old slots is left, on any rank)
        name, dst = f"slots{direction}", self.dst[direction]
        if self.peer_slots[direction]:
            rt.ipcCloseMemHandle(self.opened[dst].pop(name))
        dist.barrier(group=self.g)  # (every mapping of the old slots closed before they are freed)
        with _current(self.index):
            if self.slots[direction]:
                rt.free(self.slots[direction])
            self.slots[direction] = rt.malloc(2 * need)
        handles = [None] * self.world
        dist.all_gather_object(handles, bytes(rt.ipcGetMemHandle(self.slots[direction])), group=self.g)
        self.peer_slots[direction] = self._open(dst, name, handles[dst])
        self.capacity[direction] = need

    def pass_on(self, tensors: tuple, back: bool) -> tuple[tuple, list]:
        """Send `tensors` to the next rank (back: the previous) and receive their like from the other neighbour:
        (the received tensors, [a work whose wait() makes the current stream wait for them])."""
        rt = _cupy().cuda.runtime
        d = int(back)
        tensors = tuple(t.contiguous() for t in tensors)
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + -(-n // _ALIGN) * _ALIGN)
        if offsets[-1] > self.capacity[d]:
            self._grow(d, offsets[-1])
        self.seq[d] += 1
        n, slot = self.seq[d], self.seq[d] % 2
        cur = torch.cuda.current_stream(self.device)
        received = tuple(torch.empty_like(t) for t in tensors)
        start = torch.cuda.Event()
        start.record(cur)  # (what is sent is written, and the received tensors' memory free, once it is reached)
        send, recv = self.send_stream, self.recv_stream
        send.wait_event(start)
        recv.wait_event(start)
        s, r = send.cuda_stream, recv.cuda_stream
        into = self.peer_slots[d] + slot * self.capacity[d]
        out_of = self.slots[d] + slot * self.capacity[d]
        ops = _memops
        with _current(self.index):
            ops.call(ops.wait, s, _flag(self.flags, _FREE, d, slot), n - 2, _WAIT_GEQ)
            for t, size, off in zip(tensors, sizes, offsets):
                if size:
                    rt.memcpyAsync(into + off, t.data_ptr(), size, _MEMCPY_DEFAULT, s)
                t.record_stream(send)  # (the caller may drop it before the copy ran)
            ops.call(ops.write, s, _flag(self.peer_flags[self.dst[d]], _READY, d, slot), n, _WRITE_FENCED)
            ops.call(ops.wait, r, _flag(self.flags, _READY, d, slot), n, _WAIT_GEQ)
            for t, size, off in zip(received, sizes, offsets):
                if size:
                    rt.memcpyAsync(t.data_ptr(), out_of + off, size, _MEMCPY_DEFAULT, r)
            ops.call(ops.write, r, _flag(self.peer_flags[self.src[d]], _FREE, d, slot), n, _WRITE_FENCED)
        sent, done = torch.cuda.Event(), torch.cuda.Event()
        sent.record(send)
        recv.wait_event(sent)  # (as NCCL's: after the wait, what was sent may be written again)
        done.record(recv)
        return received, [_Work(done, self.device)]
