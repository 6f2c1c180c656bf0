"""Supervised fine-tuning (SFT) on chat data: one file that reads as the algorithm, skeleton shared
with GRPO.

One step (N examples, global; shapes are per trainer rank):

    examples --chat template--> ids, loss_mask per document   data.sft_example: 1 on assistant
                                                              tokens + end-of-turn
             --pack---------->  rows (R, L): documents back to back,
                                positions restart at 0 per document
             --update-------->  micro-batches, loss = -sum(mask * logp) / num_tokens(global),
                                AdamW, grad clip

The loss is the token mean over every assistant token of the step on all ranks: each micro-batch
adds its masked sum divided by the step's global token count, so neither gradient accumulation nor
data parallelism changes the gradient (FSDP2 averages over ranks, hence the factor dp).

Packing without cross-contamination: model.py reads positions that restart at 0 (with no
attention_mask) as document boundaries and builds a block-diagonal causal mask, so a token attends
only within its document, at its position in that document: a packed row gives exactly the losses of
its documents run one by one (tests/test_train_sft.py checks this to 1e-5). A row's tail padding is
a document of its own with mask 0.

Step s's examples are a pure function of (seed, s) (fresh problems for the synthetic task, a fixed
permutation per epoch for datasets), so resuming at step s continues the data order exactly.

Eval: held-out token-mean loss and greedy pass@1 with generator.TorchGenerator over the trainer's
own model (no vLLM). With `eval.stop_at_accuracy`, training stops at the first eval at or after
`eval.min_step` whose pass@1 reaches the target: SFT's accuracy jumps at a seed-dependent step
(tiny-task.md), so a fixed step count gives RL unpredictable starting points.

Deliberate departures from common SFT recipes:
- every rank generates the whole eval set: FSDP2 needs every rank in every forward, and a rank's
  greedy decode stops when its own rows are done. The work is duplicated, not split; fine for an
  occasional eval.
- examples longer than data.max_seq_tokens are truncated (counted), not dropped;
- packing is first-fit in data order (no sorting by length), so rows stay a pure function of the
  step.

With `model.lora_rank > 0` only LoRA adapters on the frozen base train (lora.py, as in
train_grpo.py); the checkpoints hold the adapters, and the export is the merged model plus the
adapter in PEFT's format.

Launch lines:
    CPU, one process:              python train_sft.py configs/sft_tiny.py
    CPU, 2 ranks (FSDP2, gloo):    torchrun --nproc_per_node=2 train_sft.py configs/sft_tiny.py
    1 GPU (~7 packed rows/step):   python train_sft.py configs/sft_gsm8k.py
    8 GPUs (FSDP2):                torchrun --nproc_per_node=8 train_sft.py configs/sft_gsm8k.py
"""
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as tdist

import checks
import data
import dist
import generator
import lora
import machine
import metrics
import reward_guard
import rewards
import run
import seeds
import tasks


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
    lora_dropout: float = 0.0       # dropout on the adapters' input (training forwards only)


@dataclass
class Data:
    name: str = "arith"             # arith | code (synthetic, CPU) | gsm8k | "pkg.module:fn" /
                                    # "file.py:fn", fn(source, split)
    source: str = "openai/gsm8k"    # train split: hub name or local .jsonl/.parquet (gsm8k); any
                                    # string (own loader)
    eval_source: str = ""           # held-out split: "" = `source` with split "test"
    instruction: str = ""           # appended to every question
    min_digits: int = 1             # arith: operand size of the training problems
    max_digits: int = 2             # arith: largest operand size
    eval_min_digits: int = 2        # arith: operand size of the held-out problems (what GRPO trains
                                    # on)
    eval_max_digits: int = 2        # arith: largest held-out operand size
    pack_len: int = 512             # tokens per packed row; 0 = one example per (padded) row
    max_seq_tokens: int = 512       # longer examples are truncated (counted in the log)
    max_bad_fraction: float = 0.01  # gsm8k: skip malformed rows (counted, first shown); abort above
                                    # this fraction


@dataclass
class Optim:
    lr: float = 2e-5                # peak learning rate (AdamW)
    betas: tuple = (0.9, 0.95)      # AdamW (beta1, beta2)
    weight_decay: float = 0.0       # AdamW decoupled weight decay
    warmup_steps: int = 0           # linear warmup from 0
    schedule: str = "cosine"        # constant | cosine (to min_lr_ratio * lr)
    min_lr_ratio: float = 0.1       # cosine: final lr = min_lr_ratio * lr
    schedule_steps: int = 0         # cosine horizon; 0 = train.steps (set it when stopping early by
                                    # design)
    grad_clip: float = 1.0          # global grad-norm clip (over all FSDP/TP shards)


@dataclass
class Train:
    steps: int = 1000               # optimizer steps
    seed: int = 0                   # data order, sampling and init all derive from (seed, step)
    batch_size: int = 64            # N: examples per optimizer step (global)
    micro_batch: int = 8            # packed rows per forward/backward (gradient accumulation)
    max_skipped_steps: int = 5      # consecutive non-finite steps before the run aborts
    deterministic: bool = False     # torch.use_deterministic_algorithms (slower)


@dataclass
class Dist:
    tp: int = 1                     # tensor parallel degree inside the trainer mesh
    timeout_s: float = 600.0        # every collective; a dead rank surfaces within this
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, one
                                    # more forward
    compile: bool = False           # torch.compile each block's training and scoring forwards
                                    # (decode stays eager): on a GPU ~2x faster updates after ~40 s
                                    # of compiling (docs/gpu.md); not with tp


@dataclass
class Eval:
    every: int = 100                # steps between evals (0 = only at start and end)
    num_problems: int = 200         # held-out problems: token-mean loss and greedy pass@1
    max_tokens: int = 40            # generation budget of the greedy eval
    stop_at_accuracy: float = 0.0   # >0: stop at the first eval (step >= min_step) with pass@1 >=
                                    # this
    min_step: int = 0               # stop_at_accuracy is checked only from this step on


@dataclass
class Log:
    run: str = "sft"                # outputs go to <out_dir>/<run>/ (nested names like demo/sft
                                    # work)
    out_dir: str = "out"            # outputs under <out_dir>/<run>/
    plot_every_s: float = 60.0      # refresh the PNG plots at most this often (wall s; a plot costs
                                    # ~1 s; -1 never)
    wandb: bool = False             # W&B (optional extra: make extras); WANDB_MODE=offline works
                                    # offline
    wandb_project: str = "nanoforge"  # W&B project
    tensorboard: bool = False       # TensorBoard event files in <out_dir>/<run>/tb (optional extra:
                                    # make extras)


@dataclass
class Ckpt:
    every: int = 0                  # checkpoint every N steps (0 = off)
    resume: str = ""                # "" | "auto" (newest complete checkpoint) | a checkpoint dir


def parse_config(argv):
    sections = dict(model=Model(), data=Data(), optim=Optim(), train=Train(),
                    dist=Dist(), eval=Eval(), log=Log(), ckpt=Ckpt())
    return SimpleNamespace(**run.parse_cli(sections, argv))  # cfg.optim.lr, not cfg["optim"].lr


# ---------------------------------------------------------------------------------------------
# 2. Models, data, packing
# ---------------------------------------------------------------------------------------------
def load_tasks(cfg):
    """(train problems, or None for fresh synthetic arithmetic each step; held-out problems). The
    held-out set is the dev split (data.problems, tasks.split_of) that the accuracy stop looks at:
    no trainer trains on it or on GRPO's test split, whatever either one's seed, digits or set
    size."""
    digits = (cfg.data.eval_min_digits, cfg.data.eval_max_digits)
    held_out = data.problems(cfg.data, "dev", cfg.train.seed, cfg.eval.num_problems, digits)
    return (None if cfg.data.name == "arith" else data.problems(cfg.data, "train", cfg.train.seed),
            held_out)


def step_examples(train, step, batch, seed, cfg):
    """Step s's examples from (seed, s) alone. Synthetic: fresh problems of the train split; a
    dataset: epoch e is a fixed permutation of the train set (data.step_batch)."""
    if train is None:
        return tasks.make_arith(batch, seeds.seed(seed, "sft_step", step),
                                min_digits=cfg.data.min_digits,
                                max_digits=cfg.data.max_digits, split="train")
    return data.step_batch(train, step, batch, seed)


def to_docs(tok, problems, instruction, max_tokens):
    """Chat documents (ids, loss_mask), loss on the assistant's solution and its end-of-turn token
    only."""
    docs, truncated = [], 0
    for p in problems:
        ids, loss_mask = data.sft_example(
            tok, [{"role": "user", "content": p["question"] + instruction},
                  {"role": "assistant", "content": p["solution"]}])
        truncated += len(ids) > max_tokens
        docs.append((ids[:max_tokens], loss_mask[:max_tokens]))
    return docs, truncated


def nll_sum(model, batch, rows, device):
    """Sum over loss-masked tokens of -log p(target): a scalar. One forward over packed rows."""
    b = {k: v[rows].to(device) for k, v in batch.items()}
    logp = model(b["ids"], position_ids=b["pos"], targets=b["tgt"])  # (r, L) fp32
    return -(logp * b["mask"]).sum()


def evaluate(model, gen, dev_batch, held_out, cfg, device):
    """Held-out token-mean loss and greedy pass@1. Every rank runs the same forwards (see the
    docstring)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        rows = range(len(dev_batch["ids"]))
        loss = sum(float(nll_sum(model, dev_batch, slice(i, i + cfg.train.micro_batch), device))
                   for i in rows[::cfg.train.micro_batch]) / float(dev_batch["mask"].sum())
    groups = gen.generate([p["prompt_ids"] for p in held_out], n=1, temperature=0.0,
                          max_tokens=cfg.eval.max_tokens, seed=0)
    check = (rewards.CodeReward(mode="all") if cfg.data.name == "code"
             else rewards.MathReward(symbolic=False))
    scores, _ = reward_guard.score_batch({"correct": check}, None,
                                    [p["question"] for p in held_out], [g[0].text for g in groups],
                                    [str(p["target"]) for p in held_out], timeout_s=2.0)
    return {"sft/eval_loss": loss, "eval/pass@1": sum(s >= 1 for s in scores) / len(scores),
            "perf/eval_s": time.perf_counter() - t0}


SHOWN = ("step", "sft/loss", "sft/eval_loss", "eval/pass@1", "perf/step_s")  # the per-step line
STATS = ("sft/loss", "train/grad_norm")  # said on a skipped step


def main(argv=None):
    # ---- 1. config: parsed and validated before anything heavy happens ---------------------------
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_config(argv)
    checks.sft(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    if run.print_config(cfg, argv):  # --print-config: nothing is loaded
        return
    roles = dist.get_roles(0)  # SFT has no generator ranks: every rank trains
    # "auto": measured here, before the model is built
    machine.resolve_dtype(cfg, say=roles.rank == 0)
    torch.manual_seed(cfg.train.seed)
    torch.use_deterministic_algorithms(cfg.train.deterministic)
    out = Path(cfg.log.out_dir, cfg.log.run)
    N = cfg.train.batch_size

    # ---- 2. dist init and data -------------------------------------------------------------------
    path = run.resolve_model(cfg.model.path)
    tok = data.Tokenizer(path)
    dist.init_distributed(roles, cfg.dist.timeout_s)
    dist.agree("model.dtype", cfg.model.dtype)  # every rank measured its own "auto"
    mesh = dist.trainer_mesh(roles, roles.world_size // cfg.dist.tp, cfg.dist.tp)
    train, held_out = load_tasks(cfg)
    for p in held_out:
        p["prompt_ids"] = data.prompt_ids(tok, p["question"] + cfg.data.instruction)
    dev_docs, _ = to_docs(tok, held_out, cfg.data.instruction, cfg.data.max_seq_tokens)
    dev_batch = data.pack(dev_docs, cfg.data.pack_len, tok.pad_token_id)
    ckpt_path, start = run.find_resume(cfg.ckpt.resume, out / "ckpt", cfg.train.steps, roles.rank)

    # ---- 3. model and optimizer ------------------------------------------------------------------
    # with LoRA (model.lora_rank): adapters on the frozen base, and only they train
    model = run.load_model(path, roles.device, mesh, cfg,
                           adapters=cfg.model if cfg.model.lora_rank else None)
    opt, sched = run.make_optimizer(model, cfg.optim, cfg.optim.schedule_steps or cfg.train.steps)
    # a resume restores model, optimizer, schedule, counters; the data order derives from the step
    skipped_total, skipped_run = run.restore(ckpt_path, model, opt, sched)
    # NOTE: dtype is the KV cache's; TorchGenerator currently takes it from the (fp32, sharded)
    # params instead
    gen = generator.TorchGenerator(model, max_model_len=max(len(p["prompt_ids"]) for p in held_out)
                                   + cfg.eval.max_tokens, dtype=getattr(torch, cfg.model.dtype),
                                   tokenizer_path=path)
    dp_rank, dp = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()
    dp_group = mesh["dp_shard"].get_group()
    log = metrics.RunLog(cfg, out, start, roles.rank == 0, SHOWN)
    num_failed_saves = 0
    if start == 0:
        log.step({"step": 0, **evaluate(model, gen, dev_batch, held_out, cfg, roles.device)},
                 progress=False)

    # ---- 4. the loop -----------------------------------------------------------------------------
    for s in range(start, cfg.train.steps):
        t_step = time.perf_counter()
        # 4a. examples: a pure function of (seed, step), identical on every rank; this rank takes
        # its share
        problems = step_examples(train, s, N, cfg.train.seed, cfg)[
            dp_rank * N // dp:(dp_rank + 1) * N // dp]
        docs, truncated = to_docs(tok, problems, cfg.data.instruction, cfg.data.max_seq_tokens)
        # 4b. pack: ids, pos, tgt, mask (R, L); every rank gets the same row count (FSDP2: same
        # forwards)
        num_rows = torch.tensor(len(data.first_fit(docs, cfg.data.pack_len)))
        num_tokens = torch.tensor(float(sum(sum(m[1:]) for _, m in docs)), dtype=torch.float64)
        tdist.all_reduce(num_rows, op=tdist.ReduceOp.MAX, group=dp_group)  # rows per rank
        tdist.all_reduce(num_tokens, group=dp_group)  # loss tokens of the whole step, all ranks
        num_rows, num_tokens = int(num_rows), float(num_tokens)
        batch = data.pack(docs, cfg.data.pack_len, tok.pad_token_id, num_rows)
        # 4c. update: micro-batches of packed rows; each adds its share of the global token mean
        loss_sum = 0.0
        for i in range(0, num_rows, cfg.train.micro_batch):
            nll = nll_sum(model, batch, slice(i, i + cfg.train.micro_batch), roles.device)
            # test hook: this step's loss is NaN (tests/test_faults.py)
            nll = dist.fault_nan(nll, s)
            # * dp: FSDP2 averages gradients over dp ranks
            (nll * dp / max(num_tokens, 1.0)).backward()
            loss_sum += float(nll.detach())
        gnorm = dist.clip_grad_norm_(model, cfg.optim.grad_clip)  # global norm over FSDP/TP shards
        dist.fault("kill_opt", s)  # test hook: SIGKILL with gradients computed, before the step
        skipped = run.step_if_finite(opt, gnorm)
        sched.step()
        # a non-finite step is skipped, counted, and logged; see max_skipped_steps
        skipped_total += skipped
        # the run aborts after logging this step, see 4d
        skipped_run = skipped_run + 1 if skipped else 0
        train_s = time.perf_counter() - t_step
        # 4d. metrics (summed over data-parallel ranks), eval, checkpoint, log
        vec = torch.tensor([loss_sum, float(batch["mask"].numel()),
                            float(sum(len(d[0]) - 1 for d in docs)), float(truncated)],
                           dtype=torch.float64)
        tdist.all_reduce(vec, group=dp_group)
        row = {"sft/loss": float(vec[0]) / max(num_tokens, 1.0), "train/grad_norm": float(gnorm),
               "train/lr": sched.get_last_lr()[0], "train/skipped_steps": float(skipped_total),
               "data/pack_efficiency": float(vec[2] / vec[1]), "data/truncated": float(vec[3]),
               "data/rows": float(num_rows * dp), "perf/train_s": train_s}
        stop = False
        if run.eval_due(s, cfg):
            row.update(evaluate(model, gen, dev_batch, held_out, cfg, roles.device))
            box = [row["eval/pass@1"]]  # rank 0's verdict, so every rank stops at the same step
            tdist.broadcast_object_list(box, src=0)
            stop = bool(cfg.eval.stop_at_accuracy) and s + 1 >= cfg.eval.min_step \
                and box[0] >= cfg.eval.stop_at_accuracy
        abort = skipped_run >= cfg.train.max_skipped_steps
        if run.checkpoint_due(s + 1, cfg) and not abort:  # not on a step that aborts the run
            num_failed_saves += run.save_checkpoint(out, s + 1, model, opt, sched,
                                                    (skipped_total, skipped_run))
        row["ckpt/failed_saves"] = float(num_failed_saves)
        row["perf/step_s"] = time.perf_counter() - t_step
        row["perf/tokens_per_s"] = float(vec[2]) / max(train_s, 1e-9)
        row["step"] = s + 1
        metrics.finish_step(log, row, skipped, skipped_run, cfg.train.max_skipped_steps, STATS,
                        last=s + 1 == cfg.train.steps or stop)
        if stop:
            log.write(f"eval/pass@1={row['eval/pass@1']:.3f} >= {cfg.eval.stop_at_accuracy} at "
                      f"step {s + 1}: stopping (eval.stop_at_accuracy)")
            break

    # ---- 5. export the final model as a Hugging Face checkpoint that vLLM and train_grpo.py open
    run.export(model, out, cfg, path)  # with LoRA: merged, and the adapter alone (PEFT's format)
    log.close()
    dist.shutdown()


if __name__ == "__main__":
    run.run_main(main)
