"""GRPO-family RL post-training on torchrun: one file that reads as the algorithm.

One step (B prompts, G samples each; every shape below is per trainer rank unless it says so):

    prompts --generate--> B*G completions (+ the generator's logprobs, weight version)
            --reward----> R (B, G)       rewards.py, through reward_guard.py: never raises or hangs
            --advantage-> A (B*G, 1) or (B*G, T)   losses.ADVANTAGES, or a user's file.py:fn; with
                                 distill.teacher, a frozen teacher's per-token logprobs (distill.md)
            --ref/old---> ref_logp, old_logp (B*G, T)   no-grad forwards, only when needed
            --update----> ppo_epochs x minibatches x micro-batches, AdamW, grad clip
            --sync------> trainer rank 0 broadcasts the new weights to the generator ranks
With model.lora_rank > 0 (lora.py) only adapters train and sync, the generators fold them into the
base, and the reference is the policy with its adapters off.

Rank roles (dist.py): with `torchrun --nproc_per_node=N`, the last `dist.generator_ranks` ranks
each run one vLLM engine; the others train on a (dp_shard, tp) mesh with FSDP2. With
`generator_ranks = 0` every trainer rank also hosts a generator (1 GPU, or plain `python` on CPU).
This file holds both loops: main() on the trainer ranks and generator_loop() on dedicated generator
ranks, which read one schedule(s) and issue the same collectives in the same order. A step's batch
(prompts, generation, collection, refill, eval) is rollout.py's.
With `rollout.max_staleness = k` the generators run k batches ahead (with `rollout.inflight_updates`
each sync reaches them mid-sequence, at a token boundary); their logprobs then serve as old_logp,
so the PPO ratio is taken against the policy that actually sampled, token by token. A
`loss.correction` (losses.CORRECTIONS: truncated IS, IcePop, masked IS, a geometric-mean mask)
instead weighs each token by pi_old / pi_gen, pi_old being the trainer's own policy: the numeric
gap and staleness.

Deliberate departures from the papers:
- the KL term and loss aggregation follow losses.py's canonical choices (see its docstring);
- micro-batches are weighted by their share of sequences, an approximation for token-mean losses
  when token counts differ between micro-batches (verl and TRL make the same trade);
- DAPO's dynamic sampling refills with at most `rollout.refill_rounds` extra rounds, then masks what
  is left;
- REINFORCE++ whitening uses each data-parallel rank's local batch, not the global one.

Launch lines:
    CPU, one process (default):    python train_grpo.py configs/tiny.py  (colocated torch generator)
    CPU, 1 trainer + 1 vLLM rank:  torchrun --nproc_per_node=2 train_grpo.py configs/tiny.py \
                                       --dist.generator_ranks=1 --rollout.backend=vllm
    1 GPU (colocated):             python train_grpo.py configs/gsm8k_1gpu.py
    8 GPUs (6 train + 2 vLLM):     torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k.py
"""
import inspect
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine (docs/vllm-cpu.md)
import torch

import checks
import config
import data
import dist
import engine
import losses
import lora
import machine
import metrics
import packing
import reward_guard
import rollout
import rewards
import run
import seeds
import weight_sync


# ---------------------------------------------------------------------------------------------
# 1. Config: every knob, with its default. Config files assign onto these; CLI overrides last.
# ---------------------------------------------------------------------------------------------
@dataclass
class Model:
    path: str = ""                  # HF checkpoint dir, a hub name, or "tiny:<dir>" (tiny random
                                    # model, made if missing)
    dtype: str = "auto"             # compute: float32 | bfloat16 (bf16 params, fp32 reduce) | auto:
                                    # bf16 on a GPU; on CPU whichever this machine's matmuls run
                                    # faster (machine.choose_dtype)
    lora_rank: int = 0              # LoRA (docs/lora.md): train rank-r adapters on a frozen base;
                                    # 0 = off, full fine-tuning
    lora_alpha: float = 16.0        # the adapters' scale is lora_alpha / lora_rank
    lora_targets: tuple = lora.TARGETS  # which Linears of each block get adapters
    lora_dropout: float = 0.0       # dropout on the adapters' input, in the update's forward only


@dataclass
class Data:
    name: str = "arith"             # arith | code (synthetic, CPU) | gsm8k | "pkg.module:fn" /
                                    # "file.py:fn", fn(source, split)
    source: str = "openai/gsm8k"    # train split: hub name or local .jsonl/.parquet (gsm8k); any
                                    # string (own loader)
    eval_source: str = ""           # held-out split: "" = `source` with split "test"
    instruction: str = ""           # appended to every gsm8k question (e.g. "put the answer in
                                    # \\boxed{}")
    min_digits: int = 2             # arith: operand size of RL and eval problems
    max_digits: int = 2             # arith: largest operand size
    max_prompt_tokens: int = 512    # longer prompts are dropped or truncated (counted in the log)
    long_prompts: str = "drop"      # drop | truncate (keeps the last tokens: the generation prompt
                                    # survives)
    max_bad_fraction: float = 0.01  # gsm8k: skip malformed rows (counted, first shown); abort above
                                    # this fraction


@dataclass
class Rollout:
    prompts_per_step: int = 32      # B: prompts per optimizer step (global)
    group_size: int = 8             # G: samples per prompt
    temperature: float = 1.0        # sampling temperature; logprobs are of the tempered policy
    top_p: float = 1.0              # nucleus sampling (1.0 = off; logprobs then ignore the
                                    # truncation)
    top_k: int = -1                 # top-k sampling (-1 = off)
    max_tokens: int = 40            # response budget; also DAPO's L_max and Dr.GRPO's C
    backend: str = "auto"           # vllm | torch (pure torch over model.py) | auto: as measured
                                    # (default_backend)
    kv_cache_mb: int = 0            # vLLM KV cache per engine in MB (not a RAM fraction); 0 = one
                                    # step's worth
    gpu_memory_utilization: float = 0.9  # vLLM on CUDA: share of the GPU for weights + KV + graphs,
                                    # checked against free memory at start; colocated it must leave
                                    # the trainer room (e.g. 0.3)
    onednn: bool = True             # torch generator on CPU: large Linears on oneDNN-reordered
                                    # weights, q/k/v and gate/up stacked: the same products,
                                    # whatever code asks for them (machine.OneDNNLinears)
    enforce_eager: bool | None = None  # vLLM: None = eager on CPU, CUDA graphs on GPU (eager decode
                                    # is launch-bound)
    max_staleness: int = 0          # 0 on-policy; k: generate batch s+k while training on s
    inflight_updates: bool = False  # a weight sync reaches dedicated generator ranks mid-sequence:
                                    # unfinished rows go on under the new weights, each token
                                    # tagged with its version (docs/off-policy.md); needs k >= 1
    filter_zero_std: bool = False   # DAPO dynamic sampling: drop groups whose rewards are all
                                    # equal, and refill
    refill_rounds: int = 4          # dynamic sampling: at most this many extra rounds of B prompts
                                    # per step until B groups have 0 < std (0 = drop only; the rest
                                    # is masked out if the cap hits)
    overlong_cache: int = 0         # DAPO soft overlong punishment window L_cache (0 = off)
    rewards: dict = field(default_factory=lambda: {"math": 1.0})  # name -> weight, or {"weight": w,
                                    # **kwargs}: math|think|format|code | "pkg.module:Name" |
                                    # "path/file.py:Name" (see rollout.py)
    accuracy: str = "math"          # the reward whose 1.0 is "correct": rollout/accuracy and eval
                                    # pass@k (code: "code")
    reward_timeout_s: float = 2.0   # a reward call past this scores 0 and is counted
    reward_workers: int = 0         # >0: score in a killable process pool (survives C-level hangs)
    env: str | dict = ""            # multi-turn (envs.py, episodes.py): calculator | retry | guess
                                    # | "file.py:Class", or {"name": ..., **kwargs}; "" =
                                    # single-turn
    max_turns: int = 4              # multi-turn: sampled replies per episode at most
    max_episode_tokens: int = 256   # multi-turn: ids after the opening prompt (replies and env
                                    # turns); a turn is played only if its whole max_tokens still
                                    # fits
    max_env_chars: int = 1000       # multi-turn: each env message is cut to this many characters
    env_timeout_s: float = 2.0      # multi-turn: an env.step past this ends its episode as an error
                                    # (scored 0)


@dataclass
class Loss:
    name: str = "grpo"              # a key of losses.LOSSES (grpo, dr_grpo, dapo, cispo, gspo, ...)
                                    # or "file.py:Class"
    kwargs: dict = field(default_factory=dict)  # passed to the loss class, e.g. {"beta": 0.0}
    adv: str = "grpo"               # advantage estimator: a key of losses.ADVANTAGES (grpo |
                                    # dr_grpo | rloo | reinforce_pp) or "file.py:fn", fn(rewards,
                                    # batch) -> (B, G) or (B*G, T)
    adv_eps: float = 1e-6           # std guard of the z-score estimators (those that take `eps`)
    correction: str = ""            # off-policy correction of the advantages per token, from
                                    # rho = pi_old / pi_gen (losses.CORRECTIONS: tis | seq_tis |
                                    # icepop | seq_mis | geo_mask, or "file.py:fn"); "" = off
    correction_c: float = 2.0       # its threshold C: tis caps rho at C, icepop keeps [1/C, C],
                                    # seq_mis rejects prod rho > C, geo_mask wants ~1.001
    entropy_coef: float = 0.0       # entropy bonus (subtracted from the loss)


@dataclass
class Distill:
    teacher: str = ""               # on-policy distillation (docs/distill.md): a frozen teacher, as
                                    # model.path takes it (a checkpoint dir, hub name or
                                    # "tiny:<dir>@<seed>"), with the student's tokenizer; "" = off
    coef: float = 1.0               # per-token advantage coef * (teacher_logp - gen_logp), both at
                                    # rollout.temperature (losses.distill_advantages)
    reward_weight: float = 0.0      # > 0: plus this times loss.adv's advantage of the task reward
                                    # (0: pure distillation; a group of 1 sample is then allowed)


@dataclass
class Optim:
    lr: float = 3e-4                # peak learning rate (AdamW)
    betas: tuple = (0.9, 0.99)      # AdamW (beta1, beta2)
    weight_decay: float = 0.0       # AdamW decoupled weight decay
    warmup_steps: int = 0           # linear warmup from 0
    schedule: str = "constant"      # constant | cosine (to min_lr_ratio * lr)
    min_lr_ratio: float = 0.1       # cosine: final lr = min_lr_ratio * lr
    grad_clip: float = 1.0          # global grad-norm clip (over all FSDP/TP shards)


@dataclass
class Train:
    steps: int = 200                # optimizer steps (one rollout batch each)
    seed: int = 0                   # data order, sampling and init all derive from (seed, step)
    ppo_epochs: int = 1             # passes over each rollout batch
    minibatches: int = 1            # optimizer steps per epoch = minibatches
    micro_batch: int = 64           # sequences per forward/backward (gradient accumulation)
    max_skipped_steps: int = 5      # consecutive non-finite steps before the run aborts
    deterministic: bool = False     # torch.use_deterministic_algorithms (slower)


@dataclass
class Dist:
    generator_ranks: int = 1        # last N ranks run vLLM; 0 = colocated on every trainer rank
    tp: int = 1                     # tensor parallel degree inside the trainer mesh
    sync_interval: int = 1          # sync weights to generators every N steps
    sync_bucket_mb: int = 64        # broadcast bucket size
    timeout_s: float = 600.0        # every collective; a dead rank surfaces within this
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, one
                                    # more forward
    compile: bool = False           # torch.compile each block's training and scoring forwards
                                    # (decode stays eager): on a GPU ~2x faster updates after ~40 s
                                    # of compiling (docs/gpu.md); not with tp


@dataclass
class Eval:
    every: int = 50                 # steps between evals (0 = only at start and end)
    num_problems: int = 500         # held-out problems, greedy pass@1
    pass_k: int = 0                 # >0: also pass@k with k samples at rollout temperature


@dataclass
class Log:
    run: str = "grpo"               # outputs go to <out_dir>/<run>/: metrics.jsonl, prompts.jsonl
                                    # (each step's prompt ids: what a resume must replay),
                                    # config.json, curves.png, ckpt/, hf/
    out_dir: str = "out"            # outputs under <out_dir>/<run>/
    plot_every_s: float = 60.0      # refresh the PNG plots at most this often (wall s; a plot costs
                                    # ~1 s; -1 never)
    wandb: bool = False             # W&B (optional extra: make extras); WANDB_MODE=offline works
                                    # offline
    wandb_project: str = "nanoforge"  # W&B project
    tensorboard: bool = False       # TensorBoard event files in <out_dir>/<run>/tb (optional extra:
                                    # make extras)
    drift: bool = False             # how far each update moved the policy (drift/*): one more
                                    # no-grad forward a step, and a frozen copy of the start weights
                                    # when there is no reference model


@dataclass
class Ckpt:
    every: int = 0                  # checkpoint every N steps (0 = off)
    resume: str = ""                # "" | "auto" (newest complete checkpoint) | a checkpoint dir


def parse_config(argv):
    sections = dict(model=Model(), data=Data(), rollout=Rollout(), loss=Loss(), distill=Distill(),
                    optim=Optim(), train=Train(), dist=Dist(), eval=Eval(), log=Log(), ckpt=Ckpt())
    return SimpleNamespace(**run.parse_cli(sections, argv))  # cfg.loss.beta, not cfg["loss"].beta


# ---------------------------------------------------------------------------------------------
# 2. Data, advantages, the update (prompts, generation, rewards and eval: rollout.py)
# ---------------------------------------------------------------------------------------------
@dataclass
class StepData:
    """One step's data on this rank, filled in as main() goes: its B/dp problems and their G
    completions each, the rewards r (B/dp, G) and the accuracy reward's part, the batch
    (packing.make_batch: ids (B/dp*G, P+R), mask (B/dp*G, R), the sampler's logprobs gen_logp; a
    teacher's), the advantages (B/dp*G, 1) or (B/dp*G, T), and the no-grad logprobs the loss takes
    beside the policy's: the reference's, pi_old's."""
    problems: list
    groups: list
    r: torch.Tensor
    correct: torch.Tensor
    batch: dict
    adv: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None

    @property
    def lengths(self):  # (B/dp, G) response tokens
        return torch.tensor([[len(c.token_ids) for c in g] for g in self.groups],
                            dtype=torch.float32)


def advantages(r, batch, lengths, cfg):
    """(B, G) rewards -> advantages (B*G, 1), one per sequence, or (B*G, T), one per token:
    whichever the estimator `loss.adv` returns (losses.py: ADVANTAGES). DAPO's overlong shaping is
    added to the reward first. With a teacher (distill.teacher), on-policy distillation's per-token
    coef * (teacher_logp - gen_logp), plus distill.reward_weight times the estimator's."""
    d = cfg.distill
    if d.teacher:
        kl = losses.distill_advantages(batch["teacher_logp"], batch["gen_logp"], batch["mask"],
                                       d.coef)
        if not d.reward_weight:  # pure distillation: no group baseline, the rewards unused
            return kl
    if cfg.rollout.overlong_cache:
        r = r + losses.overlong_penalty(lengths, cfg.rollout.max_tokens, cfg.rollout.overlong_cache)
    estimator = config.named(cfg.loss.adv, losses.ADVANTAGES, "loss.adv", "estimator")
    kw = {"eps": cfg.loss.adv_eps} if "eps" in inspect.signature(estimator).parameters else {}
    adv = torch.as_tensor(estimator(r, batch, **kw), dtype=torch.float32).detach().cpu()
    n, T = batch["mask"].shape
    if adv.numel() not in (n, n * T):
        raise ValueError(f"loss.adv={cfg.loss.adv!r} returned advantages of shape "
                         f"{tuple(adv.shape)}: expected {tuple(r.shape)} (one per sequence) or "
                         f"({n}, {T}) (one per token, batch['mask']'s)")
    adv = adv.reshape(n, -1)
    return kl + d.reward_weight * adv if d.teacher else adv


def update(model, opt, sched, loss_fn, st, cfg, device, step, correction=None):
    """ppo_epochs x minibatches optimizer steps on this rank's batch: micro-batches -> loss ->
    backward -> clip -> step. Returns the update's mean metrics, the number of skipped (non-finite)
    steps, and each row's logp from epoch 0 (the policy before any step when there is one
    minibatch)."""
    batch, adv, ref_logp, old_logp = st.batch, st.adv, st.ref_logp, st.old_logp
    n, tr = len(batch["ids"]), cfg.train
    mb_size, sums, tokens, num_opt, skipped = math.ceil(n / tr.minibatches), {}, {}, 0, 0
    first_logp = torch.zeros_like(batch["gen_logp"])
    # minibatch order from (seed, step), like everything else random: a resumed run draws the same
    # permutations
    rng = torch.Generator().manual_seed(seeds.seed(tr.seed, "minibatch", step))
    for epoch in range(tr.ppo_epochs):
        perm = torch.randperm(n, generator=rng) if tr.minibatches > 1 else torch.arange(n)
        for mb_rows in perm.split(mb_size):
            for rows in mb_rows.split(tr.micro_batch):
                # these rows, on device
                at = lambda x: None if x is None else x[rows].to(device)  # noqa: E731
                logp, ent = packing.response_logp(model, batch, rows, cfg.rollout.temperature,
                                                  entropy=True,
                                                  stats=tokens)  # tokens: computed, real, FLOPs
                mask = at(batch["mask"])
                if epoch == 0:
                    first_logp[rows] = logp.detach().cpu()
                mb_adv = at(adv).expand_as(logp)  # (rows, 1) or (rows, T) -> (rows, T)
                mb_adv, is_stats = corrected(mb_adv, correction, logp, at(old_logp),
                                             at(batch["gen_logp"]), mask, cfg.loss.correction_c)
                loss, stats = loss_fn(logp, at(ref_logp), mb_adv, mask,
                                      old_logprobs=at(old_logp))
                # test hook: this step's loss is NaN (tests/test_faults.py)
                loss = dist.fault_nan(loss, step)
                stats["loss/entropy"] = losses.masked_mean(ent.detach(), mask)
                stats.update(is_stats)
                if cfg.loss.entropy_coef:
                    loss = loss + losses.entropy_bonus(ent, mask, cfg.loss.entropy_coef)
                (loss * len(rows) / len(mb_rows)).backward()
                stats["loss/total"] = loss.detach()
                accumulate(sums, stats, len(rows) / n)
            # global norm over FSDP/TP shards
            gnorm = dist.clip_grad_norm_(model, cfg.optim.grad_clip)
            # test hook: SIGKILL with gradients computed, before the step
            dist.fault("kill_opt", step)
            skipped += run.step_if_finite(opt, gnorm)
            accumulate(sums, {"train/grad_norm": gnorm}, 1.0)
            num_opt += 1
    sched.step()
    sums = {k: float(v) / tr.ppo_epochs for k, v in sums.items()}
    sums["train/grad_norm"] *= tr.ppo_epochs / num_opt
    # forwards + backwards (packing.forward_flops)
    sums["perf/update_gflop"] = 3 * tokens["flops"] / 1e9
    # computed / real (packing.py)
    sums["perf/pad_frac"] = tokens["tokens"] / max(tokens["real_tokens"], 1)
    return sums, skipped, first_logp


def corrected(adv, rule, logp, old_logp, gen_logp, mask, c):
    """loss.correction: the advantages times the rule's weight per token, from rho = pi_old /
    pi_gen (losses.CORRECTIONS; pi_old is sg(logp) when old_logp is None), and what it did: the
    mean weight, the share of real tokens capped at C and the share masked (weight 0)."""
    if rule is None:
        return adv, {}
    w = losses.correction_weights(rule, logp.detach() if old_logp is None else old_logp,
                                  gen_logp, mask, c)
    return adv * w, {
        "loss/is_weight_mean": losses.masked_mean(w, mask),
        "loss/is_capped_frac": losses.masked_mean((w >= c * (1 - 1e-6)).float(), mask),
        "loss/is_masked_frac": losses.masked_mean((w == 0).float(), mask)}


def accumulate(sums, stats, w):
    """sums[k] += w * stats[k], kept as tensors: no host sync per micro-batch (one float() per
    metric a step)."""
    for k, v in stats.items():
        sums[k] = sums.get(k, 0.0) + v.detach() * w


@dataclass(frozen=True)
class Plan:
    """What happens at step s besides its update. One function decides it (`schedule`) for both
    loops, main() and generator_loop(), which must issue the same collectives in the same order."""
    ahead: tuple  # the later batches to generate before the update on batch s, by the current
                  # weights (version s): rollout.max_staleness = k gives s+k (s+1..s+k at a run's
                  # first step, resumed or not)
    sync: bool   # weights to the generators after the update: every dist.sync_interval steps, and
                 # before an eval
    eval: bool   # held-out eval after the update: every eval.every steps, and after the last
    ckpt: bool   # a checkpoint after the step, every ckpt.every steps (trainer ranks only)


def schedule(s, cfg, start=0) -> Plan:
    ev, k = run.eval_due(s, cfg), cfg.rollout.max_staleness
    first = s + 1 if s == start else max(s + k, s + 1)  # a run's first step fills the pipeline
    return Plan(ahead=tuple(range(first, min(s + k, cfg.train.steps - 1) + 1)),
                sync=(s + 1) % cfg.dist.sync_interval == 0 or ev, eval=ev,
                ckpt=run.checkpoint_due(s + 1, cfg))


def receiver(gen, version, merge=None):
    """Where a weight sync's tensors go on this rank: into its engine, as weight version `version`
    (optimizer steps taken); None where there is no engine. merge: with LoRA the sync carries the
    adapters, and lora.Merger folds them into the base weights the engine loads."""
    if gen is None:
        return None
    return lambda named: gen.update_weights(merge(named) if merge else named, version)


# the per-step line
SHOWN = ("step", "rollout/reward_mean", "rollout/accuracy", "loss/total", "loss/kl",
         "rollout/response_len", "mismatch/abs_diff", "perf/step_s", "eval/pass@1")
# said on a skipped step
STATS = ("loss/total", "train/grad_norm", "rollout/reward_mean", "rollout/response_len")


def main(argv=None):
    # ---- 1. config: parsed and validated before anything heavy happens ---------------------------
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_config(argv)
    checks.grpo(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    if run.print_config(cfg, argv):  # --print-config: nothing is loaded
        return
    path = run.resolve_model(cfg.model.path)
    # on-policy distillation: the teacher scores the student's token ids, so one vocabulary
    teacher_path = cfg.distill.teacher and run.resolve_model(cfg.distill.teacher, "distill.teacher")
    if teacher_path:
        checks.same_vocab(path, teacher_path)
    backend = engine.resolve_backend(cfg, path)  # which GPU an engine takes
    # pins GPUs: before CUDA
    roles = dist.get_roles(cfg.dist.generator_ranks, colocated_engine=backend == "vllm")
    # "auto": measured here, before the engine or the model is built
    machine.resolve_dtype(cfg, say=roles.rank == 0)
    torch.manual_seed(cfg.train.seed)
    torch.use_deterministic_algorithms(cfg.train.deterministic)
    out = Path(cfg.log.out_dir, cfg.log.run)
    ro, seed = cfg.rollout, cfg.train.seed
    B, G, temp = ro.prompts_per_step, ro.group_size, ro.temperature

    # ---- 2. dist init: a vLLM engine must exist before this process joins the world -------------
    tok = data.Tokenizer(path)
    # before the engine: the longest prompt sizes its KV
    train, held_out, num_dropped = rollout.load_tasks(cfg, tok)
    gen = None
    # multi-turn (rollout.env): an engine that plays episodes
    if roles.is_generator or roles.colocated:
        gen = engine.build_generator(cfg, path, roles, tok,
                                     max(len(p["prompt_ids"]) for p in train + held_out))
    dist.init_distributed(roles, cfg.dist.timeout_s)
    dist.agree("model.dtype", cfg.model.dtype)  # every rank measured its own "auto"
    mesh = dist.trainer_mesh(roles, len(roles.trainer_ranks) // cfg.dist.tp, cfg.dist.tp)
    group = weight_sync.sync_group(roles)
    reward_fns, weights = rewards.make_rewards(ro)
    pool = reward_guard.RewardPool(reward_fns, workers=ro.reward_workers) \
        if ro.reward_workers and roles.is_trainer else None
    ckpt_path, start = run.find_resume(cfg.ckpt.resume, out / "ckpt", cfg.train.steps, roles.rank)
    lora_rank = cfg.model.lora_rank  # LoRA: what syncs is the adapters, merged where they arrive
    merge = lora.Merger(path, lora_rank, cfg.model.lora_alpha) if lora_rank and gen else None
    # a dedicated generator rank: generator_loop, below main, is its whole life
    if roles.is_generator:
        generator_loop(gen, roles, group, cfg, train, held_out, reward_fns, start, merge)
        return dist.shutdown()

    # ---- 3. models and optimizer (trainer ranks; the reference model only when beta > 0) --------
    # frozen models score the batch's tokens with no grad, sharded like the policy: the reference
    # and the distillation teacher
    model = run.load_model(path, roles.device, mesh, cfg, adapters=cfg.model if lora_rank else None)
    loss_fn = config.named(cfg.loss.name, losses.LOSSES, "loss.name", "loss")(
        **checks.loss_kwargs(cfg))
    correction = (config.named(cfg.loss.correction, losses.CORRECTIONS, "loss.correction",
                               "correction") if cfg.loss.correction else None)
    # log.drift measures against the start weights too; with LoRA they are the policy's own base
    # (adapters off): no second copy
    kl_in_loss = getattr(loss_fn, "beta", 0.0) > 0
    ref = None
    if kl_in_loss or cfg.log.drift:
        ref = (lora.Base(model) if lora_rank
               else run.load_model(path, roles.device, mesh, cfg, frozen=True))
    teacher = (run.load_model(teacher_path, roles.device, mesh, cfg, frozen=True)
               if teacher_path else None)
    opt, sched = run.make_optimizer(model, cfg.optim, cfg.train.steps)
    # a resume restores model, optimizer, schedule, counters; data order and sampling seeds derive
    # from the step
    skipped_total, skipped_run = run.restore(ckpt_path, model, opt, sched)
    if ckpt_path:  # the generators take the restored weights before they generate anything
        weight_sync.broadcast_weights(model, group, roles, cfg.dist.sync_bucket_mb,
                                      receiver(gen, start, merge))
    dp_rank, dp = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()
    producer, num_producers = roles.trainer_ranks.index(roles.rank), len(roles.trainer_ranks)
    log = metrics.RunLog(cfg, out, start, roles.rank == 0, SHOWN,
                         logs=("metrics.jsonl", "prompts.jsonl"))
    num_failed_saves, pending = 0, {}  # {step: this rank's share of it, generated ahead}
    lo, hi = dp_rank * B // dp, (dp_rank + 1) * B // dp  # this rank's data-parallel groups

    def scorer(groups, problems):  # this rank's slice of B groups: (lo, rewards, correct, stats)
        return lo, *rewards.score(groups[lo:hi], problems[lo:hi], reward_fns, weights, ro, pool)
    if start == 0:
        ev = rollout.evaluate(gen, held_out, producer, num_producers, ro, cfg.eval.pass_k, seed,
                              reward_fns, 0)
        log.step({"step": 0, **ev}, progress=False)

    # ---- 4. the loop: generator_loop (below) issues the same collectives, in the same order ------
    for s in range(start, cfg.train.steps):
        t_step, perf, plan = time.perf_counter(), {}, schedule(s, cfg, start)
        # 4a-b. prompts, a pure function of (seed, step); colocated trainers generate their share
        # (or did, k steps ahead), dedicated ones wait for the generators; DAPO's filter refills
        # the batch (rollout.py). Stale and colocated: batch s+k is sampled now, before the update
        problems, groups, scored, perf["perf/gen_s"], fill = rollout.step_rollout(
            gen, train, s, ro, seed, producer, num_producers, pending.pop(s, None), scorer)
        for j in plan.ahead:
            pending[j] = rollout.generate_step(gen, train, j, ro, seed, producer, num_producers)
        prompt_ids = [p["id"] for p in problems]  # to prompts.jsonl: which data each step saw
        perf.update(fill)
        # 4c. rewards (B/dp, G): the weighted total, and the accuracy reward's part (DAPO's refill
        # scored each round as it came in)
        with metrics.timed(perf, "perf/reward_s"):
            r, correct, rstats = scored or scorer(groups, problems)[1:]
        # 4d. this rank's step data (StepData): the batch; a teacher's logprobs of its tokens
        # (distill.teacher); the advantages; DAPO's filter zeroes the mask of groups without signal
        st = StepData(problems[lo:hi], groups[lo:hi], r, correct,
                      packing.make_batch(problems[lo:hi], groups[lo:hi], tok.pad_token_id))
        batch = st.batch
        batch.update({k: batch[k].to(roles.device) for k in ("ids", "attn", "prompt")})
        if teacher is not None:
            with metrics.timed(perf, "perf/teacher_s"):
                batch["teacher_logp"] = packing.no_grad_logp(teacher, batch,
                                                             cfg.train.micro_batch, temp).cpu()
            rstats = {**rstats, "distill/reverse_kl": float(losses.masked_mean(
                batch["gen_logp"] - batch["teacher_logp"], batch["mask"]))}
        st.adv = advantages(r, batch, st.lengths, cfg)
        if ro.filter_zero_std:
            batch["mask"] *= (~losses.zero_std_groups(r)).float().repeat_interleave(G)[:, None]
        # 4e. reference and old logprobs (no grad), only when the loss needs them. pi_old: the
        # sampler's logprobs when stale (the PPO ratio is taken against what sampled); on-policy
        # with one optimizer step, sg(logp) inside the loss; with several, the policy before them,
        # scored once. With a loss.correction, pi_old is the trainer's own policy even when stale
        # (decoupled PPO: the clip bounds the update, the correction weighs pi_old / pi_gen; with
        # one optimizer step the ratio is 1 and only the correction acts: docs/off-policy.md). With
        # minibatches > 1 it is scored even when stale: mismatch and drift measure against it (4h)
        with metrics.timed(perf, "perf/ref_s"):
            ref_logp = (packing.no_grad_logp(ref, batch, cfg.train.micro_batch, temp)
                        if ref is not None else None)
        with metrics.timed(perf, "perf/old_s"):
            stale, tr = ro.max_staleness > 0, cfg.train
            own_old = not stale or correction is not None
            pre_logp = (packing.no_grad_logp(model, batch, tr.micro_batch, temp)
                        if tr.minibatches > 1 or (own_old and tr.ppo_epochs > 1) else None)
            st.old_logp = pre_logp if own_old else batch["gen_logp"]
        st.ref_logp = ref_logp if kl_in_loss else None
        # 4f. policy update: ppo_epochs x minibatches x micro-batches
        with metrics.timed(perf, "perf/train_s"):
            if roles.colocated and gen is not None:  # GPU: the engine's memory freed (CPU: none)
                gen.sleep(keep_weights=not plan.sync)  # new weights follow: no need to keep the old
            stats, skipped, first_logp = update(model, opt, sched, loss_fn, st, cfg, roles.device,
                                                s, correction)
        train_logp = first_logp if pre_logp is None else pre_logp.cpu()  # before this update
        perf["perf/update_gflops"] = stats["perf/update_gflop"] / max(perf["perf/train_s"], 1e-9)
        if cfg.log.drift:
            stats.update(metrics.drift(model, batch, train_logp, ref_logp, cfg))
        stats.update(metrics.mismatch(train_logp, batch["gen_logp"], batch["mask"]))
        skipped_total += skipped
        skipped_run = skipped_run + 1 if skipped else 0  # the run aborts after logging, see 4h
        # 4g. weight sync: trainer rank 0 -> generators (colocated: into this rank's engine)
        sync = {}
        with metrics.timed(perf, "perf/sync_s"):
            if plan.sync:
                if ro.inflight_updates:  # the generators take it at their next token boundary
                    weight_sync.announce(roles, s + 1)
                sync = weight_sync.broadcast_weights(model, group, roles, cfg.dist.sync_bucket_mb,
                                                     receiver(gen, s + 1, merge))
            if roles.colocated and gen is not None:
                gen.wake_up()  # whatever still sleeps; after a sync nothing does (generator.py)
        # 4h. metrics (averaged over data-parallel ranks), eval, checkpoint, log
        dropped = ("data/dropped_prompts" if cfg.data.long_prompts == "drop"
                   else "data/truncated_prompts")
        row = metrics.dp_mean({
            **stats, **rstats, **sync, **perf,
            **metrics.rollout_stats(st, s, ro.env, ro.max_staleness),
            "train/lr": sched.get_last_lr()[0], "train/skipped_steps": float(skipped_total),
            dropped: float(num_dropped)}, mesh["dp_shard"].get_group(), dp)
        if plan.eval:
            with metrics.timed(row, "perf/eval_s"):
                row.update(rollout.evaluate(gen, held_out, producer, num_producers, ro,
                                            cfg.eval.pass_k, seed, reward_fns, s + 1))
        abort = skipped_run >= cfg.train.max_skipped_steps
        if plan.ckpt and not abort:  # not on a step that aborts the run
            num_failed_saves += run.save_checkpoint(out, s + 1, model, opt, sched,
                                                    (skipped_total, skipped_run))
        row["ckpt/failed_saves"] = float(num_failed_saves)
        row["perf/step_s"] = time.perf_counter() - t_step
        row["perf/tokens_per_s"] = float(st.lengths.sum()) * dp / max(row["perf/step_s"], 1e-9)
        row["step"] = s + 1
        log.append("prompts.jsonl", {"step": s + 1, "ids": prompt_ids})
        metrics.finish_step(log, row, skipped, skipped_run, cfg.train.max_skipped_steps, STATS,
                            last=s + 1 == cfg.train.steps)

    # ---- 5. export the final policy as a Hugging Face checkpoint that vLLM opens -----------------
    run.export(model, out, cfg, path)  # with LoRA: merged, and the adapter alone (PEFT's format)
    log.close()
    dist.shutdown()


def generator_loop(gen, roles, group, cfg, train, held_out, reward_fns, start, merge):
    """A dedicated generator rank: main()'s collectives, in main()'s order, with generation between.
    A collective added to one loop and not the other hangs the run until dist.timeout_s."""
    producer, num_producers = roles.generator_ranks.index(roles.rank), len(roles.generator_ranks)
    ro, seed, k = cfg.rollout, cfg.train.seed, cfg.eval.pass_k
    if start > 0:  # resumed: take the restored weights before generating anything (main: restore)
        weight_sync.broadcast_weights(None, group, roles, cfg.dist.sync_bucket_mb,
                                      receiver(gen, start, merge))
    if start == 0:  # main: the step-0 eval
        rollout.evaluate(gen, held_out, producer, num_producers, ro, k, seed, reward_fns, 0,
                         is_trainer=False)
    pending, idle = {}, 0.0  # idle: seconds waiting for the trainers since the last share
    for s in range(start, cfg.train.steps):
        plan = schedule(s, cfg, start)
        *_, got = rollout.step_rollout(gen, train, s, ro, seed, producer, num_producers,
                                       pending.pop(s, None), idle_s=idle)  # 4a-b
        idle = got["perf/wait_s"]  # this rank's share was ready: the trainers were still busy
        # main: 4g, the new weights (v = s + 1). In flight, a token boundary of the generation
        # below takes them when the trainers announce them (weight_sync.announce); else, or if
        # the generation ends first, after it: the wait for the update, the transfer and the load
        flag = (weight_sync.Announced(s + 1, cfg.dist.timeout_s)
                if plan.sync and ro.inflight_updates else None)
        synced = not plan.sync

        def sync(wait=True):
            nonlocal idle, synced
            t0 = time.perf_counter()
            if synced or (flag is not None and not flag.arrived(wait)):
                return False
            weight_sync.broadcast_weights(None, group, roles, cfg.dist.sync_bucket_mb,
                                          receiver(gen, s + 1, merge))
            idle, synced = idle + time.perf_counter() - t0, True
            return True
        # staleness k: batch s+k is generated now, with the weights that produced batch s's
        # refill rounds (in flight, the newer ones from the token the sync lands on), while the
        # trainers update on batch s
        for j in plan.ahead:
            pending[j] = rollout.generate_step(gen, train, j, ro, seed, producer, num_producers,
                                               poll=(lambda: sync(wait=False)) if flag else None)
        sync()
        if plan.eval:  # main: 4h
            rollout.evaluate(gen, held_out, producer, num_producers, ro, k, seed, reward_fns,
                             s + 1, is_trainer=False)
    print(f"generator rank {roles.rank}: done, weight version {gen.version} after "
          f"{cfg.train.steps} steps", flush=True)


if __name__ == "__main__":
    run.run_main(main)
