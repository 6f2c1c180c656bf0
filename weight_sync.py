"""Weight sync: the trainers' new weights into every generator, after each optimizer step (or every
sync_interval).

    rank       0 ........... N-G-1 | N-G ........ N-1         (dist.py: rank roles)
    sync       rank 0 --- broadcast buckets ---> every generator
                                                              (group {trainer rank 0} + generators)

One code path for NCCL (GPU, which rides RDMA/InfiniBand when present) and gloo (CPU); colocated (no
generator ranks), each trainer rank hands the tensors to its own generator in-process, no broadcast.

Sender. Trainers materialise one full tensor at a time (`full_params`: DTensor.full_tensor(),
collective over the trainer mesh, so every trainer rank takes part); trainer rank 0 broadcasts them
in ~bucket_mb buckets: small tensors packed into a reused buffer (one broadcast per bucket), big
ones (>= _DIRECT_BYTES) straight from their own memory. Two buckets are in flight: bucket i is
packed while i-1 is on the wire. Names, shapes, dtypes and offsets cross the wire once (the bucket
plan, cached per group).

Receiver. Generators receive into two reused buffers (a fresh one page-faults on every byte, every
sync), bucket i+1 while `receive` consumes the zero-copy views (name, tensor) of bucket i. That
reuse is safe because buckets hold whole decoder blocks: vLLM's reload keeps a layer's views (q, k,
v of qkv_proj) until the whole layer has arrived, and a layer lies in one block. Embedding, final
norm and lm_head go last, together: vLLM defers a padded embedding (vocabulary not a multiple of 64)
to the end of the load. Parameter names are HF names (model.py mirrors the HF tree), so no renaming
table; a tied lm_head goes once as model.embed_tokens.weight (vLLM re-ties it on load).

In flight (`rollout.inflight_updates`). A generator rank that is generating ahead cannot wait in
the broadcast, and a collective cannot be polled. So trainer rank 0 first sets a key naming the new
version in the rendezvous store every rank shares (`announce`), and then enters the broadcast; a
generator checks for that key at every token boundary without waiting (`Announced`: one store
round-trip) and joins the broadcast there. The broadcast is the same collective either way, so both
loops keep one order.

Left out: CUDA IPC handles (verl's route for engines in other processes on the same GPU), quantised
or delta transfers.
"""
import datetime
import os
import time

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

import dist

_SYNC_PLANS = {}                  # sync group -> bucket plan, so metadata crosses the wire once
_DIRECT_BYTES = 1 << 20           # tensors this big are broadcast from their own memory, not packed
_SYNC_BUFS = {}                   # (group, device) -> two reused bucket buffers (sender or
#                                   receiver)


def sync_group(roles):
    """{trainer rank 0} + generator ranks; every rank must call this. None when colocated and on
    other trainers."""
    if roles.colocated:
        return None
    return dist.new_group([roles.trainer_ranks[0], *roles.generator_ranks])


def _sync_order(model, trained_only=True):
    """named_parameters() (a tied lm_head once, as embed_tokens), decoder blocks first, then the
    rest (see above). trained_only: what trains, since a frozen tensor still equals the checkpoint
    every generator loaded: with LoRA the adapters alone (lora.Merger folds them in)."""
    return sorted(((n, p) for n, p in model.named_parameters()
                   if p.requires_grad or not trained_only),
                  key=lambda kv: not kv[0].startswith("model.layers."))


# on a generator: only while it runs. DTensor ops outside autograd cost ~15x less per parameter
@torch.no_grad()
def full_params(model, trained_only=True):
    """(hf_name, full tensor), one at a time, in _sync_order. Collective over the trainer mesh for
    DTensors."""
    for name, p in _sync_order(model, trained_only):
        if isinstance(p, DTensor):
            # on a 1-rank mesh the local shard is whole: skip full_tensor()'s copy
            p = p.to_local() if p.device_mesh.size() == 1 else p.full_tensor()
        yield name, p.detach()


def _bucket_plan(model, bucket_bytes, direct_bytes):
    """[(bucket_nbytes, packed_nbytes, [(name, shape, dtype, byte_offset), ...]), ...] in
    _sync_order. A bucket holds whole units (a decoder block "model.layers.N."; all the rest is one
    last unit; why: module docstring), one unit bigger than bucket_bytes alone. Tensors under
    direct_bytes are packed at [0, packed_nbytes), the big ones follow; every offset is 64-byte
    aligned, so any dtype view is valid."""
    units, groups, plan, pad = {}, [[]], [], lambda n: -(-n // 64) * 64  # noqa: E731
    for name, p in _sync_order(model):
        key = name[:name.index(".", 13) + 1] if name.startswith("model.layers.") else "rest"
        units.setdefault(key, []).append((name, tuple(p.shape), p.dtype,
                                          p.numel() * p.element_size()))
    for unit in units.values():
        if groups[-1] and sum(pad(e[3]) for e in groups[-1] + unit) > bucket_bytes:
            groups.append([])
        groups[-1] += unit
    for group in groups:
        offsets, off = {}, 0
        # stable: packed first, then big
        for name, *_, n in sorted(group, key=lambda e: e[3] >= direct_bytes):
            offsets[name], off = off, off + pad(n)
        packed = sum(pad(n) for *_, n in group if n < direct_bytes)
        plan.append((off, packed, [(name, shape, dtype, offsets[name])
                                   for name, shape, dtype, _ in group]))
    return plan


def _bufs(group, device, caps):
    """Two uint8 buffers, reused bucket after bucket. On CPU also kept from sync to sync (a fresh
    allocation pays a page fault per 4 KiB, every sync); on a GPU the caching allocator makes a
    fresh pair cheap, and the memory (about the embedding plus a bucket: ~5 GB for a 7B model in
    fp32) goes back to the pool between syncs."""
    if torch.device(device).type != "cpu":
        return [torch.empty(c, dtype=torch.uint8, device=device) for c in caps]
    bufs = _SYNC_BUFS.get((id(group), str(device)))
    if bufs is None or [b.numel() for b in bufs] != caps:
        bufs = _SYNC_BUFS[(id(group), str(device))] = [
            torch.empty(c, dtype=torch.uint8, device=device) for c in caps]
    return bufs


def _send_buckets(model, plan, group, src, device):
    """Per bucket one broadcast of the packed tensors, then one per big tensor from its own memory,
    all async: bucket i is packed while i-1 is on the wire, after waiting for i-2 (its buffer, its
    tensors): two in flight."""
    params = full_params(model)
    bufs = _bufs(group, device, [max([b[1] for b in plan[j::2]], default=0) for j in (0, 1)])
    works = [[], []]
    for i, (_, packed, entries) in enumerate(plan):
        for w in works[i % 2]:
            w.wait()
        buf, direct = bufs[i % 2], []
        for name, shape, dtype, off in entries:
            pname, t = next(params)
            if pname != name or tuple(t.shape) != shape or t.dtype != dtype:
                raise RuntimeError(
                    f"model changed since the first sync: {pname} vs cached {name}")
            t = t.reshape(-1).view(torch.uint8)
            if off < packed:
                buf[off:off + t.numel()].copy_(t)
            else:
                direct.append(t)
        works[i % 2] = [tdist.broadcast(t, src=src, group=group, async_op=True)
                        for t in ([buf[:packed]] if packed else []) + direct]
    for w in works[0] + works[1]:
        w.wait()


def _recv_buckets(plan, group, src, device):
    """(name, tensor) views into bufs[i % 2] for bucket i. Bucket i+1 arrives over bucket i-1 while
    the caller consumes bucket i: it must hold no view of bucket i-1 once it asks for bucket i
    (vLLM: see the module docstring)."""
    bufs = _bufs(group, device, [max([b[0] for b in plan[j::2]], default=0) for j in (0, 1)])

    # same broadcasts, same order as the sender: packed region, then each big tensor in plan order
    def post(i):
        _, packed, entries = plan[i]
        buf = bufs[i % 2]
        big = [buf[off:off + torch.Size(s).numel() * d.itemsize]
               for _, s, d, off in entries if off >= packed]
        return [tdist.broadcast(t, src=src, group=group, async_op=True)
                for t in ([buf[:packed]] if packed else []) + big]

    works = post(0)
    for i, (_, _, entries) in enumerate(plan):
        for w in works:
            w.wait()
        if i + 1 < len(plan):
            works = post(i + 1)
        for name, shape, dtype, off in entries:
            yield name, (bufs[i % 2][off:off + torch.Size(shape).numel() * dtype.itemsize]
                         .view(dtype).view(shape))


def broadcast_weights(model, group, roles, bucket_mb=256, receive=None) -> dict:
    """Trainers -> generators (see the module docstring). Every trainer rank and every generator
    calls it. On a generator, `receive` gets views that a later bucket overwrites: load or copy each
    before moving on.
    Returns {"sync/bytes", "sync/seconds", "sync/gbps"} (gbps = gigabytes per second)."""
    t0, src = time.perf_counter(), roles.trainer_ranks[0]
    if roles.colocated:  # in-process handover: each trainer rank feeds its own generator
        it, nbytes = full_params(model), sum(p.numel() * p.element_size()
                                             for _, p in _sync_order(model))
    elif roles.is_trainer and roles.rank != src:
        # full_tensor() is collective over the mesh: take part, send nothing
        it, nbytes, receive = full_params(model), 0, None
    else:
        if group not in _SYNC_PLANS:
            obj = [_bucket_plan(model, int(bucket_mb * (1 << 20)), _DIRECT_BYTES)
                   if roles.rank == src else None]
            tdist.broadcast_object_list(obj, src=src, group=group, device=torch.device("cpu"))
            _SYNC_PLANS[group] = obj[0]
        plan = _SYNC_PLANS[group]
        nbytes = sum(b[0] for b in plan)
        if roles.rank == src:
            _send_buckets(model, plan, group, src, roles.device)
            it, receive = iter(()), None
        else:
            it = _recv_buckets(plan, group, src, roles.device)
    if receive is not None:
        receive(it)
    # drain: a receiver that stopped early must not leave the other ranks inside a collective
    for _ in it:
        pass
    seconds = time.perf_counter() - t0
    return {"sync/bytes": nbytes, "sync/seconds": seconds,
            "sync/gbps": nbytes / max(seconds, 1e-9) / 1e9}


def _key(version):
    # a torchrun restart (--max-restarts) keeps the store: its keys name the attempt
    return f"nanoforge/inflight/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{version}"


def announce(roles, version):
    """Trainer rank 0, before the broadcast of weight version `version` in flight: tell every
    generator rank, which takes it at its next token boundary (Announced). Other ranks: nothing."""
    if roles.rank == roles.trainer_ranks[0]:
        dist.default_store().set(_key(version), "1")


class Announced:
    """A generator rank's side of `announce`: a key in the rendezvous store, checked without
    waiting (a posted gloo receive cannot be: its is_completed() stays False until wait())."""

    def __init__(self, version, timeout_s):
        self.key, self.timeout, self.polls = _key(version), datetime.timedelta(seconds=timeout_s), 0

    def arrived(self, wait=False) -> bool:
        """Has the announcement come? wait: block until it does (within dist.timeout_s). Test hook:
        with inflight_at@N in $NANOFORGE_FAULT the N-th check waits, so the update lands exactly
        there (tests/test_train_grpo.py)."""
        self.polls += 1
        if wait or dist.fault("inflight_at", self.polls):
            dist.default_store().wait([self.key], self.timeout)
            return True
        return dist.default_store().check([self.key])
