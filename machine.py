"""Know the machine: what a run's speed depends on, measured where it runs, and the choices that
follow from it.

bf16 is several times faster than fp32 on CPUs with hardware bf16 and hundreds of times slower on
AVX2-only ones, and OpenMP threads beyond a job's cores slow a decode step by an order of magnitude
(docs/machines.md#what-follows-for-the-code). So neither the compute dtype nor the thread count is a
constant in a config:

- `choose_dtype`: `model.dtype = "auto"` means bf16 on a GPU; on a CPU, bf16 only where
  `probe_dtype` (< 0.1 s at start-up) measures bf16 matmuls at least BF16_MIN_SPEEDUP times faster
  than fp32 at an update-like shape, else fp32. A pure function of the probe's figures, so the rule
  is tested apart from the timing.
- `thread_budget`: each process of a job takes an equal share of the cores it may use
  (`os.sched_getaffinity`, which `taskset` narrows), so the job's total never exceeds them: torch's
  intra-op threads, and the cores a vLLM CPU engine binds its OpenMP threads to
  (VLLM_CPU_OMP_THREADS_BIND). OMP_NUM_THREADS, where set, caps the share (torchrun sets 1 when it
  starts several ranks: `OMP_NUM_THREADS=<cores per rank> torchrun ...` lifts it). Reward workers
  run one thread each, while the trainer waits for their scores.
- `huge_pages`: torch's CPU allocator asks for 2 MB pages (THP_MEM_ALLOC_ENABLE), so the GBs of
  fresh buffers an update allocates are not faulted in 4 KB at a time (set when this module is
  imported; logged with the threads).
- `onednn_weights` / `linears_on`: a decode step multiplies a few rows by every weight, where
  F.linear runs far below the matmul rate on CPU; the same weights reordered once for oneDNN run
  faster there, in fp32 and in bf16 where oneDNN has bf16 kernels. The torch generator takes that
  path by changing how F.linear multiplies by those weights, never which code runs
  (OneDNNLinears; docs/performance.md#the-decode-step).
- `available_bytes`: the memory the OS can give now, which bounds what a CPU vLLM engine's KV cache
  may take.
- `roofline`: what every bench/ result records first (the figures its speeds are read against): CPU
  capability, cores and threads, memory read GB/s, fp32 and bf16 matmul GFLOP/s at the shapes asked
  for.
"""
import contextlib
import os
import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# bf16 costs train/generator agreement (0.037 nats per token vs 2e-6 in fp32): only for speed
BF16_MIN_SPEEDUP = 1.25


def cpu_model() -> dict:
    """The CPU's name and the matrix-unit flags torch's capability string does not tell apart
    ("AVX512" on boxes with and without AMX, whose bf16 matmuls differ 5x), from /proc/cpuinfo; {}
    where there is none."""
    with contextlib.suppress(OSError):
        first = open("/proc/cpuinfo").read().split("\n\n")[0]  # one processor's block
        lines = {k.strip(): v
                 for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
        flags = lines.get("flags", "").split()
        return {"cpu_model": lines.get("model name", "").strip(),
                "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                              if f in flags]}
    return {}


def info() -> dict:
    """What a run's numbers depend on besides its config: CPU kernel path (AVX2 and AVX-512 boxes
    round differently, and tiny-model RL amplifies it), the CPU, cores and threads, versions.
    Written beside config.json."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), **cpu_model(),
            "cores": len(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            **{k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
               if k in os.environ}}


def available_bytes() -> int:
    """Memory the OS can give now: MemAvailable (page cache it can drop included), else the free
    pages."""
    with contextlib.suppress(OSError, ValueError):
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _best_s(fn, repeats=3, budget_s=None):
    """The fastest of `repeats` timed calls after one warm-up (thread pool, oneDNN kernel
    selection), stopping early once `budget_s` is spent."""
    t0 = time.perf_counter()
    fn()
    best = time.perf_counter() - t0
    for _ in range(repeats):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        t1 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t1)
    return best


def matmul_gflops(dtype, m=2048, k=2048, n=2048, repeats=5, budget_s=None) -> float:
    """Best GFLOP/s of an (m, k) @ (k, n) matmul in `dtype` on this process's torch threads."""
    x, y = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    return 2 * m * k * n / _best_s(lambda: x @ y, repeats, budget_s) / 1e9


def read_gbps(mib=256, repeats=3) -> float:
    """Memory read bandwidth: a sum over `mib` MiB of fp32 (larger than any cache here)."""
    x = torch.ones(mib << 18)
    return (mib << 20) / _best_s(lambda: x.sum(), repeats) / 1e9


def probe_dtype(m=128, k=576, n=1536) -> dict:
    """fp32 and bf16 GFLOP/s at an update-like matmul (SmolLM2-135M's MLP at 128 tokens), in < 0.1 s
    on either box: a tiny bf16 matmul first, and the full shape only where that one was not already
    far slower than fp32. On one thread: the question is the kernels' path, and one thread is not
    thrown off by other work on the cores."""
    t0, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shape = (16, 256, 256)
        got = {str(dt)[6:]: matmul_gflops(dt, *shape, repeats=2)
               for dt in (torch.float32, torch.bfloat16)}
        # else no hardware bf16 path: the full shape takes ~0.3 s
        bf16_path = got["bfloat16"] >= got["float32"] / 4
        if bf16_path:
            shape = (m, k, n)
            got = {str(dt)[6:]: matmul_gflops(dt, *shape, repeats=3, budget_s=0.03)
                   for dt in (torch.float32, torch.bfloat16)}
    finally:
        torch.set_num_threads(threads)
    return {**got, "bf16_path": bf16_path, "shape": shape, "probe_s": time.perf_counter() - t0}


def choose_dtype(device_type: str, fp32_gflops: float = 0.0,
                 bf16_gflops: float = 0.0) -> tuple[str, str]:
    """model.dtype = "auto" -> (dtype, why): bf16 on a GPU; on a CPU bf16 only if its matmuls are at
    least BF16_MIN_SPEEDUP times fp32's on this machine."""
    if device_type == "cuda":
        return "bfloat16", "GPU"
    ratio = bf16_gflops / fp32_gflops if fp32_gflops > 0 else 0.0
    dtype = "bfloat16" if ratio >= BF16_MIN_SPEEDUP else "float32"
    return dtype, (f"bf16 matmul {bf16_gflops:.1f} vs fp32 {fp32_gflops:.1f} GFLOP/s on this CPU "
                   f"({ratio:.2f}x; bf16 needs >= {BF16_MIN_SPEEDUP}x)")


def resolve_dtype(cfg, say: bool = True) -> None:
    """Replace cfg.model.dtype = "auto" by the dtype this machine runs faster, and say which and why
    (say: rank 0 only, since every rank measures for itself; dist.agree then checks that they chose
    alike)."""
    if cfg.model.dtype != "auto":
        return
    if torch.cuda.device_count():
        dtype, why = choose_dtype("cuda")
    else:
        p = probe_dtype()
        dtype, why = choose_dtype("cpu", p["float32"], p["bfloat16"])
    cfg.model.dtype = dtype
    if say:
        print(f"model.dtype=auto -> {dtype}: {why}", flush=True)


def thread_budget(cores, local_procs: int, local_rank: int) -> list[int]:
    """This process's share of `cores` (CPU ids, or a count meaning 0..n-1) when `local_procs`
    processes of a job share them: equal contiguous slices, the remainder to the first ranks; one
    core each where there are more processes than cores."""
    ids = sorted(cores) if not isinstance(cores, int) else list(range(cores))
    if local_procs >= len(ids):
        return [ids[local_rank % len(ids)]]
    size, extra = divmod(len(ids), local_procs)
    start = local_rank * size + min(local_rank, extra)
    return ids[start:start + size + (local_rank < extra)]


def omp_cap(environ) -> int:
    """OMP_NUM_THREADS as a cap (0: none). Set by hand for processes run side by side, and by
    torchrun (1) when it starts several ranks and the variable is unset."""
    try:
        return max(0, int(environ.get("OMP_NUM_THREADS", "0").split(",")[0]))
    except ValueError:
        return 0


_USER_BIND = "VLLM_CPU_OMP_THREADS_BIND" in os.environ  # set by the user: theirs wins


def huge_pages() -> str:
    """Ask torch's CPU allocator for transparent huge pages (THP_MEM_ALLOC_ENABLE=1:
    madvise(MADV_HUGEPAGE) on every buffer of >= 2 MB) unless the environment already says. An
    update allocates GBs of fresh activations, logits and grads, and glibc returns big buffers
    to the OS on free, so each step faulted them in again 4 KB at a time (measured:
    docs/performance.md#huge-pages). torch reads the variable at its first CPU allocation, so
    this runs when this module is imported (and again, to log it, in set_threads); after a
    tensor exists it changes nothing. Returns what the start-up log says."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return f"THP_MEM_ALLOC_ENABLE={os.environ['THP_MEM_ALLOC_ENABLE']} (kernel THP: {thp_mode()})"


def thp_mode() -> str:
    """The kernel's transparent huge page mode: "always" or "madvise" honour the allocator's hint;
    "never" does not."""
    try:  # the file reads "always [madvise] never"
        return (open("/sys/kernel/mm/transparent_hugepage/enabled").read()
                .split("[")[1].split("]")[0])
    except (OSError, IndexError):
        return "unknown"


# at import: the trainers and bench/ import this before their first tensor, whatever they build
# first
huge_pages()


def set_threads(rank: int = 0) -> list[int]:
    """Apply this process's thread budget (torchrun's LOCAL_WORLD_SIZE / LOCAL_RANK; plain python is
    one process), capped by OMP_NUM_THREADS: torch's intra-op threads, and VLLM_CPU_OMP_THREADS_BIND
    for a CPU vLLM engine this process may start (vLLM's own default binds every core of the node).
    Logs it, with huge_pages' setting. Returns the cores taken."""
    pages = huge_pages()
    local_procs, local_rank = (int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                               int(os.environ.get("LOCAL_RANK", 0)))
    cores, cap = os.sched_getaffinity(0), omp_cap(os.environ)
    mine = thread_budget(cores, local_procs, local_rank)[:cap or None]
    torch.set_num_threads(len(mine))
    if not torch.cuda.device_count() and not _USER_BIND:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
    print(f"threads: rank {rank} takes {len(mine)} of {len(cores)} cores (cpus {mine}; "
          f"{local_procs} process(es) on this node{f', OMP_NUM_THREADS={cap}' if cap else ''}); "
          f"{pages}", flush=True)
    return mine


def roofline(shapes=()) -> dict:
    """A bench result's first record: info(), memory read GB/s, the dtype probe, and fp32 and bf16
    matmul GFLOP/s at 2048^3 and at each (m, k, n) in `shapes` (e.g. the decode step's and the
    update's), on this process's threads. Where the probe found no hardware bf16 path, bf16 is not
    timed again (a 2048^3 matmul would take ~60 s)."""
    probe = probe_dtype()
    out = {**info(), "read_gbps": read_gbps(), "dtype_probe": probe,
           "auto_dtype": choose_dtype("cpu", probe["float32"], probe["bfloat16"])[0]}
    dtypes = ({"fp32": torch.float32, "bf16": torch.bfloat16} if probe["bf16_path"]
              else {"fp32": torch.float32})
    for shape in ((2048, 2048, 2048), *shapes):
        suffix = "" if shape == (2048, 2048, 2048) else "_" + "x".join(map(str, shape))
        # fp32_gflops / bf16_gflops at 2048^3, fp32_gflops_<m>x<k>x<n> at the others
        for name, dt in dtypes.items():
            out[f"{name}_gflops{suffix}"] = matmul_gflops(dt, *shape, repeats=3)
    return out


# A decode step's Linears gain from oneDNN's blocked layout above this many weight elements; below
# it oneDNN's fixed cost a call loses (docs/performance.md#the-decode-step; bench/decode.py)
ONEDNN_MIN_WEIGHT = 1 << 18


# model.py's projections that read the same input: a block's q, k and v; its gate and up
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def onednn_weights(model, rows: int) -> list:
    """[(weights, biases, packed weight, packed bias, sizes)]: one matmul each, for the Linears big
    enough to gain, their weights reordered for oneDNN's matmul at about `rows` rows; a group of
    FUSED projections of one module stacked into one matmul (one call instead of three: the k and v
    projections alone are too small to gain), split after into `sizes`. [] where it does not apply:
    a GPU, bf16 where oneDNN has no bf16 kernels (AVX2), a dtype other than fp32 or bf16, sharded
    (DTensor) weights, a torch without oneDNN. A copy: rebuild it whenever the weights change."""
    from torch.distributed.tensor import DTensor
    if not torch.backends.mkldnn.is_available():
        return []
    dtypes = ((torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported()
              else (torch.float32,))

    def fits(mod):
        return (isinstance(mod, torch.nn.Linear) and not isinstance(mod.weight, DTensor)
                and mod.weight.device.type == "cpu" and mod.weight.dtype in dtypes)

    def packed(lins):
        w = torch.cat([lin.weight.detach() for lin in lins])
        b = None if all(lin.bias is None for lin in lins) else torch.cat(
            [lin.bias.detach() if lin.bias is not None else w.new_zeros(lin.out_features)
             for lin in lins])
        return ([lin.weight for lin in lins], [lin.bias for lin in lins],
                torch.ops.mkldnn._reorder_linear_weight(w, rows), b,
                [lin.out_features for lin in lins])
    out, done = [], set()
    for mod in model.modules():
        for names in FUSED:
            lins = [getattr(mod, n, None) for n in names]
            if (all(fits(lin) for lin in lins)
                    and sum(lin.weight.numel() for lin in lins) >= ONEDNN_MIN_WEIGHT):
                out.append(packed(lins))
                done.update(lins)
    return out + [packed([mod]) for mod in model.modules()
                  if mod not in done and fits(mod) and mod.weight.numel() >= ONEDNN_MIN_WEIGHT]


class OneDNNLinears(TorchFunctionMode):
    """F.linear(x, W, b) for a W of `groups` (onednn_weights) runs on the reordered copy: the same
    product, fp32 summed in another order (~1e-6 relative). Whatever code calls it, model.py's or a
    fork's, runs as written: only the product's kernel changes. A group's stacked product is taken
    at its first member's call and handed to the others while they bring the same x and their own
    bias; any other call is F.linear's."""

    def __init__(self, groups):
        super().__init__()
        self.of = {w: (g, i) for g in groups for i, w in enumerate(g[0])}  # weight -> group, index
        self.ready = {}  # id(group) -> (x, x's version, its outputs not handed out yet)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        named = dict(zip(("input", "weight", "bias"), args), **kwargs)  # positional or by name
        x, bias = named["input"], named.get("bias")
        hit = self.of.get(named["weight"])
        if hit is None:
            return func(*args, **kwargs)
        (_, biases, w, b, sizes), i = hit
        if bias is not biases[i]:
            return func(*args, **kwargs)
        # the same x, unchanged since (an in-place op bumps its _version)
        x_then, version, ys = self.ready.get(id(hit[0]), (None, None, None))
        if x_then is not x or version != x._version or ys[i] is None:
            ys = list(torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "").split(sizes, -1))
            self.ready[id(hit[0])] = (x, x._version, ys)
        y, ys[i] = ys[i], None
        return y


@contextlib.contextmanager
def linears_on(model, groups: list):
    """Within the block, the Linears of `groups` multiply by their reordered weights
    (OneDNNLinears). The mode is entered around each of those Linears' calls (a forward hook pair,
    removed after), not around the whole step: a mode sees every torch call made under it, and
    entered once a step it cost a SmolLM2 decode step ~20% (docs/performance.md#the-decode-step)."""
    mode, hooks = OneDNNLinears(groups), []

    def enter(mod, args):  # returns None: a pre-hook's result would replace the Linear's input
        mode.__enter__()

    def leave(mod, args, out):
        mode.__exit__(None, None, None)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight in mode.of:
            hooks += [mod.register_forward_pre_hook(enter),
                      mod.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
