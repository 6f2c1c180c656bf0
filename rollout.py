"""The rollout service of train_grpo.py: which prompts a step uses, generation shared across the ranks
that hold a generator, collecting the completions to the trainers, rewards, held-out eval, and the loop
a dedicated generator rank runs.

A producer is a rank with a generator: each dedicated generator rank, or with `dist.generator_ranks = 0`
every trainer rank (colocated). Producer i generates problems i::num_producers (`generate_share`);
`collect` all-gathers the shares over the whole world and puts them back in prompt order, so every
trainer rank holds all B groups and keeps its own data-parallel slice. Trainers score their slice
(`score`, in a killable process pool when `rollout.reward_workers > 0`); generator ranks never score.

Prompts are a pure function of (seed, step) (`step_prompts`: epoch e is a fixed permutation of the
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
import random
import time

import torch
import torch.distributed as tdist

import dist
import generator
import rewards


def build_generator(cfg, path, max_model_len):
    kw, backend = dict(max_model_len=max_model_len, seed=cfg.train.seed), cfg.rollout.backend
    if backend == "auto":  # measured per layout, model size and generation length (generator.default_backend)
        backend = generator.default_backend(path, cfg.rollout.max_tokens, colocated=cfg.dist.generator_ranks == 0)
    if backend == "vllm":  # KV memory set explicitly; every sequence of a step in one batch
        kw.update(kv_cache_memory_bytes=cfg.rollout.kv_cache_mb << 20, dtype=cfg.model.dtype,
                  max_num_seqs=max(cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.eval.num_problems))
    return generator.make_generator(backend, path, **kw)


def step_prompts(train, step, batch, seed):
    """Step s's prompts from (seed, s) alone: epoch e is a fixed permutation of the train set."""
    per_epoch = len(train) // batch
    epoch, pos = divmod(step, per_epoch)
    order = list(range(len(train)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return [train[i] for i in order[pos * batch:(pos + 1) * batch]]


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


def make_rewards(cfg):
    """Named reward callables; "math" (correctness) is also the accuracy metric."""
    fns = {"math": rewards.MathReward()}
    return fns


def score(groups, problems, reward_fns, cfg, pool=None):
    """Rewards (B, G) of this rank's groups; the MathReward component doubles as accuracy."""
    prompts, responses, targets = [], [], []
    for p, comps in zip(problems, groups):
        for c in comps:
            prompts.append(p["question"])
            responses.append(c.text)
            targets.append(str(p["target"]))
    total, stats = rewards.score_batch(reward_fns, None, prompts, responses, targets,
                                       timeout_s=cfg.rollout.reward_timeout_s, pool=pool)
    return torch.tensor(total, dtype=torch.float32).view(len(groups), -1), stats


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
    r, _ = score(greedy, held_out, {"math": reward_fns["math"]}, cfg)
    out = {"eval/pass@1": float((r >= 1).float().mean())}
    if cfg.eval.pass_k:
        rk, _ = score(sampled, held_out, {"math": reward_fns["math"]}, cfg)
        out[f"eval/pass@{cfg.eval.pass_k}"] = float((rk >= 1).any(dim=1).float().mean())
    return out


def sync_due(step, cfg):  # generators must see fresh weights before every eval
    return (step + 1) % cfg.dist.sync_interval == 0 or eval_due(step, cfg)


def eval_due(step, cfg):
    return step == cfg.train.steps - 1 or bool(cfg.eval.every and (step + 1) % cfg.eval.every == 0)


def generator_loop(gen, roles, group, cfg, train, held_out, reward_fns, start):
    """A dedicated generator rank: the trainer's sequence of collectives, with generation between."""
    producer, num_producers = roles.generator_ranks.index(roles.rank), len(roles.generator_ranks)
    B, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    def gen_step(s):
        dist.fault("kill_gen", s)  # test hook: SIGKILL this generator rank as it starts generating step s
        return generate_share(gen, step_prompts(train, s, B, cfg.train.seed), producer, num_producers, G,
                              cfg.rollout.temperature, cfg, seed=cfg.train.seed * 100_003 + s)
    receive = lambda version: lambda named: gen.update_weights(named, version)  # noqa: E731
    if start > 0:  # resumed: take the restored weights before generating anything
        dist.broadcast_weights(None, group, roles, cfg.dist.sync_bucket_mb, receive=receive(start))
    if start == 0:
        evaluate(gen, held_out, producer, num_producers, cfg, reward_fns, 0, is_trainer=False)
    pending = None
    for s in range(start, cfg.train.steps):
        local = pending or gen_step(s)
        collect(local, B)
        # staleness >= 1: batch s+1 is generated now, with the weights that produced batch s
        pending = gen_step(s + 1) if cfg.rollout.max_staleness and s + 1 < cfg.train.steps else None
        if sync_due(s, cfg):  # version = optimizer steps taken
            dist.broadcast_weights(None, group, roles, cfg.dist.sync_bucket_mb, receive=receive(s + 1))
        if eval_due(s, cfg):
            evaluate(gen, held_out, producer, num_producers, cfg, reward_fns, s + 1, is_trainer=False)
