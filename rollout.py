"""The rollout service of train_grpo.py: the train and held-out problems (`load_tasks`), which prompts a step
uses, generation shared across the ranks that hold a generator, collecting the completions to the trainers,
rewards, held-out eval, the loop a dedicated generator rank runs, and a step's metrics row (`step_metrics`:
rewards, lengths, staleness, the train/inference `mismatch`, averaged over the data-parallel ranks).

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

Colocated (`dist.generator_ranks = 0`) with `max_staleness >= 1`, a trainer generates batch s+1 before it
updates on batch s: the same data as the pipeline (batch s sampled by the weights one version old), without
the overlap, so a loss's behaviour under staleness can be measured on one CPU process.

DAPO's dynamic sampling (`rollout.filter_zero_std`) refills the batch: a group whose G rewards are all
equal has zero advantage, so after each round rank 0 scores the round's groups, broadcasts which are
informative (0 < std) to every rank, and the producers generate another round of B fresh prompts, at
most `rollout.refill_rounds` times, until B informative groups are collected (`refill`). Round k's
prompts and sampling seeds are a pure function of (seed, step, k), so a resumed run redraws the same
rounds. If the cap is reached first, zero-signal groups fill the remaining slots and the trainer masks
them out (DAPO's filter without the refill is `refill_rounds = 0`).

Multi-turn (`rollout.env`): build_generator wraps the engine in episodes.MultiTurn, and generate_share plays whole
episodes where it would sample completions; everything above (sharing, collection, refill, staleness, eval) is
unchanged, and score adds each episode's env reward to the rewards of its last reply (episodes.py).

Left out: running more than one batch ahead (any max_staleness >= 1 acts as 1), overlapping generation and
training in colocated mode, and streaming or partial rollouts (a step's batch is collected whole). A run
resumed at step s with staleness >= 1 samples batch s with the restored weights (version s, not s-1: the
checkpoint holds no older weights), so its first batch is on-policy; the prompts are the same.
"""
import functools
import importlib.util
import json
import time
from pathlib import Path

import torch
import torch.distributed as tdist

import config
import data
import dist
import episodes
import generator
import losses
import machine
import reward_guard
import rewards
import run
import seeds
import weight_sync


def load_tasks(cfg, tok):
    """Train and held-out problems as dicts with prompt_ids and an id (the train index, for the prompt log);
    too-long prompts dropped or truncated (data.long_prompts), counted."""
    train = data.problems(cfg.data, "train", cfg.train.seed)
    held_out = data.problems(cfg.data, "test", cfg.train.seed, cfg.eval.num_problems)
    num_long, L = 0, cfg.data.max_prompt_tokens
    for split in (train, held_out):
        keep = []
        for p in split:  # with an env, the prompt is its opening conversation (envs.py)
            p["prompt_ids"] = episodes.opening_ids(tok, episodes.make_env(cfg, p)) if cfg.rollout.env else \
                data.prompt_ids(tok, p["question"] + cfg.data.instruction)
            num_long += len(p["prompt_ids"]) > L
            if len(p["prompt_ids"]) > L and cfg.data.long_prompts == "truncate":
                p["prompt_ids"] = p["prompt_ids"][-L:]
            if len(p["prompt_ids"]) <= L:
                keep.append(p)
        split[:] = keep
    for i, p in enumerate(train):
        p["id"] = i
    if not train:
        raise RuntimeError(f"no training prompts left: all are longer than data.max_prompt_tokens={L}")
    return train, held_out, num_long


def hf_config(model_path):
    """The model's shapes from config.json alone (no weights read)."""
    import model as model_lib
    return model_lib.ModelConfig.from_hf(json.loads((Path(model_path) / "config.json").read_text()))


def num_params(model_path) -> int:
    """Parameter count from config.json: embeddings, per-layer attention + MLP + norms."""
    c = hf_config(model_path)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    if c.attention_bias:  # q, k, v biases (and o_proj's, except in qwen2)
        layer += q + 2 * kv + (c.hidden_size if c.model_type != "qwen2" else 0)
    if c.qk_norm:
        layer += 2 * c.head_dim
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embed + c.num_hidden_layers * layer + c.hidden_size


def kv_cache_bytes(cfg, model_path, longest_prompt, max_model_len, budget=None) -> int:
    """vLLM's KV cache for one engine: rollout.kv_cache_mb, or where it is 0 one step's worth. That is B x G rows of
    (the longest prompt + the generation budget) tokens, each row rounded up to whole 128-token blocks (vLLM's CPU
    block), at (K and V) x layers x KV heads x head_dim x the compute dtype's bytes a token, and never less than one
    row of max_model_len, which vLLM requires. A step needs no more; with less, vLLM runs the rows in waves
    (preempting), and eval's larger batches queue the same way: so `budget` (bytes) caps it, down to that one row."""
    r = cfg.rollout
    if r.kv_cache_mb:
        return r.kv_cache_mb << 20
    c = hf_config(model_path)
    nbytes = 2 if cfg.model.dtype == "bfloat16" else 4  # "auto" is resolved by now (machine.resolve_dtype)
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * nbytes
    blocks = lambda n: -(-n // 128) * 128  # noqa: E731
    row = min(max_model_len, longest_prompt + (r.max_episode_tokens if r.env else r.max_tokens))
    need, one_row = r.prompts_per_step * r.group_size * blocks(row) * per_token, blocks(max_model_len) * per_token
    return max(min(need, budget or need), one_row)


# The rule of default_backend. Colocated on CPU: the torch generator (an engine in the trainer's
# process costs it threads and a weight repack per update). On a dedicated CPU generator rank: vLLM
# for models of >= 20M parameters or generations of > 128 tokens, else the torch generator. On a
# GPU: vLLM. (docs/performance.md#the-backend-rule)
VLLM_CPU_MIN_PARAMS = 20_000_000  # between the two measured sizes (0.9M torch faster, 135M vLLM faster)
VLLM_CPU_MIN_TOKENS = 128         # between the two measured lengths at 0.9M (40: torch faster, 256: vLLM faster)


def default_backend(model_path=None, max_tokens=None, colocated=True) -> str:
    """What rollout.backend = "auto" means, by the measured rule above, for the model and workload configured.
    vLLM on a GPU (the torch generator where vLLM is not installed). On CPU: colocated with the trainer (one
    process), the torch generator; alone on a dedicated generator rank, vLLM for a model of >= 20M parameters or
    generations of > 128 tokens, else the torch generator. Without a model path: CPU means the torch generator."""
    # Asked without touching CUDA or importing vLLM (device_count asks NVML; find_spec imports nothing), so that
    # train_grpo can decide before dist.get_roles pins this rank's GPU.
    if torch.cuda.device_count() == 0:
        if model_path is None or colocated:
            return "torch"
        if num_params(model_path) < VLLM_CPU_MIN_PARAMS and (max_tokens or 0) <= VLLM_CPU_MIN_TOKENS:
            return "torch"
    return "vllm" if importlib.util.find_spec("vllm") is not None else "torch"


def resolve_backend(cfg, model_path) -> str:
    """rollout.backend with "auto" resolved (default_backend) for this config's layout."""
    if cfg.rollout.backend != "auto":
        return cfg.rollout.backend
    return default_backend(model_path, cfg.rollout.max_tokens, colocated=cfg.dist.generator_ranks == 0)


def build_generator(cfg, path, roles, tok, longest_prompt=None):
    """This rank's engine, ready for dist.init_distributed; with `rollout.env`, wrapped to play multi-turn episodes
    (episodes.MultiTurn). longest_prompt (tokens, of the loaded tasks) sizes vLLM's KV cache (kv_cache_bytes)."""
    r = cfg.rollout
    max_model_len = cfg.data.max_prompt_tokens + (r.max_episode_tokens if r.env else r.max_tokens)
    kw, backend = dict(max_model_len=max_model_len, seed=cfg.train.seed), resolve_backend(cfg, path)
    first = roles.rank == (roles.generator_ranks or [0])[0]  # one engine says what "auto" chose
    if first and r.backend == "auto":
        where = "colocated" if roles.colocated else "a dedicated rank"
        print(f"rollout.backend=auto -> {backend} (rollout.default_backend: {where}, {num_params(path) / 1e6:.1f}M "
              f"parameters, {r.max_tokens} tokens, {torch.backends.cpu.get_cpu_capability()})", flush=True)
    if backend == "vllm":  # KV memory set explicitly; every sequence of a step in one batch; sleeps when colocated
        longest = longest_prompt or cfg.data.max_prompt_tokens
        # on CPU the cache is host memory beside the trainer's: at most a quarter of what the OS can give now
        budget = machine.available_bytes() // 4 if roles.device.type == "cpu" else None
        kv = kv_cache_bytes(cfg, path, longest, max_model_len, budget)
        if first and not r.kv_cache_mb:
            capped = kv < kv_cache_bytes(cfg, path, longest, max_model_len)
            print(f"rollout.kv_cache_mb=0 -> {kv / 2**20:.0f} MB: " + ("a quarter of the memory available, less than "
                  "one step's rows: they run in waves" if capped else f"one step's {r.prompts_per_step * r.group_size}"
                  f" rows (longest prompt {longest} + {r.max_episode_tokens if r.env else r.max_tokens} tokens)"),
                  flush=True)
        kw.update(kv_cache_memory_bytes=kv, dtype=cfg.model.dtype,
                  max_num_seqs=max(cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.eval.num_problems),
                  gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, enforce_eager=cfg.rollout.enforce_eager,
                  colocated=roles.colocated)
    else:  # on this rank's device (a GPU without vLLM), computing in the trainer's dtype
        kw.update(device=roles.device, dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else None)
    gen = generator.make_generator(backend, path, **kw)
    if backend == "vllm":  # this process joins the torchrun world next (generator.py: why vLLM's group must go)
        gen.release_default_group()
    return episodes.MultiTurn(gen, tok, cfg) if r.env else gen


def generate_share(gen, problems, producer, num_producers, n, temperature, cfg, seed):
    """This producer's share (problems producer::num_producers), tagged with their global index."""
    mine = list(range(producer, len(problems), num_producers))
    t0 = time.perf_counter()
    sampling = dict(n=n, temperature=temperature, top_p=cfg.rollout.top_p if temperature > 0 else 1.0,
                    top_k=cfg.rollout.top_k if temperature > 0 else -1, max_tokens=cfg.rollout.max_tokens, seed=seed)
    if isinstance(gen, episodes.MultiTurn):  # multi-turn: each completion is a whole episode
        out = gen.episodes([problems[i] for i in mine], **sampling)
    else:
        out = gen.generate([problems[i]["prompt_ids"] for i in mine], **sampling)
    generator.check_completions(out, len(mine), n)  # fewer completions than asked: an error, not a shape crash
    return {"idx": mine, "completions": out, "gen_s": time.perf_counter() - t0}


def sample_seed(cfg, step, round_=0):
    """Sampling seed of step `step`'s generation round `round_` (0: the batch itself, k >= 1: DAPO refills)."""
    return seeds.seed(cfg.train.seed, "sample", step, round_)


def round_problems(train, step, round_, cfg):
    """Step `step`'s prompts (round 0), or its k-th refill round's: B prompts from a stream of their own."""
    return data.step_batch(train, step, cfg.rollout.prompts_per_step, cfg.train.seed,
                           "order" if round_ == 0 else f"refill_{round_}")


def generate_step(gen, train, step, cfg, producer, num_producers, round_=0):
    """This producer's share of step `step`'s batch (None on a rank without a generator)."""
    if gen is None:
        return None
    dist.fault("kill_gen", step)  # test hook: SIGKILL this rank as it starts generating step s
    return generate_share(gen, round_problems(train, step, round_, cfg), producer, num_producers,
                          cfg.rollout.group_size, cfg.rollout.temperature, cfg, seed=sample_seed(cfg, step, round_))


def ahead(step, cfg):
    """Staleness >= 1: generate batch step+1 now (before the update on batch `step`)."""
    return bool(cfg.rollout.max_staleness) and step + 1 < cfg.train.steps


def informative(groups, problems, scorer):
    """(B,) bools, the same on every rank: rank 0 (a trainer) scores, every rank takes its broadcast."""
    flags = [None]
    if tdist.get_rank() == 0:
        flags = [(~losses.zero_std_groups(scorer(groups, problems))).tolist()]
    tdist.broadcast_object_list(flags, src=0)
    return flags[0]


def refill(gen, train, step, problems, groups, cfg, producer, num_producers, scorer=None):
    """DAPO dynamic sampling: up to `rollout.refill_rounds` more rounds until B groups have 0 < std (module
    docstring). Returns the batch, informative groups first in the order drawn, and what it cost."""
    B, kept, spare, rounds, gen_s = cfg.rollout.prompts_per_step, [], [], 0, 0.0
    while True:
        for p, g, ok in zip(problems, groups, informative(groups, problems, scorer)):
            (kept if ok else spare).append((p, g))
        if len(kept) >= B or rounds == cfg.rollout.refill_rounds:
            break
        rounds += 1
        problems = round_problems(train, step, rounds, cfg)
        groups, t = collect(generate_step(gen, train, step, cfg, producer, num_producers, rounds), B)
        gen_s += t
    chosen = (kept + spare)[:B]
    stats = {"rollout/refill_rounds": float(rounds), "rollout/prompts_drawn": float(B * (rounds + 1)),
             "rollout/informative_groups": float(min(len(kept), B))}
    return [p for p, _ in chosen], [g for _, g in chosen], gen_s, stats


def step_rollout(gen, train, step, cfg, producer, num_producers, local=None, scorer=None):
    """Step `step`'s batch on every rank: prompts, generation (or the share made one step ahead: `local`),
    collected in prompt order, refilled under dynamic sampling. Returns problems, groups, gen_s, stats."""
    local = local or generate_step(gen, train, step, cfg, producer, num_producers)
    t0 = time.perf_counter()
    groups, gen_s = collect(local, cfg.rollout.prompts_per_step)
    problems, stats = round_problems(train, step, 0, cfg), {"perf/wait_s": time.perf_counter() - t0}
    if cfg.rollout.filter_zero_std:
        problems, groups, more_s, fill = refill(gen, train, step, problems, groups, cfg, producer, num_producers,
                                                scorer)
        gen_s += more_s
        stats.update(fill)
    return problems, groups, gen_s, stats


def collect(local, num_problems):
    """All-gather every producer's share (trainers without a generator send None); order by index. One process
    gathers nothing: gloo would copy the pickle in its own thread, whose OpenMP team then outnumbers the cores and
    makes every later parallel region's threads sleep between regions (generation ~30% slower after step 0)."""
    shares = [local]
    if tdist.get_world_size() > 1:
        shares = [None] * tdist.get_world_size()
        tdist.all_gather_object(shares, local)
    groups, gen_s = [None] * num_problems, 0.0
    for share in shares:
        if share:
            for i, comps in zip(share["idx"], share["completions"]):
                groups[i] = comps
            gen_s = max(gen_s, share["gen_s"])
    return groups, gen_s


def reward_specs(entries, accuracy="math"):
    """`rollout.rewards` -> [(name, factory, kwargs, weight)]. A key is a built-in (rewards.BUILTIN) or
    "package.module:Name" / "path/to/file.py:Name" (a class, instantiated with the kwargs, or a function); a value
    is its weight, or {"weight": w, **kwargs}. `accuracy` ("math" unless rollout.accuracy says) is always there,
    with weight 0 unless listed: it is the accuracy metric whatever else is summed. Imports only (the config
    check); make_rewards instantiates."""
    specs = []
    for key, value in {**entries, accuracy: entries.get(accuracy, 0.0)}.items():
        kwargs = dict(value) if isinstance(value, dict) else {"weight": value}
        weight, field = kwargs.pop("weight", 1.0), f"rollout.rewards[{key!r}]"
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise config.ConfigError(f"{field}: the weight must be a number, got {weight!r}")
        fn = config.named(key, rewards.BUILTIN, field, "reward")
        specs.append((key if key in rewards.BUILTIN else key.rpartition(":")[2], fn, kwargs, float(weight)))
    return specs


def make_rewards(cfg):
    """({name: callable}, {name: weight}), each reward instantiated once, here (picklable for RewardPool)."""
    fns, weights = {}, {}
    for name, factory, kwargs, weight in reward_specs(cfg.rollout.rewards, cfg.rollout.accuracy):
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
    """Rewards (B, G) of this rank's groups: the weighted total, and the accuracy reward's part (correctness)."""
    prompts, responses, targets, ends = [], [], [], []
    for p, comps in zip(problems, groups):
        for c in comps:
            prompts.append(p["question"])
            responses.append(c.text)  # a multi-turn episode's last reply, against the env's target if it has one
            targets.append(c.metadata.get("target") or str(p["target"]))
            ends.append((c.metadata.get("end"), c.metadata.get("env_reward")))
    acc = cfg.rollout.accuracy
    total, stats, parts = reward_guard.score_batch(reward_fns, weights, prompts, responses, targets,
                                                   timeout_s=cfg.rollout.reward_timeout_s, pool=pool, per_reward=True)
    if cfg.rollout.env:  # an episode scores the env's reward plus the rewards on its last reply; an env error 0
        total = [0.0 if end == "error" else t + (env_r or 0.0) for t, (end, env_r) in zip(total, ends)]
        parts[acc] = [0.0 if end == "error" else m for m, (end, _) in zip(parts[acc], ends)]
    view = lambda x: torch.tensor(x, dtype=torch.float32).view(len(groups), -1)  # noqa: E731
    return view(total), view(parts[acc]), stats


def evaluate(gen, held_out, producer, num_producers, cfg, reward_fns, step, is_trainer=True):
    """Greedy pass@1 (and pass@k) on the held-out set; generation shared by all producers."""
    local = None
    if gen is not None:
        local = generate_share(gen, held_out, producer, num_producers, 1, 0.0, cfg,
                               seed=seeds.seed(cfg.train.seed, "eval", step))
        if cfg.eval.pass_k:
            local["k"] = generate_share(gen, held_out, producer, num_producers, cfg.eval.pass_k,
                                        cfg.rollout.temperature, cfg,
                                        seed=seeds.seed(cfg.train.seed, "pass_k", step))["completions"]
    greedy, _ = collect(local, len(held_out))
    if cfg.eval.pass_k:  # a second collective: generators must take part before they return
        sampled, _ = collect(local and {**local, "completions": local["k"]}, len(held_out))
    if not is_trainer:
        return None
    acc_only = {cfg.rollout.accuracy: reward_fns[cfg.rollout.accuracy]}
    _, r, _ = score(greedy, held_out, acc_only, None, cfg)
    out = {"eval/pass@1": float((r >= 1).float().mean())}
    if cfg.eval.pass_k:
        _, rk, _ = score(sampled, held_out, acc_only, None, cfg)
        out[f"eval/pass@{cfg.eval.pass_k}"] = float((rk >= 1).any(dim=1).float().mean())
    return out


def sync_due(step, cfg):  # generators must see fresh weights before every eval
    return (step + 1) % cfg.dist.sync_interval == 0 or run.eval_due(step, cfg)


def generator_loop(gen, roles, group, cfg, train, held_out, reward_fns, start):
    """A dedicated generator rank: the trainer's sequence of collectives, with generation between."""
    producer, num_producers = roles.generator_ranks.index(roles.rank), len(roles.generator_ranks)
    receive = lambda version: lambda named: gen.update_weights(named, version)  # noqa: E731
    if start > 0:  # resumed: take the restored weights before generating anything
        weight_sync.broadcast_weights(None, group, roles, cfg.dist.sync_bucket_mb, receive=receive(start))
    if start == 0:
        evaluate(gen, held_out, producer, num_producers, cfg, reward_fns, 0, is_trainer=False)
    pending = None
    for s in range(start, cfg.train.steps):
        step_rollout(gen, train, s, cfg, producer, num_producers, pending)
        # staleness >= 1: batch s+1 is generated now, with the weights that produced batch s's refill rounds
        pending = generate_step(gen, train, s + 1, cfg, producer, num_producers) if ahead(s, cfg) else None
        if sync_due(s, cfg):  # version = optimizer steps taken
            weight_sync.broadcast_weights(None, group, roles, cfg.dist.sync_bucket_mb, receive=receive(s + 1))
        if run.eval_due(s, cfg):
            evaluate(gen, held_out, producer, num_producers, cfg, reward_fns, s + 1, is_trainer=False)
    print(f"generator rank {roles.rank}: done, weight version {gen.version} after {cfg.train.steps} steps", flush=True)


def mismatch(train_logp, gen_logp, mask):
    """Train/inference mismatch on the same tokens: mean |dlogp| and k3 KL(gen || train)."""
    keep = mask.bool()  # padding may hold anything: zero it before exp
    train_logp, gen_logp = torch.where(keep, train_logp, 0.0), torch.where(keep, gen_logp, 0.0)
    return {"mismatch/abs_diff": float(losses.masked_mean((train_logp - gen_logp).abs(), mask)),
            "mismatch/kl": float(losses.masked_mean(losses.kl_estimate(gen_logp, train_logp, "k3"), mask))}


def step_metrics(parts, r, correct, lengths, groups, batch, step, sched, skipped_total, num_dropped, cfg, dp_group, dp):
    """This step's metrics row: the update's, rewards', mismatch, sync and timing `parts` plus the rollout
    statistics, averaged over the data-parallel ranks (one all_reduce of one vector)."""
    row = {**parts, "rollout/reward_mean": float(r.mean()), "rollout/reward_std": float(r.std()),
           "rollout/accuracy": float((correct >= 1).float().mean()),  # rollout.accuracy's, whatever else is summed
           "rollout/response_len": float(lengths.mean()),
           "rollout/truncated_frac": float(sum(c.finish_reason == "length" for cs in groups for c in cs)
                                           / lengths.numel()),
           "rollout/zero_std_frac": float(losses.zero_std_groups(r).float().mean()),
           "rollout/staleness": float((step - batch["version"]).mean()),
           "train/lr": sched.get_last_lr()[0], "train/skipped_steps": float(skipped_total),
           "data/dropped_prompts" if cfg.data.long_prompts == "drop" else "data/truncated_prompts": float(num_dropped),
           **(episodes.stats(groups) if cfg.rollout.env else {})}
    keys = sorted(row)
    vec = torch.tensor([row[k] for k in keys], dtype=torch.float64)
    tdist.all_reduce(vec, group=dp_group)
    return {k: float(v) / dp for k, v in zip(keys, vec)}
