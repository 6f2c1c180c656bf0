"""torch.distributed for nanoforge: rank roles, process groups, the trainer mesh (FSDP2 + tensor
parallel), and what a failed collective means. CPU runs gloo, GPU runs NCCL: one code path. The
weight sync to the generator ranks is weight_sync.py's; checkpoints and the Hugging Face export are
checkpoint.py's.

Rank roles. `torchrun --nproc_per_node=N train_grpo.py ...` with `generator_ranks=G`: the last G
ranks each run one vLLM engine, the first N - G train on a (dp_shard, tp) device mesh. G = 0 is
"colocated": every trainer rank hosts its own generator and weights are handed over in-process (the
single-GPU and CPU mode).

    rank       0 ........... N-G-1 | N-G ........ N-1
    role       trainers (dp_shard x tp mesh) | generators (one vLLM engine each)
    sync       rank 0 --- broadcast buckets ---> every generator     (group {0} + generators)

Devices and environment (rank_env, applied by get_roles before anything touches CUDA). A rank that
hosts a vLLM engine (every generator rank; every rank when colocated with vLLM) gets
CUDA_VISIBLE_DEVICES = its LOCAL_RANK-th visible GPU, so the engine, its NCCL groups and ours all
run on that rank's cuda:0. Why: an in-process engine takes cuda:0 whatever torch.cuda.set_device
said (vLLM 0.32: v1/executor/uniproc_executor.py UniProcExecutor._distributed_args reads the index
from device_config.device, which config/device.py DeviceConfig.__post_init__ strips;
v1/worker/gpu_worker.py Worker.init_device then sets that device). Why not 0.32's device_ids
argument (engine/arg_utils.py EngineArgs._resolve_device_ids) or an executor subclass: hiding the
other GPUs keeps every library in that process (CUDA graphs, Triton, NCCL, memory profiling) off
them. Trainers stay on cuda:LOCAL_RANK, so no two ranks share a GPU as long as a node has a GPU per
local rank (check_gpu_layout, called by checks.grpo). NCCL variables are set the same on every rank
before init_process_group: 0.32's Worker.init_device pops NCCL_ASYNC_ERROR_HANDLING on its ranks
only, and other vLLM releases set NCCL_CUMEM_ENABLE=0 on import
(docs/gpu.md#what-vllms-source-says-about-gpus; 0.32's env_override.py does not, it sets
PYTORCH_NVML_BASED_CUDA_CHECK=1, which keeps torch.cuda.is_available() from initialising CUDA).
Ranks whose NCCL settings differ can hang or fail in their first broadcast.

Start order. vLLM's in-process engine creates its own private 1-rank default process group; if the
world group already exists it adopts it instead and makes its internal `new_group` calls on it,
which are collective over the whole world, and the trainer ranks never make them: a deadlock. So a
generator rank builds its engine first, releases that private group
(generator.VLLMGenerator.release_default_group()), and only then calls init_distributed(). Trainer
ranks simply wait in init_process_group until the generators arrive.

Collective order. `new_group` is collective over the world, so EVERY rank calls trainer_mesh() and
weight_sync.sync_group(), in that order (generators get None from trainer_mesh). All groups get the
same timeout, so a lost peer surfaces as an error within `timeout_s` instead of a hang (and
torchrun's agent kills the survivors as soon as any worker dies).

Mesh. Trainer rank r sits at (r // tp, r % tp): TP neighbours are adjacent ranks (same node). TP
first (torchtitan's plan: q/k/v/gate/up split by output columns, o/down by input rows, so one
all-reduce per attention and per MLP; model.py infers its head count from the weights, so a TP shard
just has fewer heads), then FSDP2 `fully_shard` per block and on the root over the dp_shard
dimension.

Fault injection (tests/test_faults.py): NANOFORGE_FAULT="kill_opt@3,nan@5" names faults to inject at
a point of a step (see fault()); unset in normal runs, where it costs one dict lookup per point.

Left out: pipeline/context parallelism, HSDP (replicated dp), vLLM engines spanning several ranks.
"""
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
# keeps parameter names (no wrapper)
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import machine

_TIMEOUT = timedelta(minutes=10)  # set by init_distributed; every group we create uses it
_TRAINER_GROUP = None             # the trainer ranks (checkpoint.py); set by trainer_mesh


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


# default per rank (None: unset); see above
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_ASYNC_ERROR_HANDLING": None}


def rank_env(hosts_engine: bool, local_rank: int, environ) -> dict:
    """The environment changes for this rank ({name: value, or None to unset}), a pure function
    (module docstring)."""
    env = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    # a value set for the whole job wins: torchrun gives every rank the same
    for name, default in NCCL_ENV.items():
        env[name] = environ.get(name, default) if default is not None else None
    if hosts_engine:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(local_rank + 1)]
        if local_rank >= len(ids):
            raise ValueError(f"LOCAL_RANK={local_rank} but CUDA_VISIBLE_DEVICES={visible!r} lists "
                             f"{len(ids)} GPU(s)")
        env["CUDA_VISIBLE_DEVICES"] = ids[local_rank].strip()
    return env


def check_gpu_layout(local_world_size: int, num_gpus: int) -> None:
    """Rank r of a node uses its visible GPU number LOCAL_RANK: more ranks than GPUs would put two
    ranks (a trainer and an engine, or two engines) on one GPU. num_gpus = 0 (no CUDA) is always
    fine."""
    if num_gpus and local_world_size > num_gpus:
        raise ValueError(f"{local_world_size} ranks per node but {num_gpus} visible GPU(s): every "
                         f"rank needs a GPU of its own (torchrun --nproc_per_node <= {num_gpus})")


def get_roles(generator_ranks: int, colocated_engine: bool = False) -> Roles:
    """Roles from torchrun's RANK/WORLD_SIZE/LOCAL_RANK (plain `python` is a world of 1); applies
    rank_env and this process's thread budget (machine.set_threads) first.
    colocated_engine: with no generator ranks, every rank hosts a vLLM engine (a torch generator
    needs no pinning)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if not 0 <= generator_ranks < world:
        raise ValueError(f"generator_ranks={generator_ranks} must be >= 0 and < world_size={world} "
                         f"(at least one trainer rank is needed; use torchrun --nproc_per_node)")
    trainers, generators = (list(range(world - generator_ranks)),
                            list(range(world - generator_ranks, world)))
    hosts_engine = rank in generators or (colocated_engine and not generators)
    env = rank_env(hosts_engine, local_rank, os.environ)
    # NOTE: catches torch's CUDA init only; a bare cuInit (torch.cuda.is_available() without the
    # NVML check) would also fix the visible GPUs. Before this call, only torch.cuda.device_count()
    # (NVML) may ask about CUDA.
    if (torch.cuda.is_initialized()
            and env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
                != os.environ.get("CUDA_VISIBLE_DEVICES")):
        raise RuntimeError(
            "CUDA was initialised before dist.get_roles(): too late to pin this rank's GPU")
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    # this process's share of the cores (torch's threads, and a CPU vLLM engine's)
    machine.set_threads(rank)
    index = 0 if hosts_engine else local_rank  # an engine rank sees only its own GPU
    device = torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Roles(rank, world, local_rank, trainers, generators, rank in trainers,
                 rank in generators, not generators, device)


def init_distributed(roles: Roles, timeout_s: float = 600) -> None:
    """Join the torchrun world. On a generator rank: only after the vLLM engine exists and released
    its group."""
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
    dist.init_process_group(backend, rank=roles.rank, world_size=roles.world_size,
                            timeout=_TIMEOUT, **kw)


def agree(name: str, value) -> None:
    """Every rank of the world holds the same `value` of a setting it resolved on its own
    (model.dtype = "auto" measures per rank): else all of them stop with the values each rank chose,
    instead of a collective that hangs."""
    if dist.get_world_size() == 1:
        return
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(map(repr, values))) > 1:
        raise RuntimeError(
            f"the ranks resolved {name} differently: {values} (by rank); set it explicitly")


def new_group(ranks):
    """Collective over the world: every rank calls it with the same ranks, members get the group,
    others None."""
    group = dist.new_group(ranks, timeout=_TIMEOUT)
    return group if dist.get_rank() in ranks else None


def trainer_mesh(roles: Roles, dp_shard: int, tp: int) -> DeviceMesh | None:
    """A (dp_shard, tp) mesh over the trainer ranks; every rank must call this (generators get
    None)."""
    global _TRAINER_GROUP
    n = len(roles.trainer_ranks)
    if dp_shard * tp != n:
        raise ValueError(f"dp_shard * tp = {dp_shard} * {tp} = {dp_shard * tp} must equal the "
                         f"number of trainer ranks {n} (= world_size "
                         f"{roles.world_size} - generator_ranks {len(roles.generator_ranks)})")
    grid = torch.tensor(roles.trainer_ranks).view(dp_shard, tp)
    _TRAINER_GROUP = new_group(roles.trainer_ranks)
    # ranks that hold the same TP shard
    dp_groups = [new_group(grid[:, j].tolist()) for j in range(tp)]
    tp_groups = [new_group(grid[i].tolist()) for i in range(dp_shard)]  # ranks that split one layer
    if not roles.is_trainer:
        return None
    dp_group = next(g for g in dp_groups if g is not None)
    tp_group = next(g for g in tp_groups if g is not None)
    return DeviceMesh.from_group([dp_group, tp_group], roles.device.type, mesh=grid,
                                 mesh_dim_names=("dp_shard", "tp"))


# Per transformer block, relative to model.model.layers[i] (torchtitan style). Colwise splits the
# output features (whole heads / MLP channels per rank), rowwise splits the input features and
# all-reduces the output.
TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def compile_block(block):
    """torch.compile the block through torch's own nn.Module.compile: its calls run compiled, its
    code and parameter names unchanged, FSDP2's hooks eager (dynamo skips them). The torch generator
    decodes eagerly (torch.compiler.set_stance "force_eager" in TorchGenerator.generate)."""
    block.compile()


def shard_model(model, mesh, *, param_dtype=None, reduce_dtype=torch.float32,
                activation_checkpointing=False, compile=False):
    """TP (when mesh["tp"] > 1), then FSDP2 per block and on the root. In place; returns the model.
    param_dtype: compute dtype of the gathered params (bf16 on GPU; None = keep the stored fp32 on
    CPU); the sharded master weights, grads and optimizer state stay in the stored dtype,
    reduce_dtype is the grad reduction.
    compile: each block compiled (compile_block), as TorchTitan does; docs/gpu.md measured it (1.5B
    update 2.46 -> 1.23 s on one H200) when it swapped block.forward instead."""
    cfg, tp = model.cfg, mesh["tp"].size()
    if tp > 1:
        if (cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp
                or cfg.intermediate_size % tp):
            raise ValueError(f"tp={tp} must divide num_attention_heads={cfg.num_attention_heads}, "
                             f"num_key_value_heads={cfg.num_key_value_heads} and "
                             f"intermediate_size={cfg.intermediate_size}")
        for block in model.model.layers:
            parallelize_module(block, mesh["tp"], TP_PLAN)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.model.layers:
        if compile:
            compile_block(block)
        if activation_checkpointing:
            checkpoint_activations(block)  # recompute the block in backward: store only its input
        fully_shard(block, mesh=mesh["dp_shard"], mp_policy=mp)
    # embed, final norm, lm_head (one group: tie survives)
    fully_shard(model, mesh=mesh["dp_shard"], mp_policy=mp)
    if cfg.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError(
            "sharding broke the tie between lm_head.weight and model.embed_tokens.weight")
    return model


def clip_grad_norm_(model, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a sharded model. With TP the grads live on two meshes (2-D
    for the split linears, 1-D dp_shard for the rest) and torch's version stacks them all into one
    tensor, which DTensor refuses: take one norm per (mesh, placements) group, then combine. Returns
    the total norm before clipping."""
    groups = {}  # (mesh, placements) -> parameters whose grads are laid out that way
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad
            groups.setdefault((g.device_mesh, g.placements) if isinstance(g, DTensor) else None,
                              []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in params]) for params in groups.values()]
    # sums the shards' squares
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def trainer_group():
    """The process group of the trainer ranks (checkpoint.py saves over it); None before
    trainer_mesh()."""
    return _TRAINER_GROUP


def fault(point: str, step: int) -> bool:
    """Test hook: is `point@step` listed in $NANOFORGE_FAULT? A kill_* point SIGKILLs this process
    right here (no handler, no cleanup: what kill -9 or a lost node does), after printing the time
    so a test can measure detection."""
    if f"{point}@{step}" not in os.environ.get("NANOFORGE_FAULT", "").split(","):
        return False
    if point.startswith("kill"):
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"NANOFORGE_FAULT {point}@{step}: SIGKILL rank {rank} at t={time.time():.3f}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def fault_nan(loss, step):
    """Test hook: the loss times NaN when nan@step is listed in $NANOFORGE_FAULT (what a bad batch
    does)."""
    return loss * float("nan") if fault("nan", step) else loss


def default_store():
    """The rendezvous store every rank already shares (torchrun's; it lives in the agent, so it
    outlives a dead worker). NOTE: _get_default_store is private, but the only handle on it."""
    return dist.distributed_c10d._get_default_store()


def explain_failure(e: BaseException, wait_s: float = 3.0) -> str | None:
    """For an exception out of a collective (gloo/NCCL): which ranks are lost? The survivors check
    in at the rendezvous store (it lives in torchrun's agent, so it outlives a dead worker), wait
    `wait_s`, and name the ranks that never did (dead, or stuck elsewhere). None for any other
    exception. torchrun's agent kills the other local workers as soon as one dies; this is for the
    ranks on other nodes, whose agents only see the error."""
    text = f"{type(e).__name__}: {e}"
    if not dist.is_initialized() or not (isinstance(e, dist.DistError) or "gloo" in text
                                         or "NCCL" in text):
        return None
    rank, first_line = dist.get_rank(), text.splitlines()[0][:300]
    try:
        store = default_store()
        store.add(f"nanoforge/checkin/{rank}", 1)
        time.sleep(wait_s)
        lost = [r for r in range(dist.get_world_size())
                if not store.check([f"nanoforge/checkin/{r}"])]
        who = (f"lost rank(s) {lost} (no check-in within {wait_s:.0f} s: dead or stuck)" if lost
               else "every rank checked in: a collective failed without a lost rank")
    except Exception as store_err:
        who = (f"the rendezvous store is unreachable too ({type(store_err).__name__}): the node "
               "hosting it is lost")
    return f"rank {rank}: a collective failed ({first_line}); {who}"


def shutdown():
    """Orderly teardown: wait for everyone, then destroy the groups (a rank leaving early can abort
    the others)."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        # on timeout, names the ranks that never arrived
        dist.monitored_barrier(wait_all_ranks=True)
    else:
        dist.barrier()
    dist.destroy_process_group()
