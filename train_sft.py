"""Supervised fine-tuning (SFT) on chat data: one file that reads as the algorithm, skeleton shared with GRPO.

One step (N examples, global; shapes are per trainer rank):

    examples --chat template--> ids, loss_mask per document   data.sft_example: 1 on assistant tokens + end-of-turn
             --pack---------->  rows (R, L): documents back to back, positions restart at 0 per document
             --update-------->  micro-batches, loss = -sum(mask * logp) / num_tokens(global), AdamW, grad clip

The loss is the token mean over every assistant token of the step on all ranks: each micro-batch adds its
masked sum divided by the step's global token count, so neither gradient accumulation nor data parallelism
changes the gradient (FSDP2 averages over ranks, hence the factor dp).

Packing without cross-contamination: model.py reads positions that restart at 0 (with no attention_mask) as
document boundaries and builds a block-diagonal causal mask, so a token attends only within its document, at
its position in that document: a packed row gives exactly the losses of its documents run one by one
(tests/test_train_sft.py checks this to 1e-5). A row's tail padding is a document of its own with mask 0.

Step s's examples are a pure function of (seed, s) (fresh problems for the synthetic task, a fixed permutation
per epoch for datasets), so resuming at step s continues the data order exactly.

Eval: held-out token-mean loss and greedy pass@1 with generator.TorchGenerator over the trainer's own model
(no vLLM). With `eval.stop_at_accuracy`, training stops at the first eval at or after `eval.min_step` whose
pass@1 reaches the target: SFT's accuracy jumps at a seed-dependent step (tiny-task.md), so a fixed step
count gives RL unpredictable starting points.

Deliberate departures from common SFT recipes:
- every rank generates the whole eval set: FSDP2 needs every rank in every forward, and a rank's greedy
  decode stops when its own rows are done. The work is duplicated, not split; fine for an occasional eval.
- examples longer than data.max_seq_tokens are truncated (counted), not dropped;
- packing is first-fit in data order (no sorting by length), so rows stay a pure function of the step.

Launch lines:
    CPU, one process:              python train_sft.py configs/sft_tiny.py
    CPU, 2 ranks (FSDP2, gloo):    torchrun --nproc_per_node=2 train_sft.py configs/sft_tiny.py
    1 GPU (~7 packed rows/step):   python train_sft.py configs/sft_gsm8k.py
    8 GPUs (FSDP2):                torchrun --nproc_per_node=8 train_sft.py configs/sft_gsm8k.py
"""
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as tdist

import config
import data
import dist
import generator
import rewards
import run


# ---------------------------------------------------------------------------------------------
# 1. Config: every knob, with its default. Config files assign onto these; CLI overrides last.
# ---------------------------------------------------------------------------------------------
@dataclass
class Model:
    path: str = ""                  # HF checkpoint dir (config.json + safetensors) or a hub name
    dtype: str = "float32"          # trainer params: float32 | bfloat16 (bf16 params, fp32 reduce)
    make_tiny: bool = False         # create a tiny random checkpoint at `path` if missing (CPU)


@dataclass
class Data:
    name: str = "arith"             # arith (synthetic, CPU) | gsm8k
    source: str = "openai/gsm8k"    # gsm8k train split: hub name or local .jsonl/.parquet
    eval_source: str = ""           # gsm8k held-out split: "" = the hub's test split
    instruction: str = ""           # appended to every question
    min_digits: int = 1             # arith: operand size of the training problems
    max_digits: int = 2
    eval_min_digits: int = 2        # arith: operand size of the held-out problems (what GRPO trains on)
    eval_max_digits: int = 2
    pack_len: int = 512             # tokens per packed row; 0 = one example per (padded) row
    max_seq_tokens: int = 512       # longer examples are truncated (counted in the log)
    max_bad_fraction: float = 0.01  # gsm8k: skip malformed rows (counted, first shown); abort above this fraction


@dataclass
class Optim:
    lr: float = 2e-5
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"        # constant | cosine (to min_lr_ratio * lr)
    min_lr_ratio: float = 0.1
    schedule_steps: int = 0         # cosine horizon; 0 = train.steps (set it when stopping early by design)
    grad_clip: float = 1.0


@dataclass
class Train:
    steps: int = 1000               # optimizer steps
    seed: int = 0
    batch_size: int = 64            # N: examples per optimizer step (global)
    micro_batch: int = 8            # packed rows per forward/backward (gradient accumulation)
    max_skipped_steps: int = 5      # consecutive non-finite steps before the run aborts
    deterministic: bool = False     # torch.use_deterministic_algorithms (slower)


@dataclass
class Dist:
    tp: int = 1                     # tensor parallel degree inside the trainer mesh
    timeout_s: float = 600.0        # every collective; a dead rank surfaces within this
    activation_checkpointing: bool = False


@dataclass
class Eval:
    every: int = 100                # steps between evals (0 = only at start and end)
    num_problems: int = 200         # held-out problems: token-mean loss and greedy pass@1
    max_tokens: int = 40            # generation budget of the greedy eval
    stop_at_accuracy: float = 0.0   # >0: stop at the first eval (step >= min_step) with pass@1 >= this
    min_step: int = 0


@dataclass
class Log:
    run: str = "sft"                # outputs go to <out_dir>/<run>/ (nested names like demo/sft work)
    out_dir: str = "out"
    plot_every: int = 25            # refresh PNG plots every N steps
    wandb: bool = False             # needs `pip install wandb`; WANDB_MODE=offline works offline


@dataclass
class Ckpt:
    every: int = 0                  # checkpoint every N steps (0 = off)
    resume: str = ""                # "" | "auto" (newest complete checkpoint) | a checkpoint dir


def parse_config(argv):
    sections = dict(model=Model(), data=Data(), optim=Optim(), train=Train(), dist=Dist(), eval=Eval(),
                    log=Log(), ckpt=Ckpt())
    return SimpleNamespace(**config.parse(sections, argv))  # cfg.optim.lr, not cfg["optim"].lr


def validate(cfg, world_size):
    """Cross-field checks, before anything heavy is loaded."""
    err = config.ConfigError
    if world_size % cfg.dist.tp:
        raise err(f"dist.tp={cfg.dist.tp} does not divide the world size {world_size}")
    dp = world_size // cfg.dist.tp
    if cfg.train.batch_size % dp:
        raise err(f"train.batch_size={cfg.train.batch_size} is not divisible by the data-parallel size {dp}")
    if cfg.data.name not in ("arith", "gsm8k"):
        raise err(f"data.name: {cfg.data.name!r} is not arith or gsm8k")
    if cfg.optim.schedule not in ("constant", "cosine"):
        raise err(f"optim.schedule: {cfg.optim.schedule!r} is not constant or cosine")
    for name, v in [("train.steps", cfg.train.steps), ("train.batch_size", cfg.train.batch_size),
                    ("train.micro_batch", cfg.train.micro_batch), ("eval.num_problems", cfg.eval.num_problems),
                    ("eval.max_tokens", cfg.eval.max_tokens), ("data.max_seq_tokens", cfg.data.max_seq_tokens)]:
        if v < 1:
            raise err(f"{name}={v} must be >= 1")
    if cfg.data.pack_len and cfg.data.pack_len < cfg.data.max_seq_tokens:
        raise err(f"data.pack_len={cfg.data.pack_len} must be 0 or >= data.max_seq_tokens={cfg.data.max_seq_tokens}")
    if not 0 <= cfg.eval.stop_at_accuracy <= 1:
        raise err(f"eval.stop_at_accuracy={cfg.eval.stop_at_accuracy} must be in [0, 1] (0 = off)")
    for name, ok, need in [  # (field, valid?, what it must be): every message names its field and value
            ("optim.lr", cfg.optim.lr > 0, "> 0"), ("optim.grad_clip", cfg.optim.grad_clip > 0, "> 0"),
            ("optim.weight_decay", cfg.optim.weight_decay >= 0, ">= 0"),
            ("optim.warmup_steps", cfg.optim.warmup_steps >= 0, ">= 0"),
            ("train.max_skipped_steps", cfg.train.max_skipped_steps >= 1, ">= 1"),
            ("dist.timeout_s", cfg.dist.timeout_s > 0, "> 0"), ("ckpt.every", cfg.ckpt.every >= 0, ">= 0"),
            ("data.max_bad_fraction", 0 <= cfg.data.max_bad_fraction <= 1, "in [0, 1]")]:
        if not ok:
            section, key = name.split(".")
            raise err(f"{name}={getattr(getattr(cfg, section), key)!r} must be {need}")
    run.check_resume(cfg.ckpt.resume)
    if not cfg.model.path:
        raise err("model.path is empty: give a checkpoint directory or a hub name")
    looks_local = cfg.model.path.startswith((".", "/")) or os.path.exists(cfg.model.path) \
        or cfg.model.path.count("/") != 1
    if looks_local and not cfg.model.make_tiny and not Path(cfg.model.path, "config.json").exists():
        raise err(f"model.path: no config.json in {cfg.model.path}")


# ---------------------------------------------------------------------------------------------
# 2. Models, data, packing
# ---------------------------------------------------------------------------------------------
def load_tasks(cfg):
    """(train problems, or None for fresh synthetic ones; held-out problems; questions training must skip).
    arith: the held-out set is a dev set (seed 20_000 + seed) that the accuracy stop looks at; training also
    skips GRPO's test set (train_grpo.py: 500 problems, seed 10_000 + seed), so GRPO's eval stays unseen and
    unselected."""
    if cfg.data.name == "arith":
        held_out = data.make_arith(cfg.eval.num_problems, seed=20_000 + cfg.train.seed,
                                   min_digits=cfg.data.eval_min_digits, max_digits=cfg.data.eval_max_digits)
        grpo_test = data.make_arith(500, seed=10_000 + cfg.train.seed, min_digits=2, max_digits=2)
        return None, held_out, {p["question"] for p in held_out + grpo_test}
    held_out = data.load_gsm8k(cfg.data.eval_source or cfg.data.source, "test",
                               cfg.data.max_bad_fraction)[:cfg.eval.num_problems]
    return data.load_gsm8k(cfg.data.source, "train", cfg.data.max_bad_fraction), held_out, set()


def step_examples(train, step, batch, seed, cfg, exclude):
    """Step s's examples from (seed, s) alone. Synthetic: fresh problems (never an eval question);
    a dataset: epoch e is a fixed permutation of the train set."""
    if train is None:
        return data.make_arith(batch, seed=seed * 1_000_003 + step + 1, min_digits=cfg.data.min_digits,
                               max_digits=cfg.data.max_digits, exclude=exclude)
    per_epoch = len(train) // batch
    epoch, pos = divmod(step, per_epoch)
    order = list(range(len(train)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return [train[i] for i in order[pos * batch:(pos + 1) * batch]]


def to_docs(tok, problems, instruction, max_tokens):
    """Chat documents (ids, loss_mask), loss on the assistant's solution and its end-of-turn token only."""
    docs, truncated = [], 0
    for p in problems:
        ids, loss_mask = data.sft_example(tok, [{"role": "user", "content": p["question"] + instruction},
                                                {"role": "assistant", "content": p["solution"]}])
        truncated += len(ids) > max_tokens
        docs.append((ids[:max_tokens], loss_mask[:max_tokens]))
    return docs, truncated


def first_fit(docs, pack_len):
    """Rows as lists of documents: each document goes to the first row it fits in (pack_len 0: its own row)."""
    rows, lens = [], []
    for doc in docs:
        n = len(doc[0]) - 1
        i = next((i for i, used in enumerate(lens) if used + n <= pack_len), None) if pack_len else None
        if i is None:
            rows.append([])
            lens.append(0)
            i = len(rows) - 1
        rows[i].append(doc)
        lens[i] += n
    return rows


def pack(docs, pack_len, pad_id, num_rows=0):
    """Documents -> rows of next-token pairs, first fit in data order. A document of n tokens gives n-1 pairs
    (ids[:-1] -> ids[1:]) at positions 0..n-2; a position restarting at 0 is a document boundary for
    model.py. pack_len=0: one document per row. Rows are right-padded to the longest; the padding is a
    document of its own with loss mask 0. num_rows: append empty rows up to this count (equal micro-batch
    counts on every rank, which FSDP2's collectives need). Returns ids, pos, tgt (R, L) long, mask (R, L)."""
    rows = first_fit(docs, pack_len)
    rows += [[] for _ in range(num_rows - len(rows))]
    R, L = len(rows), max([sum(len(d[0]) - 1 for d in row) for row in rows] + [1])
    ids, tgt = torch.full((R, L), pad_id, dtype=torch.long), torch.full((R, L), pad_id, dtype=torch.long)
    pos, mask = torch.zeros((R, L), dtype=torch.long), torch.zeros((R, L))
    for r, row in enumerate(rows):
        c = 0
        for doc_ids, loss_mask in row:
            n = len(doc_ids) - 1
            ids[r, c:c + n], tgt[r, c:c + n] = torch.tensor(doc_ids[:-1]), torch.tensor(doc_ids[1:])
            mask[r, c:c + n] = torch.tensor(loss_mask[1:], dtype=torch.float32)  # predicts token t+1
            pos[r, c:c + n] = torch.arange(n)
            c += n
        pos[r, c:] = torch.arange(L - c)
    return dict(ids=ids, pos=pos, tgt=tgt, mask=mask)


def nll_sum(model, batch, rows, device):
    """Sum over loss-masked tokens of -log p(target): a scalar. One forward over packed rows."""
    b = {k: v[rows].to(device) for k, v in batch.items()}
    logp = model(b["ids"], position_ids=b["pos"], targets=b["tgt"])  # (r, L) fp32
    return -(logp * b["mask"]).sum()


def evaluate(model, gen, dev_batch, held_out, cfg, device):
    """Held-out token-mean loss and greedy pass@1. Every rank runs the same forwards (see the docstring)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        rows = range(len(dev_batch["ids"]))
        loss = sum(float(nll_sum(model, dev_batch, slice(i, i + cfg.train.micro_batch), device))
                   for i in rows[::cfg.train.micro_batch]) / float(dev_batch["mask"].sum())
    groups = gen.generate([p["prompt_ids"] for p in held_out], n=1, temperature=0.0,
                          max_tokens=cfg.eval.max_tokens, seed=0)
    scores, _ = rewards.score_batch({"math": rewards.MathReward(symbolic=False)}, None,
                                    [p["question"] for p in held_out], [g[0].text for g in groups],
                                    [str(p["target"]) for p in held_out], timeout_s=2.0)
    return {"sft/eval_loss": loss, "eval/pass@1": sum(s >= 1 for s in scores) / len(scores),
            "perf/eval_s": time.perf_counter() - t0}


def eval_due(step, cfg):
    return step == cfg.train.steps - 1 or bool(cfg.eval.every and (step + 1) % cfg.eval.every == 0)


SHOWN = ("step", "sft/loss", "sft/eval_loss", "eval/pass@1", "perf/step_s")  # the per-step line


def main(argv=None):
    # ---- 1. config: parsed and validated before anything heavy happens ----------------------------
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    roles = dist.get_roles(0)  # SFT has no generator ranks: every rank trains
    if cfg.log.wandb:
        import wandb  # optional extra, imported only when asked for
    torch.manual_seed(cfg.train.seed)
    torch.use_deterministic_algorithms(cfg.train.deterministic)
    out = Path(cfg.log.out_dir, cfg.log.run)

    # ---- 2. dist init and data -------------------------------------------------------------------
    path = run.resolve_model(cfg.model.path, cfg.model.make_tiny)
    tok = data.Tokenizer(path)
    dist.init_distributed(roles, cfg.dist.timeout_s)
    mesh = dist.trainer_mesh(roles, roles.world_size // cfg.dist.tp, cfg.dist.tp)
    train, held_out, exclude = load_tasks(cfg)
    for p in held_out:
        p["prompt_ids"] = data.prompt_ids(tok, p["question"] + cfg.data.instruction)
    dev_docs, _ = to_docs(tok, held_out, cfg.data.instruction, cfg.data.max_seq_tokens)
    dev_batch = pack(dev_docs, cfg.data.pack_len, tok.pad_token_id)
    ckpt_path, start = run.find_resume(cfg.ckpt.resume, out / "ckpt", cfg.train.steps, roles.rank)

    # ---- 3. model and optimizer ------------------------------------------------------------------
    from model import Transformer
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
    model = dist.shard_model(Transformer.from_pretrained(path, device=roles.device), mesh, param_dtype=dtype,
                             activation_checkpointing=cfg.dist.activation_checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                            weight_decay=cfg.optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, run.lr_lambda(cfg.optim.warmup_steps, cfg.optim.schedule, cfg.optim.min_lr_ratio,
                                                           cfg.optim.schedule_steps or cfg.train.steps))
    skipped_total, skipped_run, num_failed_saves, N = 0, 0, 0, cfg.train.batch_size
    if ckpt_path:  # model, optimizer, schedule, counters; the data order derives from the step
        extra = dist.load_checkpoint(ckpt_path, model, opt)
        sched.load_state_dict(extra["sched"])
        skipped_total, skipped_run = extra.get("skipped", (0, 0))
        if "rng" in extra:  # NOTE: nothing draws from them today; restored so that a fork adding dropout resumes exactly
            torch.set_rng_state(extra["rng"])
            random.setstate(extra["py_rng"])
    # NOTE: dtype is the KV cache's; TorchGenerator currently takes it from the (fp32, sharded) params instead
    gen = generator.TorchGenerator(model, max_model_len=max(len(p["prompt_ids"]) for p in held_out)
                                   + cfg.eval.max_tokens, dtype=dtype or torch.float32, tokenizer_path=path)
    dp_rank, dp = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()
    dp_group = mesh["dp_shard"].get_group()
    out.mkdir(parents=True, exist_ok=True)
    is_log = roles.rank == 0
    wandb_run = None
    if is_log:
        resolved = json.dumps(config.to_dict(vars(cfg)))
        print("config:", resolved)
        (out / "config.json").write_text(resolved)
        # a fresh start empties the log; a resume keeps the rows up to its checkpoint
        (out / "metrics.jsonl").write_text(run.read_log(out / "metrics.jsonl", start) if start else "")
        if cfg.log.wandb:
            wandb_run = wandb.init(project="nanoforge", name=cfg.log.run, config=json.loads(resolved))
    from tqdm import tqdm
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not is_log, dynamic_ncols=True)
    if start == 0:
        ev = evaluate(model, gen, dev_batch, held_out, cfg, roles.device)
        if is_log:
            run.log_step({"step": 0, **ev}, out, None, wandb_run, SHOWN)

    # ---- 4. the loop ------------------------------------------------------------------------------
    for s in range(start, cfg.train.steps):
        t_step = time.perf_counter()
        # 4a. examples: a pure function of (seed, step), identical on every rank; this rank takes its share
        problems = step_examples(train, s, N, cfg.train.seed, cfg, exclude)[dp_rank * N // dp:(dp_rank + 1) * N // dp]
        docs, truncated = to_docs(tok, problems, cfg.data.instruction, cfg.data.max_seq_tokens)
        # 4b. pack: ids, pos, tgt, mask (R, L); every rank gets the same row count (FSDP2: same forwards)
        num_rows = torch.tensor(len(first_fit(docs, cfg.data.pack_len)))
        num_tokens = torch.tensor(float(sum(sum(m[1:]) for _, m in docs)), dtype=torch.float64)
        tdist.all_reduce(num_rows, op=tdist.ReduceOp.MAX, group=dp_group)  # rows per rank
        tdist.all_reduce(num_tokens, group=dp_group)  # loss tokens of the whole step, all ranks
        num_rows, num_tokens = int(num_rows), float(num_tokens)
        batch = pack(docs, cfg.data.pack_len, tok.pad_token_id, num_rows)
        # 4c. update: micro-batches of packed rows; each adds its share of the global token mean
        loss_sum = 0.0
        for i in range(0, num_rows, cfg.train.micro_batch):
            nll = nll_sum(model, batch, slice(i, i + cfg.train.micro_batch), roles.device)
            if dist.fault("nan", s):  # test hook: this step's loss is NaN (tests/test_faults.py)
                nll = nll * float("nan")
            (nll * dp / max(num_tokens, 1.0)).backward()  # * dp: FSDP2 averages gradients over dp ranks
            loss_sum += float(nll.detach())
        gnorm = dist.clip_grad_norm_(model, cfg.optim.grad_clip)  # global norm over FSDP/TP shards
        dist.fault("kill_opt", s)  # test hook: SIGKILL with gradients computed, before the step
        if torch.isfinite(gnorm):
            opt.step()
        else:  # a non-finite step is skipped, counted, and logged; see max_skipped_steps
            skipped_total += 1
        opt.zero_grad(set_to_none=True)
        sched.step()
        skipped_run = skipped_run + 1 if not torch.isfinite(gnorm) else 0  # aborts after the log, see 4d
        train_s = time.perf_counter() - t_step
        # 4d. metrics, summed over data-parallel ranks
        vec = torch.tensor([loss_sum, float(batch["mask"].numel()), float(sum(len(d[0]) - 1 for d in docs)),
                            float(truncated)], dtype=torch.float64)
        tdist.all_reduce(vec, group=dp_group)
        row = {"sft/loss": float(vec[0]) / max(num_tokens, 1.0), "train/grad_norm": float(gnorm),
               "train/lr": sched.get_last_lr()[0], "train/skipped_steps": float(skipped_total),
               "data/pack_efficiency": float(vec[2] / vec[1]), "data/truncated": float(vec[3]),
               "data/rows": float(num_rows * dp), "perf/train_s": train_s}
        stop = False
        if eval_due(s, cfg):
            row.update(evaluate(model, gen, dev_batch, held_out, cfg, roles.device))
            box = [row["eval/pass@1"]]  # rank 0's verdict, so every rank stops at the same step
            tdist.broadcast_object_list(box, src=0)
            stop = bool(cfg.eval.stop_at_accuracy) and s + 1 >= cfg.eval.min_step \
                and box[0] >= cfg.eval.stop_at_accuracy
        abort = skipped_run >= cfg.train.max_skipped_steps
        num_failed_saves += run.checkpoint_due(cfg, out, s + 1, model, opt, sched, (skipped_total, skipped_run), abort)
        row["ckpt/failed_saves"] = float(num_failed_saves)
        row["perf/step_s"] = time.perf_counter() - t_step
        row["perf/tokens_per_s"] = float(vec[2]) / max(train_s, 1e-9)
        row["step"] = s + 1
        stats = f"sft/loss={row['sft/loss']:.4g}, train/grad_norm={row['train/grad_norm']:.4g}"
        if is_log:
            run.log_step(row, out, bar, wandb_run, SHOWN)
            if not torch.isfinite(gnorm):
                bar.write(f"step {s + 1}: non-finite loss or grad norm, optimizer step skipped ({stats})")
            if (s + 1) % cfg.log.plot_every == 0 or s + 1 == cfg.train.steps or stop:
                import plots
                plots.plot_run(out / "metrics.jsonl", out)
        if abort:  # after the log, so the batch that tipped it over is on record
            raise RuntimeError(f"{skipped_run} consecutive steps (up to step {s + 1}) had a non-finite loss or grad "
                               f"norm, train.max_skipped_steps={cfg.train.max_skipped_steps}: aborting. Last batch: "
                               f"{stats}")
        if stop:
            if is_log:
                bar.write(f"eval/pass@1={row['eval/pass@1']:.3f} >= {cfg.eval.stop_at_accuracy} at step {s + 1}: "
                          "stopping (eval.stop_at_accuracy)")
            break

    # ---- 5. export the final model as a Hugging Face checkpoint that vLLM and train_grpo.py open ----
    dist.export_hf(model, out / "hf", tokenizer_dir=path)
    bar.close()
    dist.shutdown()


if __name__ == "__main__":
    run.run_main(main)
