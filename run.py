"""A training run's bookkeeping, shared by train_sft.py and train_grpo.py.

The trainers own the algorithm; this file owns what every run does around it, the same way for both:
where the starting checkpoint comes from, the optimizer and its learning-rate schedule, what a resume
continues from (said out loud, so a resume can never silently train zero steps) and restoring it, the
periodic checkpoint, the run's outputs (`RunLog`: config.json, `metrics.jsonl` with one JSON row per step,
cut back to the checkpoint on resume, the progress line, W&B, plots), the end of a step (log, report a
skipped step, abort after too many), and the process exit (a config error is one line; a failed
collective names the lost rank).
"""
import json
import math
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as tdist

import checkpoint
import config
import data
import dist


def resolve_model(path, make_tiny):
    """A local dir as is; the tiny checkpoint made once under a file lock; else a hub download."""
    if make_tiny:
        import fcntl
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(str(path) + ".lock", "w") as f:  # every local rank calls this; one creates it
            fcntl.flock(f, fcntl.LOCK_EX)
            data.make_tiny_checkpoint(path, seed=0)
    if Path(path, "config.json").exists():
        return str(path)
    from huggingface_hub import snapshot_download  # hub name: the only branch that needs network
    return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])


def check_model_path(path, make_tiny):
    """Config check: a local-looking path must hold a checkpoint (a hub name "org/name" is downloaded later)."""
    if not path:
        raise config.ConfigError("model.path is empty: give a checkpoint directory or a hub name")
    looks_local = path.startswith((".", "/")) or Path(path).exists() or path.count("/") != 1
    if looks_local and not make_tiny and not Path(path, "config.json").exists():
        raise config.ConfigError(f"model.path: no config.json in {path}")


def lr_lambda(warmup_steps, schedule, min_lr_ratio, horizon):
    """Linear warmup, then constant or cosine decay to min_lr_ratio at `horizon` steps (LambdaLR factor)."""
    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        t = (step - warmup_steps) / max(1, horizon - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1)))
    return f


def make_optimizer(model, optim, horizon):
    """AdamW over the (sharded) parameters and its LambdaLR schedule from an `optim` config section."""
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    f = lr_lambda(optim.warmup_steps, optim.schedule, optim.min_lr_ratio, horizon)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, f)


def eval_due(step, cfg):
    """After step `step` (0-based): every `eval.every` steps, and always after the last one."""
    return step == cfg.train.steps - 1 or bool(cfg.eval.every and (step + 1) % cfg.eval.every == 0)


def check_resume(resume):
    """Config check: "", "auto", or a complete step_<N> checkpoint directory."""
    if resume not in ("", "auto") and not (Path(resume).name.removeprefix("step_").isdigit()
                                           and checkpoint.is_complete(resume)):
        raise config.ConfigError(f"ckpt.resume={resume!r} is not a complete checkpoint (a step_<N> directory with "
                                 "a COMPLETE marker); use 'auto' for the newest complete one")


def find_resume(resume, ckpt_dir, steps, rank):
    """(checkpoint dir or None, its step): global rank 0 decides and says what happens, every rank learns it."""
    found = [None, 0]
    if rank == 0 and resume:
        ck = checkpoint.latest_checkpoint(ckpt_dir) if resume == "auto" else Path(resume)
        found = [str(ck), int(ck.name.split("_")[-1])] if ck else [None, 0]
        if ck is None:
            print(f"ckpt.resume=auto: no complete checkpoint in {ckpt_dir}, starting from step 0", flush=True)
        elif found[1] >= steps:
            print(f"resume: {ck} is at step {found[1]} and train.steps={steps}: nothing to train "
                  "(raise --train.steps to continue); exporting the checkpoint's model", flush=True)
        else:
            print(f"resume: {ck}, continuing at step {found[1] + 1} of {steps}", flush=True)
    tdist.broadcast_object_list(found, src=0)
    return found


def restore(ckpt_path, model, opt, sched):
    """Resume restoration: model, optimizer, schedule and RNG states in place. -> (skipped_total, skipped_run)."""
    if not ckpt_path:
        return 0, 0
    extra = checkpoint.load_checkpoint(ckpt_path, model, opt)
    sched.load_state_dict(extra["sched"])
    # NOTE: nothing in the loops draws from the global RNGs (every stream is seeded from (seed, step)); they are
    # restored anyway so that a fork which adds dropout or random masking still resumes exactly
    if "rng" in extra:
        torch.set_rng_state(extra["rng"])
        random.setstate(extra["py_rng"])
    return tuple(extra.get("skipped", (0, 0)))


def read_log(path, last_step):
    """A .jsonl log's rows up to `last_step` (a resume drops rows logged after its checkpoint); a torn last
    line, from a kill mid-write, is dropped too."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row["step"] <= last_step:
            rows.append(line + "\n")
    return "".join(rows)


def checkpoint_due(cfg, out, step, model, opt, sched, skipped, abort) -> int:
    """Save every `ckpt.every` steps, with what a resume needs beyond the weights (schedule, skip counters, RNG);
    not on a step that aborts the run. Returns 1 when a save failed (reported; the run goes on), else 0."""
    if not cfg.ckpt.every or step % cfg.ckpt.every or abort:
        return 0
    state = {"sched": sched.state_dict(), "skipped": skipped, "rng": torch.get_rng_state(), "py_rng": random.getstate()}
    return int(checkpoint.save_checkpoint(out / "ckpt", step, model, opt, state) is None)


class RunLog:
    """A run's outputs, written by global rank 0 (on other ranks every method is a no-op): the resolved config
    (printed, and saved as config.json), one JSON row per step in metrics.jsonl (and W&B when asked for), other
    .jsonl logs (`append`), a progress bar with one readable line per step (the `shown` keys), the PNG curves.
    A fresh start empties the logs; a resume keeps their rows up to its checkpoint."""

    def __init__(self, cfg, out, start, is_log, shown, logs=("metrics.jsonl",)):
        self.out, self.is_log, self.shown, self.wandb = Path(out), is_log, shown, None
        self.out.mkdir(parents=True, exist_ok=True)
        if is_log:
            resolved = config.to_dict(vars(cfg))
            print("config:", json.dumps(resolved))
            (self.out / "config.json").write_text(json.dumps(resolved))
            for log in logs:
                (self.out / log).write_text(read_log(self.out / log, start) if start else "")
            if cfg.log.wandb:
                import wandb  # optional extra, imported only when asked for (validate checked it is there)
                self.wandb = wandb.init(project="nanoforge", name=cfg.log.run, config=resolved)
        from tqdm import tqdm
        self.bar = tqdm(total=cfg.train.steps, initial=start, disable=not is_log, dynamic_ncols=True)

    def step(self, row, progress=True):
        """Append the row to metrics.jsonl (and W&B); with `progress`, advance the bar and print the line."""
        if not self.is_log:
            return
        self.append("metrics.jsonl", row)
        if self.wandb:
            self.wandb.log(row, step=row["step"])
        if progress:
            self.bar.update(1)
            self.write(" ".join(f"{k.split('/')[-1]}={row[k]:.4g}" for k in self.shown if k in row))

    def append(self, log, row):
        if self.is_log:
            with open(self.out / log, "a") as f:
                f.write(json.dumps(row) + "\n")

    def write(self, msg):
        if self.is_log:
            self.bar.write(msg)

    def plot(self):
        if self.is_log:
            import plots
            plots.plot_run(self.out / "metrics.jsonl", self.out)

    def close(self):
        self.bar.close()


@contextmanager
def timed(perf, key):
    """perf[key] = seconds spent in the block (the step-time breakdown, perf/*_s)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        perf[key] = time.perf_counter() - t0


def finish_step(log, row, skipped, skipped_run, max_skipped, stat_keys, plot):
    """The end of every step: log the row, say so when its optimizer step was skipped (non-finite loss or grad
    norm), refresh the plots, and abort after `max_skipped` skipped steps in a row: after the log, so the batch
    that tipped it over is on record. Every rank calls it (every rank must raise)."""
    stats = ", ".join(f"{k}={row[k]:.4g}" for k in stat_keys if k in row)
    log.step(row)
    if skipped:
        log.write(f"step {row['step']}: non-finite loss or grad norm, optimizer step skipped ({stats})")
    if plot:
        log.plot()
    if skipped_run >= max_skipped:
        raise RuntimeError(f"{skipped_run} consecutive steps (up to step {row['step']}) had a non-finite loss or grad "
                           f"norm, train.max_skipped_steps={max_skipped}: aborting. Last batch: {stats}")


def run_main(main):
    """The trainers' `__main__`: a config error is one clear line; a failed collective names the lost rank(s)."""
    try:
        main()
    except config.ConfigError as e:
        sys.exit(f"config error: {e}")
    except Exception as e:
        why = dist.explain_failure(e)
        if why is None:
            raise
        import traceback
        traceback.print_exc()
        sys.exit(why)
