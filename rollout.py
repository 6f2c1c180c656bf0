"""The rollout service of train_grpo.py: which prompts a step uses, generation shared across the ranks
that hold a generator, collecting the completions to the trainers, rewards, held-out eval, and the loop
a dedicated generator rank runs.

A producer is a rank with a generator: each dedicated generator rank, or with `dist.generator_ranks = 0`
every trainer rank (colocated). Producer i generates problems i::num_producers (`generate_share`);
`collect` all-gathers the shares over the whole world and puts them back in prompt order, so every
trainer rank holds all B groups and keeps its own data-parallel slice. Trainers score their slice
(`score`, in a killable process pool when `rollout.reward_workers > 0`); generator ranks never score.

Prompts are a pure function of (seed, step) (`data.step_batch`: epoch e is a fixed permutation of the
train set), and so are the sampling seeds. Every rank derives step s's prompts alone, so generators
need no prompt traffic, and a run resumed at step s continues the data order exactly.

A dedicated generator rank runs `generator_loop`, which mirrors the trainers' sequence of collectives:
first the step-0 eval (a fresh run) or the restored weights' sync (a resumed one), then per step the
batch (all_gather_object), the weight sync if `sync_due` (broadcast), the eval if `eval_due` (one
all_gather_object, two with pass@k). Both sides ask the same `sync_due` / `eval_due`, so they never
disagree about what comes next; if they did, the run would hang until `dist.timeout_s`. With
`rollout.max_staleness >= 1` the generator produces batch s+1 right after handing over batch s, before
that sync, so it generates while the trainers update on batch s: a one-batch pipeline whose weights
are at most one version old (each completion carries the version that sampled it).

Left out: running more than one batch ahead (any max_staleness >= 1 acts as 1), pipelining in
colocated mode (the trainers generate, then train), and streaming or partial rollouts (a step's batch
is collected whole).
"""
import functools
import time

import torch
import torch.distributed as tdist

import config
import data
import dist
import generator
import reward_guard
import rewards
import run
import weight_sync


def build_generator(cfg, path, max_model_len, roles):
    kw, backend = dict(max_model_len=max_model_len, seed=cfg.train.seed), cfg.rollout.backend
    if backend == "auto":  # measured per layout, model size and generation length (generator.default_backend)
        backend = generator.default_backend(path, cfg.rollout.max_tokens, colocated=roles.colocated)
    if backend == "vllm":  # KV memory set explicitly; every sequence of a step in one batch; sleeps when colocated
        kw.update(kv_cache_memory_bytes=cfg.rollout.kv_cache_mb << 20, dtype=cfg.model.dtype,
                  max_num_seqs=max(cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.eval.num_problems),
                  gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, enforce_eager=cfg.rollout.enforce_eager,
                  colocated=roles.colocated)
    else:  # on this rank's device (a GPU without vLLM), computing in the trainer's dtype
        kw.update(device=roles.device, dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else None)
    return generator.make_generator(backend, path, **kw)


def generate_share(gen, problems, producer, num_producers, n, temperature, cfg, seed):
    """This producer's share (problems producer::num_producers), tagged with their global index."""
    mine = list(range(producer, len(problems), num_producers))
    t0 = time.perf_counter()
    out = gen.generate([problems[i]["prompt_ids"] for i in mine], n=n, temperature=temperature,
                       top_p=cfg.rollout.top_p if temperature > 0 else 1.0,
                       top_k=cfg.rollout.top_k if temperature > 0 else -1,
                       max_tokens=cfg.rollout.max_tokens, seed=seed)
    generator.check_completions(out, len(mine), n)  # fewer completions than asked: an error, not a shape crash
    return {"idx": mine, "completions": out, "gen_s": time.perf_counter() - t0}


def collect(local, num_problems):
    """All-gather every producer's share (trainers without a generator send None); order by index."""
    shares = [None] * tdist.get_world_size()
    tdist.all_gather_object(shares, local)
    groups, gen_s = [None] * num_problems, 0.0
    for share in shares:
        if share:
            for i, comps in zip(share["idx"], share["completions"]):
                groups[i] = comps
            gen_s = max(gen_s, share["gen_s"])
    return groups, gen_s


def reward_specs(entries):
    """`rollout.rewards` -> [(name, factory, kwargs, weight)]. A key is a built-in (rewards.BUILTIN) or
    "package.module:Name" / "path/to/file.py:Name" (a class, instantiated with the kwargs, or a function); a value
    is its weight, or {"weight": w, **kwargs}. "math" is always there, with weight 0 unless listed: it is the
    accuracy metric whatever else is summed. Imports only (the config check); make_rewards instantiates."""
    specs = []
    for key, value in {**entries, "math": entries.get("math", 0.0)}.items():
        kwargs = dict(value) if isinstance(value, dict) else {"weight": value}
        weight, field = kwargs.pop("weight", 1.0), f"rollout.rewards[{key!r}]"
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise config.ConfigError(f"{field}: the weight must be a number, got {weight!r}")
        if key in rewards.BUILTIN:
            specs.append((key, rewards.BUILTIN[key], kwargs, float(weight)))
        elif ":" in key:
            specs.append((key.rpartition(":")[2], run.load_object(key, field), kwargs, float(weight)))
        else:
            raise config.ConfigError(f"{field}: unknown reward{config._closest(key, rewards.BUILTIN)}; or name your "
                                     "own as 'package.module:Name' or 'path/to/file.py:Name'")
    return specs


def make_rewards(cfg):
    """({name: callable}, {name: weight}), each reward instantiated once, here (picklable for RewardPool)."""
    fns, weights = {}, {}
    for name, factory, kwargs, weight in reward_specs(cfg.rollout.rewards):
        try:
            fns[name] = factory(**kwargs) if isinstance(factory, type) else \
                functools.partial(factory, **kwargs) if kwargs else factory
        except TypeError as e:  # wrong keyword arguments for the class
            raise config.ConfigError(f"rollout.rewards: {name}({kwargs}) failed: {e}") from None
        if not callable(fns[name]):
            raise config.ConfigError(f"rollout.rewards: a {name} instance is not callable (no __call__)")
        weights[name] = weight
    return fns, weights


def score(groups, problems, reward_fns, weights, cfg, pool=None):
    """Rewards (B, G) of this rank's groups: the weighted total, and the "math" component (correctness)."""
    prompts, responses, targets = [], [], []
    for p, comps in zip(problems, groups):
        for c in comps:
            prompts.append(p["question"])
            responses.append(c.text)
            targets.append(str(p["target"]))
    total, stats, parts = reward_guard.score_batch(reward_fns, weights, prompts, responses, targets,
                                                   timeout_s=cfg.rollout.reward_timeout_s, pool=pool, per_reward=True)
    view = lambda x: torch.tensor(x, dtype=torch.float32).view(len(groups), -1)  # noqa: E731
    return view(total), view(parts["math"]), stats


def evaluate(gen, held_out, producer, num_producers, cfg, reward_fns, step, is_trainer=True):
    """Greedy pass@1 (and pass@k) on the held-out set; generation shared by all producers."""
    local = None
    if gen is not None:
        local = generate_share(gen, held_out, producer, num_producers, 1, 0.0, cfg, seed=step)
        if cfg.eval.pass_k:
            local["k"] = generate_share(gen, held_out, producer, num_producers, cfg.eval.pass_k,
                                        cfg.rollout.temperature, cfg, seed=step + 1)["completions"]
    greedy, _ = collect(local, len(held_out))
    if cfg.eval.pass_k:  # a second collective: generators must take part before they return
        sampled, _ = collect(local and {**local, "completions": local["k"]}, len(held_out))
    if not is_trainer:
        return None
    math_only = {"math": reward_fns["math"]}
    _, r, _ = score(greedy, held_out, math_only, None, cfg)
    out = {"eval/pass@1": float((r >= 1).float().mean())}
    if cfg.eval.pass_k:
        _, rk, _ = score(sampled, held_out, math_only, None, cfg)
        out[f"eval/pass@{cfg.eval.pass_k}"] = float((rk >= 1).any(dim=1).float().mean())
    return out


def sync_due(step, cfg):  # generators must see fresh weights before every eval
    return (step + 1) % cfg.dist.sync_interval == 0 or run.eval_due(step, cfg)


def generator_loop(gen, roles, group, cfg, train, held_out, reward_fns, start):
    """A dedicated generator rank: the trainer's sequence of collectives, with generation between."""
    producer, num_producers = roles.generator_ranks.index(roles.rank), len(roles.generator_ranks)
    B, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    def gen_step(s):
        dist.fault("kill_gen", s)  # test hook: SIGKILL this generator rank as it starts generating step s
        return generate_share(gen, data.step_batch(train, s, B, cfg.train.seed), producer, num_producers, G,
                              cfg.rollout.temperature, cfg, seed=cfg.train.seed * 100_003 + s)
    receive = lambda version: lambda named: gen.update_weights(named, version)  # noqa: E731
    if start > 0:  # resumed: take the restored weights before generating anything
        weight_sync.broadcast_weights(None, group, roles, cfg.dist.sync_bucket_mb, receive=receive(start))
    if start == 0:
        evaluate(gen, held_out, producer, num_producers, cfg, reward_fns, 0, is_trainer=False)
    pending = None
    for s in range(start, cfg.train.steps):
        local = pending or gen_step(s)
        collect(local, B)
        # staleness >= 1: batch s+1 is generated now, with the weights that produced batch s
        pending = gen_step(s + 1) if cfg.rollout.max_staleness and s + 1 < cfg.train.steps else None
        if sync_due(s, cfg):  # version = optimizer steps taken
            weight_sync.broadcast_weights(None, group, roles, cfg.dist.sync_bucket_mb, receive=receive(s + 1))
        if run.eval_due(s, cfg):
            evaluate(gen, held_out, producer, num_producers, cfg, reward_fns, s + 1, is_trainer=False)
