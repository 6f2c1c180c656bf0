"""One step's batch for train_grpo.py: the train and held-out problems (`load_tasks`), which prompts
a step uses (from seed, step and refill round), generation shared across the ranks that hold a
generator, collecting the completions to the trainers, DAPO's refill, rewards for a batch (`score`),
and the held-out eval.

A producer is a rank with a generator: each dedicated generator rank, or with
`dist.generator_ranks = 0` every trainer rank (colocated). Producer i generates problems
i::num_producers (`generate_share`); `collect` all-gathers the shares over the whole world and puts
them back in prompt order, so every trainer rank holds all B groups and keeps its own data-parallel
slice. Trainers score their slice (`score`, in a killable process pool when
`rollout.reward_workers > 0`); generator ranks never score.

Prompts are a pure function of (seed, step) (`data.step_batch`: epoch e is a fixed permutation of
the train set), and so are the sampling seeds (seeds.py). Every rank derives step s's prompts alone,
so generators need no prompt traffic, and a run resumed at step s continues the data order exactly.

A dedicated generator rank runs train_grpo.generator_loop, beside main(): both read
train_grpo.schedule for what happens at step s (the batch, all_gather_object; the weight sync,
broadcast; the eval, one all_gather_object, two with pass@k), so they never disagree about what
comes next; if they did, the run would hang until `dist.timeout_s`. With
`rollout.max_staleness = k` the generator produces batch s+k right after handing over batch s,
before that sync, so it generates while the trainers update on batch s: a k-batch pipeline whose
weights are at most k versions old (each completion carries the version that sampled it). A run's
first step fills the pipeline: batches s+1..s+k, all by the same weights, so staleness climbs
0, 1, ..., k over the first k steps and then holds at k. With `rollout.inflight_updates` that sync
reaches the generator mid-batch, at a token boundary (generate_step's `poll`): the rows still
running go on under the new weights, each token tagged with its version (docs/off-policy.md).

Colocated (`dist.generator_ranks = 0`) with `max_staleness = k`, a trainer generates batch s+k
before it updates on batch s: the same data as the pipeline (batch s sampled by the weights k
versions old), without the overlap, so a loss's behaviour under staleness can be measured on one CPU
process.

DAPO's dynamic sampling (`rollout.filter_zero_std`) refills the batch: a group whose G rewards are
all equal has zero advantage, so after each round every trainer scores its data-parallel slice of
the round's groups, one all_gather gives every rank all the rewards and so which groups are
informative (0 < std), and the producers generate another round of B fresh
prompts, at most `rollout.refill_rounds` times, until B informative groups are collected (`refill`).
Round k's prompts and sampling seeds are a pure function of (seed, step, k), so a resumed run
redraws the same rounds. If the cap is reached first, zero-signal groups fill the remaining slots
and the trainer masks them out (DAPO's filter without the refill is `refill_rounds = 0`). The
trainers keep the rewards of the groups chosen: each group is scored once (a sandboxed code reward
is the step's dearest part).

Multi-turn (`rollout.env`): engine.build_generator wraps the engine in episodes.MultiTurn, and
generate_share plays whole episodes where it would sample completions; everything above (sharing,
collection, refill, staleness, eval) is unchanged, and score adds each episode's env reward to the
rewards of its last reply.

Left out: overlapping generation and training in colocated mode, and handing a batch over mid-way
(a step's batch is collected whole; rows unfinished at a deadline are not carried to the next
step). What was generated ahead is not checkpointed: a run resumed at step s with staleness k
regenerates batches s..s+k with the restored weights (version s; the checkpoint holds no older
weights), so its first batch is on-policy and staleness climbs again; the prompts and sampling
seeds are the same, so two resumes from one checkpoint agree exactly (in flight, where an update
lands depends on timing: docs/off-policy.md).
"""
import time

import torch
import torch.distributed as tdist

import data
import dist
import episodes
import generator
import losses
import metrics
import rewards
import seeds


def load_tasks(cfg, tok):
    """Train and held-out problems as dicts with prompt_ids and an id (the train index, for the
    prompt log); too-long prompts dropped or truncated (data.long_prompts), counted."""
    train = data.problems(cfg.data, "train", cfg.train.seed)
    held_out = data.problems(cfg.data, "test", cfg.train.seed, cfg.eval.num_problems)
    num_long, L = 0, cfg.data.max_prompt_tokens
    for split in (train, held_out):
        keep = []
        for p in split:  # with an env, the prompt is its opening conversation (envs.py)
            p["prompt_ids"] = (
                episodes.opening_ids(tok, episodes.make_env(cfg, p)) if cfg.rollout.env
                else data.prompt_ids(tok, p["question"] + cfg.data.instruction))
            num_long += len(p["prompt_ids"]) > L
            if len(p["prompt_ids"]) > L and cfg.data.long_prompts == "truncate":
                p["prompt_ids"] = p["prompt_ids"][-L:]
            if len(p["prompt_ids"]) <= L:
                keep.append(p)
        split[:] = keep
    for i, p in enumerate(train):
        p["id"] = i
    if not train:
        raise RuntimeError(
            f"no training prompts left: all are longer than data.max_prompt_tokens={L}")
    return train, held_out, num_long


def sampling(ro, n, temperature, seed):
    """generate()'s arguments for n samples at `temperature` under the rollout section `ro` (greedy,
    temperature 0, ignores top_p and top_k)."""
    return dict(n=n, temperature=temperature, top_p=ro.top_p if temperature > 0 else 1.0,
                top_k=ro.top_k if temperature > 0 else -1, max_tokens=ro.max_tokens, seed=seed)


def generate_share(gen, problems, producer, num_producers, **sampled):
    """This producer's share (problems producer::num_producers) of `sampled` (sampling()'s
    arguments), tagged with their global index."""
    mine = list(range(producer, len(problems), num_producers))
    t0 = time.perf_counter()
    if isinstance(gen, episodes.MultiTurn):  # multi-turn: each completion is a whole episode
        out = gen.episodes([problems[i] for i in mine], **sampled)
    else:
        out = gen.generate([problems[i]["prompt_ids"] for i in mine], **sampled)
    # fewer completions than asked: an error, not a shape crash
    generator.check_completions(out, len(mine), sampled["n"])
    return {"idx": mine, "completions": out, "gen_s": time.perf_counter() - t0}


def sample_seed(seed, step, round_=0):
    """Sampling seed of step `step`'s generation round `round_` (0: the batch itself, k >= 1: DAPO
    refills)."""
    return seeds.seed(seed, "sample", step, round_)


def round_problems(train, step, round_, ro, seed):
    """Step `step`'s prompts (round 0), or its k-th refill round's: B prompts from a stream of their
    own."""
    return data.step_batch(train, step, ro.prompts_per_step, seed,
                           "order" if round_ == 0 else f"refill_{round_}")


def generate_step(gen, train, step, ro, seed, producer, num_producers, round_=0, poll=None):
    """This producer's share of step `step`'s batch (None on a rank without a generator). poll: an
    in-flight weight update's hook (train_grpo.generator_loop; generator.py)."""
    if gen is None:
        return None
    dist.fault("kill_gen", step)  # test hook: SIGKILL this rank as it starts generating step s
    return generate_share(gen, round_problems(train, step, round_, ro, seed), producer,
                          num_producers, **sampling(ro, ro.group_size, ro.temperature,
                                                    sample_seed(seed, step, round_)),
                          **({"poll": poll} if poll else {}))


def informative(groups, problems, scorer):
    """A round's rewards (B, G), their accuracy part, and which groups carry signal (0 < std), the
    same on every rank; and this rank's own scores. Each trainer scores its data-parallel slice
    (`scorer` -> (first index, rewards, correct, stats), returned as `mine`); one all_gather puts
    the slices together (generator ranks, scorer None, send None)."""
    mine = scorer(groups, problems) if scorer else None
    shares = [mine]
    if tdist.get_world_size() > 1:
        shares = [None] * tdist.get_world_size()
        tdist.all_gather_object(shares, mine)
    r, correct = torch.zeros(len(groups), len(groups[0])), torch.zeros(len(groups), len(groups[0]))
    for lo, r_i, correct_i, _ in filter(None, shares):  # tensor-parallel twins: the same slice
        r[lo:lo + len(r_i)], correct[lo:lo + len(r_i)] = r_i, correct_i
    return ~losses.zero_std_groups(r), r, correct, mine


def refill(gen, train, step, problems, groups, ro, seed, producer, num_producers, scorer=None):
    """DAPO dynamic sampling: up to `rollout.refill_rounds` more rounds until B groups have 0 < std
    (module docstring). Every group is scored once, as its round comes in. Returns the batch,
    informative groups first in the order drawn; on a trainer its slice's rewards, their accuracy
    part (B/dp, G) and reward stats over every round it scored (else None); and what it cost."""
    B, kept, spare, rounds, gen_s = ro.prompts_per_step, [], [], 0, 0.0
    rstats, perf = {}, {}
    while True:
        with metrics.timed(perf, "perf/reward_s"):
            ok, r, correct, mine = informative(groups, problems, scorer)
        for k, v in (mine[3] if mine else {}).items():  # means: averaged over the rounds below
            rstats[k] = rstats.get(k, 0.0) + v
        for i, p in enumerate(problems):
            (kept if ok[i] else spare).append((p, groups[i], r[i], correct[i]))
        if len(kept) >= B or rounds == ro.refill_rounds:
            break
        rounds += 1
        problems = round_problems(train, step, rounds, ro, seed)
        groups, t = collect(generate_step(gen, train, step, ro, seed, producer, num_producers,
                                          rounds), B)
        gen_s += t
    chosen = (kept + spare)[:B]
    scored = None
    if mine:  # a trainer: its data-parallel slice of the chosen groups, as main() slices them
        lo, hi = mine[0], mine[0] + len(mine[1])
        scored = (torch.stack([c[2] for c in chosen])[lo:hi],
                  torch.stack([c[3] for c in chosen])[lo:hi],
                  {k: v / (rounds + 1) if k.endswith("_mean") else v for k, v in rstats.items()})
    stats = {"rollout/refill_rounds": float(rounds),
             "rollout/prompts_drawn": float(B * (rounds + 1)),
             "rollout/informative_groups": float(min(len(kept), B)), **perf}
    return [c[0] for c in chosen], [c[1] for c in chosen], scored, gen_s, stats


def step_rollout(gen, train, step, ro, seed, producer, num_producers, local=None, scorer=None,
                 idle_s=None):
    """Step `step`'s batch on every rank: prompts, generation (or the share made ahead: `local`),
    collected in prompt order, refilled under dynamic sampling. Returns problems, groups, this
    rank's scores when the refill made them already (refill; else None), gen_s, stats. idle_s: a
    dedicated generator's waiting time since its last share, reported with this one (on the
    trainers: perf/gen_idle_s, the most any generator rank waited)."""
    local = local or generate_step(gen, train, step, ro, seed, producer, num_producers)
    if local is not None and idle_s is not None:
        local = {**local, "idle_s": idle_s}
    t0 = time.perf_counter()
    stats = {}
    groups, gen_s = collect(local, ro.prompts_per_step, stats)
    problems = round_problems(train, step, 0, ro, seed)
    stats["perf/wait_s"] = time.perf_counter() - t0
    scored = None
    if ro.filter_zero_std:
        problems, groups, scored, more_s, fill = refill(gen, train, step, problems, groups, ro,
                                                        seed, producer, num_producers, scorer)
        gen_s += more_s
        stats.update(fill)
    return problems, groups, scored, gen_s, stats


def collect(local, num_problems, stats=None):
    """All-gather every producer's share (trainers without a generator send None); order by index.
    stats: gets perf/gen_idle_s when a share reports its generator's idle time (step_rollout).
    One process gathers nothing: gloo would copy the pickle in its own thread, whose OpenMP team
    then outnumbers the cores and makes every later parallel region's threads sleep between regions
    (generation ~30% slower after step 0)."""
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
            if stats is not None and "idle_s" in share:
                stats["perf/gen_idle_s"] = max(stats.get("perf/gen_idle_s", 0.0), share["idle_s"])
    return groups, gen_s


def evaluate(gen, held_out, producer, num_producers, ro, k, seed, reward_fns, step,
             is_trainer=True):
    """Greedy pass@1, and pass@k with k > 0 (eval.pass_k), on the held-out set; generation shared
    by all producers."""
    local = None
    if gen is not None:
        local = generate_share(gen, held_out, producer, num_producers,
                               **sampling(ro, 1, 0.0, seeds.seed(seed, "eval", step)))
        if k:
            local["k"] = generate_share(gen, held_out, producer, num_producers,
                                        **sampling(ro, k, ro.temperature,
                                                   seeds.seed(seed, "pass_k", step)))["completions"]
    greedy, _ = collect(local, len(held_out))
    if k:  # a second collective: generators must take part before they return
        sampled, _ = collect(local and {**local, "completions": local["k"]}, len(held_out))
    if not is_trainer:
        return None
    acc = rewards.reward_name(ro.accuracy)
    acc_only = {acc: reward_fns[acc]}
    _, r, _ = rewards.score(greedy, held_out, acc_only, None, ro)
    out = {"eval/pass@1": float((r >= 1).float().mean())}
    if k:
        _, rk, _ = rewards.score(sampled, held_out, acc_only, None, ro)
        out[f"eval/pass@{k}"] = float((rk >= 1).any(dim=1).float().mean())
    return out
