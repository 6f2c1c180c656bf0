"""Which generator a rank runs, and how big: the backend rule (`rollout.backend = "auto"`), vLLM's
KV cache sized from the model's shapes and one step's rows, and the engine built before the rank
joins the world.

The rule was measured side by side on CPUs and GPUs (docs/performance.md#the-backend-rule); the
generators themselves are generator.py's, multi-turn episodes episodes.py's.
"""
import importlib.util
import json
from pathlib import Path

import torch

import episodes
import generator
import machine


def hf_config(model_path):
    """The model's shapes from config.json alone (no weights read)."""
    import model as model_lib
    return model_lib.ModelConfig.from_hf(json.loads((Path(model_path) / "config.json").read_text()))


def num_params(model_path) -> int:
    """Parameter count from config.json: embeddings, per-layer attention + MLP + norms."""
    c = hf_config(model_path)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
             + 2 * c.hidden_size)
    if c.attention_bias:  # q, k, v biases (and o_proj's, except in qwen2)
        layer += q + 2 * kv + (c.hidden_size if c.model_type != "qwen2" else 0)
    if c.qk_norm:
        layer += 2 * c.head_dim
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embed + c.num_hidden_layers * layer + c.hidden_size


def kv_cache_bytes(cfg, model_path, longest_prompt, max_model_len, budget=None) -> int:
    """vLLM's KV cache for one engine: rollout.kv_cache_mb, or where it is 0 one step's worth. That
    is B x G rows of (the longest prompt + the generation budget) tokens, each row rounded up to
    whole 128-token blocks (vLLM's CPU block), at (K and V) x layers x KV heads x head_dim x the
    compute dtype's bytes a token, and never less than one row of max_model_len, which vLLM
    requires. A step needs no more; with less, vLLM runs the rows in waves (preempting), and eval's
    larger batches queue the same way: so `budget` (bytes) caps it, down to that one row."""
    ro = cfg.rollout
    if ro.kv_cache_mb:
        return ro.kv_cache_mb << 20
    c = hf_config(model_path)
    # "auto" is resolved by now (machine.resolve_dtype)
    nbytes = 2 if cfg.model.dtype == "bfloat16" else 4
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * nbytes
    blocks = lambda n: -(-n // 128) * 128  # noqa: E731
    row = min(max_model_len, longest_prompt + (ro.max_episode_tokens if ro.env else ro.max_tokens))
    need, one_row = (ro.prompts_per_step * ro.group_size * blocks(row) * per_token,
                     blocks(max_model_len) * per_token)
    return max(min(need, budget or need), one_row)


# The rule of default_backend. Colocated on CPU: the torch generator (an engine in the trainer's
# process costs it threads and a weight repack per update). On a dedicated CPU generator rank: vLLM
# for models of >= 20M parameters or generations of > 128 tokens, else the torch generator. On a
# GPU: vLLM. (docs/performance.md#the-backend-rule)
# between the two measured sizes (0.9M torch faster, 135M vLLM faster)
VLLM_CPU_MIN_PARAMS = 20_000_000
# between the two measured lengths at 0.9M (40: torch faster, 256: vLLM faster)
VLLM_CPU_MIN_TOKENS = 128


def default_backend(model_path=None, max_tokens=None, colocated=True) -> str:
    """What rollout.backend = "auto" means, by the measured rule above, for the model and workload
    configured. vLLM on a GPU (the torch generator where vLLM is not installed). On CPU: colocated
    with the trainer (one process), the torch generator; alone on a dedicated generator rank, vLLM
    for a model of >= 20M parameters or generations of > 128 tokens, else the torch generator.
    Without a model path: CPU means the torch generator."""
    # Asked without touching CUDA or importing vLLM (device_count asks NVML; find_spec imports
    # nothing), so that train_grpo can decide before dist.get_roles pins this rank's GPU.
    if torch.cuda.device_count() == 0:
        if model_path is None or colocated:
            return "torch"
        if (num_params(model_path) < VLLM_CPU_MIN_PARAMS
                and (max_tokens or 0) <= VLLM_CPU_MIN_TOKENS):
            return "torch"
    return "vllm" if importlib.util.find_spec("vllm") is not None else "torch"


def resolve_backend(cfg, model_path) -> str:
    """rollout.backend with "auto" resolved (default_backend) for this config's layout."""
    if cfg.rollout.backend != "auto":
        return cfg.rollout.backend
    return default_backend(model_path, cfg.rollout.max_tokens,
                           colocated=cfg.dist.generator_ranks == 0)


def build_generator(cfg, path, roles, tok, longest_prompt=None):
    """This rank's engine, ready for dist.init_distributed; with `rollout.env`, wrapped to play
    multi-turn episodes (episodes.MultiTurn). longest_prompt (tokens, of the loaded tasks) sizes
    vLLM's KV cache (kv_cache_bytes)."""
    ro = cfg.rollout
    after_prompt = ro.max_episode_tokens if ro.env else ro.max_tokens  # after the prompt
    max_model_len = cfg.data.max_prompt_tokens + after_prompt
    kw, backend = dict(max_model_len=max_model_len, seed=cfg.train.seed), resolve_backend(cfg, path)
    first = roles.rank == (roles.generator_ranks or [0])[0]  # one engine says what "auto" chose
    if first and ro.backend == "auto":
        where = "colocated" if roles.colocated else "a dedicated rank"
        print(f"rollout.backend=auto -> {backend} (engine.default_backend: {where}, "
              f"{num_params(path) / 1e6:.1f}M parameters, {ro.max_tokens} tokens, "
              f"{torch.backends.cpu.get_cpu_capability()})", flush=True)
    # KV memory set explicitly; every sequence of a step in one batch; sleeps when colocated
    if backend == "vllm":
        longest = longest_prompt or cfg.data.max_prompt_tokens
        # on CPU the cache is host memory beside the trainer's: at most a quarter of what the OS can
        # give now
        budget = machine.available_bytes() // 4 if roles.device.type == "cpu" else None
        kv = kv_cache_bytes(cfg, path, longest, max_model_len, budget)
        if first and not ro.kv_cache_mb:
            capped = kv < kv_cache_bytes(cfg, path, longest, max_model_len)
            print(f"rollout.kv_cache_mb=0 -> {kv / 2**20:.0f} MB: "
                  + ("a quarter of the memory available, less than "
                     "one step's rows: they run in waves" if capped
                     else f"one step's {ro.prompts_per_step * ro.group_size}"
                          f" rows (longest prompt {longest} + "
                          f"{ro.max_episode_tokens if ro.env else ro.max_tokens} tokens)"),
                  flush=True)
        kw.update(kv_cache_memory_bytes=kv, dtype=cfg.model.dtype,
                  max_num_seqs=max(cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                                   cfg.eval.num_problems),
                  gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                  enforce_eager=cfg.rollout.enforce_eager, colocated=roles.colocated)
    else:  # on this rank's device (a GPU without vLLM), computing in the trainer's dtype
        kw.update(device=roles.device,
                  dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else None, onednn=ro.onednn)
    gen = generator.make_generator(backend, path, **kw)
    # this process joins the torchrun world next (generator.py: why vLLM's group must go)
    if backend == "vllm":
        gen.release_default_group()
    return episodes.MultiTurn(gen, tok, cfg) if ro.env else gen
