"""torch.distributed for nanoforge: rank roles, the trainer mesh (FSDP2 + tensor parallel), weight sync to the
generator ranks, atomic distributed checkpoints, Hugging Face export. CPU runs gloo, GPU runs NCCL: one code path.

Rank roles. `torchrun --nproc_per_node=N train_grpo.py ...` with `generator_ranks=G`: the last G ranks each run one
vLLM engine, the first N - G train on a (dp_shard, tp) device mesh. G = 0 is "colocated": every trainer rank hosts
its own generator and weights are handed over in-process (the single-GPU and CPU mode).

    rank       0 ........... N-G-1 | N-G ........ N-1
    role       trainers (dp_shard x tp mesh) | generators (one vLLM engine each)
    sync       rank 0 --- broadcast buckets ---> every generator     (group {0} + generators)

Devices and environment (rank_env, applied by get_roles before anything touches CUDA). A rank that hosts a vLLM
engine (every generator rank; every rank when colocated with vLLM) gets CUDA_VISIBLE_DEVICES = its LOCAL_RANK-th
visible GPU, so the engine, its NCCL groups and ours all run on that rank's cuda:0. Why: an in-process engine takes
cuda:0 whatever torch.cuda.set_device said (vLLM 0.32: v1/executor/uniproc_executor.py
UniProcExecutor._distributed_args reads the index from device_config.device, which config/device.py
DeviceConfig.__post_init__ strips; v1/worker/gpu_worker.py Worker.init_device then sets that device). Why not 0.32's
device_ids argument (engine/arg_utils.py EngineArgs._resolve_device_ids) or an executor subclass: hiding the other
GPUs keeps every library in that process (CUDA graphs, Triton, NCCL, memory profiling) off them. Trainers stay on
cuda:LOCAL_RANK, so no two ranks share a GPU as long as a node has a GPU per local rank (check_gpu_layout, called by
validate()). NCCL variables are set the same on every rank before init_process_group: 0.32's Worker.init_device pops
NCCL_ASYNC_ERROR_HANDLING on its ranks only, and other vLLM releases set NCCL_CUMEM_ENABLE=0 on import
(../shared/notes/vllm-gpu.md; 0.32's env_override.py does not, it sets PYTORCH_NVML_BASED_CUDA_CHECK=1, which keeps
torch.cuda.is_available() from initialising CUDA). Ranks whose NCCL settings differ can hang or fail in their first
broadcast.

Start order. vLLM's in-process engine creates its own private 1-rank default process group; if the world group
already exists it adopts it instead and makes its internal `new_group` calls on it, which are collective over the
whole world, and the trainer ranks never make them: a deadlock. So a generator rank builds its engine first,
releases that private group (generator.VLLMGenerator.release_default_group()), and only then calls
init_distributed(). Trainer ranks simply wait in init_process_group until the generators arrive.

Collective order. `new_group` is collective over the world, so EVERY rank calls trainer_mesh() and sync_group(), in
that order (generators get None from trainer_mesh). All groups get the same timeout, so a lost peer surfaces as an
error within `timeout_s` instead of a hang (and torchrun's agent kills the survivors as soon as any worker dies).

Mesh. Trainer rank r sits at (r // tp, r % tp): TP neighbours are adjacent ranks (same node). TP first (torchtitan's
plan: q/k/v/gate/up split by output columns, o/down by input rows, so one all-reduce per attention and per MLP;
model.py infers its head count from the weights, so a TP shard just has fewer heads), then FSDP2 `fully_shard` per
block and on the root over the dp_shard dimension.

Weight sync. Trainers materialise one full tensor at a time (DTensor.full_tensor(), collective over the trainer
mesh); trainer rank 0 broadcasts them in ~bucket_mb buckets: small tensors packed into a reused buffer (one broadcast
per bucket), big ones straight from their own memory. Names, shapes, dtypes and offsets cross the wire once (cached).
Generators receive into two reused buffers (a fresh one page-faults on every byte, every sync), bucket i+1 while
`receive` consumes the zero-copy views (name, tensor) of bucket i. That reuse is safe because buckets hold whole
decoder blocks: vLLM's reload keeps a layer's views (q, k, v of qkv_proj) until the whole layer has arrived, and a
layer lies in one block. Embedding, final norm and lm_head go last, together: vLLM defers a padded embedding
(vocabulary not a multiple of 64) to the end of the load. Parameter names are HF names, a tied lm_head goes once as
model.embed_tokens.weight (vLLM re-ties it on load).

Checkpoints. torch.distributed.checkpoint writes every rank's shards in parallel and reshards on load (another mesh
may resume). A save goes to step_N.tmp, is renamed to step_N, and a COMPLETE marker is written last: a crash at any
point leaves nothing that latest_checkpoint() would pick up. A write that fails on any rank (disk full, no permission)
is agreed on by all trainer ranks, reported, and cleaned up; the previous checkpoint stays the newest complete one.

Fault injection (tests/test_faults.py): NANOFORGE_FAULT="kill_opt@3,nan@5" names faults to inject at a point of a
step (see fault()); unset in normal runs, where it costs one dict lookup per point.

Left out: pipeline/context parallelism, HSDP (replicated dp), vLLM engines spanning several ranks, async checkpoints.
"""
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name
from torch.distributed._composable import checkpoint as checkpoint_activations  # keeps parameter names (no wrapper)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

_TIMEOUT = timedelta(minutes=10)  # set by init_distributed; every group we create uses it
_TRAINER_GROUP = None             # the trainer ranks (checkpoints); set by trainer_mesh
_SYNC_PLANS = {}                  # sync group -> bucket plan, so metadata crosses the wire once
_DIRECT_BYTES = 1 << 20           # weight sync: tensors this big are broadcast from their own memory, not packed
_SYNC_BUFS = {}                   # (group, device) -> two reused bucket buffers (sender or receiver)


@dataclass
class Roles:
    rank: int
    world_size: int
    local_rank: int
    trainer_ranks: list[int]
    generator_ranks: list[int]
    is_trainer: bool
    is_generator: bool
    colocated: bool  # no generator ranks: each trainer rank hosts its own generator
    device: torch.device


NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_ASYNC_ERROR_HANDLING": None}  # default per rank (None: unset); see above


def rank_env(hosts_engine: bool, local_rank: int, environ) -> dict:
    """The environment changes for this rank ({name: value, or None to unset}), a pure function (module docstring)."""
    env = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    for name, default in NCCL_ENV.items():  # a value set for the whole job wins: torchrun gives every rank the same
        env[name] = environ.get(name, default) if default is not None else None
    if hosts_engine:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(local_rank + 1)]
        if local_rank >= len(ids):
            raise ValueError(f"LOCAL_RANK={local_rank} but CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)} GPU(s)")
        env["CUDA_VISIBLE_DEVICES"] = ids[local_rank].strip()
    return env


def check_gpu_layout(local_world_size: int, num_gpus: int) -> None:
    """Rank r of a node uses its visible GPU number LOCAL_RANK: more ranks than GPUs would put two ranks (a trainer and
    an engine, or two engines) on one GPU. num_gpus = 0 (no CUDA) is always fine."""
    if num_gpus and local_world_size > num_gpus:
        raise ValueError(f"{local_world_size} ranks per node but {num_gpus} visible GPU(s): every rank needs a GPU "
                         f"of its own (torchrun --nproc_per_node <= {num_gpus})")


def get_roles(generator_ranks: int, colocated_engine: bool = False) -> Roles:
    """Roles from torchrun's RANK/WORLD_SIZE/LOCAL_RANK (plain `python` is a world of 1); applies rank_env first.
    colocated_engine: with no generator ranks, every rank hosts a vLLM engine (a torch generator needs no pinning)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if not 0 <= generator_ranks < world:
        raise ValueError(f"generator_ranks={generator_ranks} must be >= 0 and < world_size={world} "
                         f"(at least one trainer rank is needed; use torchrun --nproc_per_node)")
    trainers, generators = list(range(world - generator_ranks)), list(range(world - generator_ranks, world))
    hosts_engine = rank in generators or (colocated_engine and not generators)
    env = rank_env(hosts_engine, local_rank, os.environ)
    # NOTE: catches torch's CUDA init only; a bare cuInit (torch.cuda.is_available() without the NVML check) would
    # also fix the visible GPUs. Before this call, only torch.cuda.device_count() (NVML) may ask about CUDA.
    if torch.cuda.is_initialized() and env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES")) \
            != os.environ.get("CUDA_VISIBLE_DEVICES"):
        raise RuntimeError("CUDA was initialised before dist.get_roles(): too late to pin this rank's GPU")
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    index = 0 if hosts_engine else local_rank  # an engine rank sees only its own GPU
    device = torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Roles(rank, world, local_rank, trainers, generators, rank in trainers, rank in generators,
                 not generators, device)


def init_distributed(roles: Roles, timeout_s: float = 600) -> None:
    """Join the torchrun world. On a generator rank: only after the vLLM engine exists and released its group."""
    global _TIMEOUT
    _TIMEOUT = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; on a generator rank call "
                           "VLLMGenerator.release_default_group() before init_distributed()")
    kw = {}
    if "MASTER_ADDR" not in os.environ:  # plain python: a world of one needs no rendezvous
        kw["store"] = dist.HashStore()
    if roles.device.type == "cuda":
        kw["device_id"] = roles.device
    backend = "cpu:gloo,cuda:nccl" if roles.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=roles.rank, world_size=roles.world_size, timeout=_TIMEOUT, **kw)


def _new_group(ranks):
    """Collective over the world: every rank calls it with the same ranks, members get the group, others None."""
    group = dist.new_group(ranks, timeout=_TIMEOUT)
    return group if dist.get_rank() in ranks else None


def trainer_mesh(roles: Roles, dp_shard: int, tp: int) -> DeviceMesh | None:
    """A (dp_shard, tp) mesh over the trainer ranks; every rank must call this (generators get None)."""
    global _TRAINER_GROUP
    n = len(roles.trainer_ranks)
    if dp_shard * tp != n:
        raise ValueError(f"dp_shard * tp = {dp_shard} * {tp} = {dp_shard * tp} must equal the number of trainer "
                         f"ranks {n} (= world_size {roles.world_size} - generator_ranks {len(roles.generator_ranks)})")
    grid = torch.tensor(roles.trainer_ranks).view(dp_shard, tp)
    _TRAINER_GROUP = _new_group(roles.trainer_ranks)
    dp_groups = [_new_group(grid[:, j].tolist()) for j in range(tp)]     # ranks that hold the same TP shard
    tp_groups = [_new_group(grid[i].tolist()) for i in range(dp_shard)]  # ranks that split one layer
    if not roles.is_trainer:
        return None
    dp_group = next(g for g in dp_groups if g is not None)
    tp_group = next(g for g in tp_groups if g is not None)
    return DeviceMesh.from_group([dp_group, tp_group], roles.device.type, mesh=grid,
                                 mesh_dim_names=("dp_shard", "tp"))


# Per transformer block, relative to model.model.layers[i] (torchtitan style). Colwise splits the output features
# (whole heads / MLP channels per rank), rowwise splits the input features and all-reduces the output.
TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def shard_model(model, mesh, *, param_dtype=None, reduce_dtype=torch.float32, activation_checkpointing=False):
    """TP (when mesh["tp"] > 1), then FSDP2 per block and on the root. In place; returns the model.
    param_dtype: compute dtype of the gathered params (bf16 on GPU; None = keep the stored fp32 on CPU); the
    sharded master weights, grads and optimizer state stay in the stored dtype, reduce_dtype is the grad reduction."""
    cfg, tp = model.cfg, mesh["tp"].size()
    if tp > 1:
        if cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp or cfg.intermediate_size % tp:
            raise ValueError(f"tp={tp} must divide num_attention_heads ({cfg.num_attention_heads}), "
                             f"num_key_value_heads ({cfg.num_key_value_heads}) and intermediate_size "
                             f"({cfg.intermediate_size})")
        for block in model.model.layers:
            parallelize_module(block, mesh["tp"], TP_PLAN)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.model.layers:
        if activation_checkpointing:
            checkpoint_activations(block)  # recompute the block in backward: store only its input
        fully_shard(block, mesh=mesh["dp_shard"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp_shard"], mp_policy=mp)  # embed, final norm, lm_head (one group: tie survives)
    if cfg.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("sharding broke the tie between lm_head.weight and model.embed_tokens.weight")
    return model


def clip_grad_norm_(model, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a sharded model. With TP the grads live on two meshes (2-D for the split
    linears, 1-D dp_shard for the rest) and torch's version stacks them all into one tensor, which DTensor refuses:
    take one norm per (mesh, placements) group, then combine. Returns the total norm before clipping."""
    groups = {}  # (mesh, placements) -> parameters whose grads are laid out that way
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad
            groups.setdefault((g.device_mesh, g.placements) if isinstance(g, DTensor) else None, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in params]) for params in groups.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]  # sums the shards' squares
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def sync_group(roles: Roles):
    """{trainer rank 0} + generator ranks; every rank must call this. None when colocated and on other trainers."""
    if roles.colocated:
        return None
    return _new_group([roles.trainer_ranks[0], *roles.generator_ranks])


def _sync_order(model):
    """named_parameters() (a tied lm_head once, as embed_tokens), decoder blocks first, then the rest (see above)."""
    return sorted(model.named_parameters(), key=lambda kv: not kv[0].startswith("model.layers."))


@torch.no_grad()  # on a generator: only while it runs. DTensor ops outside autograd cost ~15x less per parameter
def _full_params(model):
    """(hf_name, full tensor), one at a time, in _sync_order. Collective over the trainer mesh for DTensors."""
    for name, p in _sync_order(model):
        if isinstance(p, DTensor):  # on a 1-rank mesh the local shard is whole: skip full_tensor()'s copy
            p = p.to_local() if p.device_mesh.size() == 1 else p.full_tensor()
        yield name, p.detach()


def _bucket_plan(model, bucket_bytes, direct_bytes):
    """[(bucket_nbytes, packed_nbytes, [(name, shape, dtype, byte_offset), ...]), ...] in _sync_order. A bucket
    holds whole units (a decoder block "model.layers.N."; all the rest is one last unit; why: module docstring), one
    unit bigger than bucket_bytes alone. Tensors under direct_bytes are packed at [0, packed_nbytes), the big ones
    follow; every offset is 64-byte aligned, so any dtype view is valid."""
    units, groups, plan, pad = {}, [[]], [], lambda n: -(-n // 64) * 64  # noqa: E731
    for name, p in _sync_order(model):
        key = name[:name.index(".", 13) + 1] if name.startswith("model.layers.") else "rest"
        units.setdefault(key, []).append((name, tuple(p.shape), p.dtype, p.numel() * p.element_size()))
    for unit in units.values():
        if groups[-1] and sum(pad(e[3]) for e in groups[-1] + unit) > bucket_bytes:
            groups.append([])
        groups[-1] += unit
    for group in groups:
        offsets, off = {}, 0
        for name, *_, n in sorted(group, key=lambda e: e[3] >= direct_bytes):  # stable: packed first, then big
            offsets[name], off = off, off + pad(n)
        packed = sum(pad(n) for *_, n in group if n < direct_bytes)
        plan.append((off, packed, [(name, shape, dtype, offsets[name]) for name, shape, dtype, _ in group]))
    return plan


def _bufs(group, device, caps):
    """Two uint8 buffers, reused bucket after bucket. On CPU also kept from sync to sync (a fresh allocation pays a
    page fault per 4 KiB, every sync); on a GPU the caching allocator makes a fresh pair cheap, and the memory (about
    the embedding plus a bucket: ~5 GB for a 7B model in fp32) goes back to the pool between syncs."""
    if torch.device(device).type != "cpu":
        return [torch.empty(c, dtype=torch.uint8, device=device) for c in caps]
    bufs = _SYNC_BUFS.get((id(group), str(device)))
    if bufs is None or [b.numel() for b in bufs] != caps:
        bufs = _SYNC_BUFS[(id(group), str(device))] = [torch.empty(c, dtype=torch.uint8, device=device) for c in caps]
    return bufs


def _send_buckets(model, plan, group, src, device):
    """Per bucket one broadcast of the packed tensors, then one per big tensor from its own memory, all async:
    bucket i is packed while i-1 is on the wire, after waiting for i-2 (its buffer, its tensors): two in flight."""
    params = _full_params(model)
    bufs = _bufs(group, device, [max([b[1] for b in plan[j::2]], default=0) for j in (0, 1)])
    works = [[], []]
    for i, (_, packed, entries) in enumerate(plan):
        for w in works[i % 2]:
            w.wait()
        buf, direct = bufs[i % 2], []
        for name, shape, dtype, off in entries:
            pname, t = next(params)
            if pname != name or tuple(t.shape) != shape or t.dtype != dtype:
                raise RuntimeError(f"model changed since the first sync: {pname} vs cached {name}")
            t = t.reshape(-1).view(torch.uint8)
            if off < packed:
                buf[off:off + t.numel()].copy_(t)
            else:
                direct.append(t)
        works[i % 2] = [dist.broadcast(t, src=src, group=group, async_op=True)
                        for t in ([buf[:packed]] if packed else []) + direct]
    for w in works[0] + works[1]:
        w.wait()


def _recv_buckets(plan, group, src, device):
    """(name, tensor) views into bufs[i % 2] for bucket i. Bucket i+1 arrives over bucket i-1 while the caller consumes
    bucket i: it must hold no view of bucket i-1 once it asks for bucket i (vLLM: see the module docstring)."""
    bufs = _bufs(group, device, [max([b[0] for b in plan[j::2]], default=0) for j in (0, 1)])

    def post(i):  # same broadcasts, same order as the sender: packed region, then each big tensor in plan order
        _, packed, entries = plan[i]
        buf = bufs[i % 2]
        big = [buf[off:off + torch.Size(s).numel() * d.itemsize] for _, s, d, off in entries if off >= packed]
        return [dist.broadcast(t, src=src, group=group, async_op=True)
                for t in ([buf[:packed]] if packed else []) + big]

    works = post(0)
    for i, (_, _, entries) in enumerate(plan):
        for w in works:
            w.wait()
        if i + 1 < len(plan):
            works = post(i + 1)
        for name, shape, dtype, off in entries:
            yield name, bufs[i % 2][off:off + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)


def broadcast_weights(model, group, roles: Roles, bucket_mb=256, receive=None) -> dict:
    """Trainers -> generators (see the module docstring). Every trainer rank and every generator calls it. On a
    generator, `receive` gets views that a later bucket overwrites: load or copy each before moving on.
    Returns {"sync/bytes", "sync/seconds", "sync/gbps"} (gbps = gigabytes per second)."""
    t0, src = time.perf_counter(), roles.trainer_ranks[0]
    if roles.colocated:  # in-process handover: each trainer rank feeds its own generator
        it, nbytes = _full_params(model), sum(p.numel() * p.element_size() for p in model.parameters())
    elif roles.is_trainer and roles.rank != src:  # full_tensor() is collective over the mesh: take part, send nothing
        it, nbytes, receive = _full_params(model), 0, None
    else:
        if group not in _SYNC_PLANS:
            obj = [_bucket_plan(model, int(bucket_mb * (1 << 20)), _DIRECT_BYTES) if roles.rank == src else None]
            dist.broadcast_object_list(obj, src=src, group=group, device=torch.device("cpu"))
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
    for _ in it:  # drain: a receiver that stopped early must not leave the other ranks inside a collective
        pass
    seconds = time.perf_counter() - t0
    return {"sync/bytes": nbytes, "sync/seconds": seconds, "sync/gbps": nbytes / max(seconds, 1e-9) / 1e9}


def _group_rank():
    return dist.get_rank(_TRAINER_GROUP) if _TRAINER_GROUP is not None else dist.get_rank()


def fault(point: str, step: int) -> bool:
    """Test hook: is `point@step` listed in $NANOFORGE_FAULT? A kill_* point SIGKILLs this process right here (no
    handler, no cleanup: what kill -9 or a lost node does), after printing the time so a test can measure detection."""
    if f"{point}@{step}" not in os.environ.get("NANOFORGE_FAULT", "").split(","):
        return False
    if point.startswith("kill"):
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"NANOFORGE_FAULT {point}@{step}: SIGKILL rank {rank} at t={time.time():.3f}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _all_ok(ok: bool) -> bool:
    """True on every trainer rank iff it is True on all of them (and a barrier): after a local failure every rank
    must take the same branch, or the others would wait forever in the next collective."""
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_TRAINER_GROUP)
    return flag.item() == 0.0


def save_checkpoint(ckpt_dir, step, model, optimizer, extra: dict) -> Path | None:
    """Model + optimizer (sharded, DCP) + this rank's `extra` into <ckpt_dir>/step_<step>/. Trainer ranks only.
    Returns the path, or None on every rank if any rank failed to write (reported on stderr; nothing partial is left,
    the previous checkpoint stays valid, the run can go on)."""
    ckpt_dir = Path(ckpt_dir)
    final, tmp, old = (ckpt_dir / f"step_{step}{suffix}" for suffix in ("", ".tmp", ".old"))
    rank, err = _group_rank(), None

    def attempt(fn):  # one local step, unless an earlier one failed; then every rank learns if any rank failed
        nonlocal err
        if err is None:
            try:
                fn()
            except (Exception, CheckpointException) as e:  # OSError, torch.save's RuntimeError, DCP's own
                err = e
        return _all_ok(err is None)

    def prepare():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    def write_shards():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, process_group=_TRAINER_GROUP)

    def write_extra():  # per rank: RNG states differ between ranks. Fault "enospc": a real ENOSPC from /dev/full
        torch.save(extra, "/dev/full" if fault("enospc", step) else tmp / f"extra_rank{rank}.pt")
        fault("kill_ckpt", step)  # every file written, no marker yet

    def commit():
        if rank == 0:
            if final.exists():  # re-saving a step (after a resume): the old copy goes only once the new one is in
                final.rename(old)
            tmp.rename(final)
            with open(final / "COMPLETE", "w") as f:  # written last: its presence means every file above is there
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(old, ignore_errors=True)

    # each attempt() ends in a collective with the same answer on every rank: all ranks stop at the same point
    if attempt(prepare) and attempt(write_shards) and attempt(write_extra) and attempt(commit):
        return final
    if err is not None:
        free = shutil.disk_usage(ckpt_dir).free / 2**20 if ckpt_dir.exists() else float("nan")
        print(f"WARNING: checkpoint {final} not saved (rank {rank}: {type(err).__name__}: {err}; {free:.0f} MiB free on "
              "that disk); the previous checkpoint stays the newest complete one", file=sys.stderr, flush=True)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "COMPLETE").exists():
            shutil.rmtree(final, ignore_errors=True)
            if old.exists():
                old.rename(final)
    _all_ok(True)
    return None


def latest_checkpoint(ckpt_dir) -> Path | None:
    """Newest step_<N> with a COMPLETE marker. Partial ones (a crash mid-save) are removed by rank 0.
    Call it at startup, not while a save is in flight."""
    ckpt_dir, best = Path(ckpt_dir), None
    if not ckpt_dir.is_dir():
        return None
    for p in ckpt_dir.glob("step_*"):
        n = p.name.removeprefix("step_")
        if p.is_dir() and n.isdigit() and (p / "COMPLETE").exists():
            best = max(best or (-1, p), (int(n), p))
        elif not dist.is_initialized() or dist.get_rank() == 0:
            print(f"removing partial checkpoint {p} (no COMPLETE marker)", file=sys.stderr, flush=True)
            shutil.rmtree(p, ignore_errors=True)
    return best and best[1]


def is_complete(path) -> bool:
    return Path(path, "COMPLETE").exists()


def load_checkpoint(path, model, optimizer) -> dict:
    """Restore model + optimizer in place (any mesh: DCP reshards); returns this rank's `extra`."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the target layout: our shards of every tensor
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=_TRAINER_GROUP)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = path / f"extra_rank{_group_rank()}.pt"
    if not extra.exists():  # resumed on more ranks than saved: fall back to rank 0's
        extra = path / "extra_rank0.pt"
    return torch.load(extra, weights_only=False)


def export_hf(model, path, tokenizer_dir=None):
    """Full weights as a Hugging Face checkpoint (collective on trainers; trainer rank 0 writes)."""
    import model as model_lib  # sibling file; imported here so dist.py does not depend on it otherwise
    rank = _group_rank() if dist.is_initialized() else 0
    full = {name: t.to("cpu", copy=True) for name, t in _full_params(model) if rank == 0}
    if rank == 0:
        with torch.device("meta"):  # no random init; to_empty() keeps a tied lm_head tied
            out = model_lib.Transformer(model.cfg)
        out = out.to_empty(device="cpu")
        if model.cfg.tie_word_embeddings:  # to_empty() gives each module its own tensor: re-tie
            out.lm_head.weight = out.model.embed_tokens.weight
        missing = out.load_state_dict(full, strict=False).missing_keys
        if set(missing) - {"lm_head.weight"} or (missing and not model.cfg.tie_word_embeddings):
            raise RuntimeError(f"export_hf: no full tensor for {missing}")
        out.name_or_path = getattr(model, "name_or_path", None)
        out.save_pretrained(path, tokenizer_dir=tokenizer_dir)
    if dist.is_initialized():
        dist.barrier(_TRAINER_GROUP)
    return Path(path)


def explain_failure(e: BaseException, wait_s: float = 3.0) -> str | None:
    """For an exception out of a collective (gloo/NCCL): which ranks are lost? The survivors check in at the
    rendezvous store (it lives in torchrun's agent, so it outlives a dead worker), wait `wait_s`, and name the ranks
    that never did (dead, or stuck elsewhere). None for any other exception. torchrun's agent kills the other local
    workers as soon as one dies; this is for the ranks on other nodes, whose agents only see the error."""
    text = f"{type(e).__name__}: {e}"
    if not dist.is_initialized() or not (isinstance(e, dist.DistError) or "gloo" in text or "NCCL" in text):
        return None
    rank, first_line = dist.get_rank(), text.splitlines()[0][:300]
    try:  # NOTE: _get_default_store is private, but the only handle on the store every rank already shares
        store = dist.distributed_c10d._get_default_store()
        store.add(f"nanoforge/checkin/{rank}", 1)
        time.sleep(wait_s)
        lost = [r for r in range(dist.get_world_size()) if not store.check([f"nanoforge/checkin/{r}"])]
        who = f"lost rank(s) {lost} (no check-in within {wait_s:.0f} s: dead or stuck)" if lost else \
            "every rank checked in: a collective failed without a lost rank"
    except Exception as store_err:
        who = f"the rendezvous store is unreachable too ({type(store_err).__name__}): the node hosting it is lost"
    return f"rank {rank}: a collective failed ({first_line}); {who}"


def shutdown():
    """Orderly teardown: wait for everyone, then destroy the groups (a rank leaving early can abort the others)."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(wait_all_ranks=True)  # on timeout, names the ranks that never arrived
    else:
        dist.barrier()
    dist.destroy_process_group()
