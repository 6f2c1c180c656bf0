"""A training run's bookkeeping, shared by train_sft.py and train_grpo.py.

The trainers own the algorithm; this file owns what every run does around it, the same way for both:
where the starting checkpoint comes from, the learning-rate schedule, what a resume continues from (said
out loud, so a resume can never silently train zero steps), the periodic checkpoint, the `metrics.jsonl`
log (one JSON row per step, cut back to the checkpoint on resume), and the process exit (a config error is
one line; a failed collective names the lost rank).
"""
import json
import math
import random
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

import config
import data
import dist


def resolve_model(path, make_tiny):
    """A local dir as is; the tiny checkpoint made once under a file lock; else a hub download. Either way the
    directory is checked (check_checkpoint) before anything heavy is loaded."""
    if make_tiny:
        import fcntl
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(str(path) + ".lock", "w") as f:  # every local rank calls this; one creates it
            fcntl.flock(f, fcntl.LOCK_EX)
            data.make_tiny_checkpoint(path, seed=0)
    if not Path(path, "config.json").exists():
        from huggingface_hub import snapshot_download  # hub name: the only branch that needs network
        try:
            path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
        except Exception as e:  # offline, a typo, a gated repository: say which model.path and why
            raise config.ConfigError(f"model.path={str(path)!r} is not a local checkpoint directory and the hub "
                                     f"download failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    check_checkpoint(path)
    return str(path)


def check_checkpoint(path):
    """Cheap checks of a checkpoint directory, so a bad one fails in seconds, naming the file or field, instead of
    after an inference engine has started: config.json parses into a supported architecture, and the weights and
    the tokenizer are there."""
    from model import ModelConfig
    path = Path(path)
    cfg_file = path / "config.json"
    try:
        ModelConfig.from_hf(json.loads(cfg_file.read_text()), str(cfg_file))
    except (OSError, json.JSONDecodeError, ValueError) as e:
        raise config.ConfigError(f"model.path: {e}") from None
    if not (path / "model.safetensors").exists() and not (path / "model.safetensors.index.json").exists():
        raise config.ConfigError(f"model.path: no model.safetensors (nor model.safetensors.index.json) in {path}")
    if not (path / "tokenizer.json").exists():
        raise config.ConfigError(f"model.path: missing tokenizer file {path / 'tokenizer.json'}")


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


def check_resume(resume):
    """Config check: "", "auto", or a complete step_<N> checkpoint directory."""
    if resume not in ("", "auto") and not (Path(resume).name.removeprefix("step_").isdigit()
                                           and dist.is_complete(resume)):
        raise config.ConfigError(f"ckpt.resume={resume!r} is not a complete checkpoint (a step_<N> directory with "
                                 "a COMPLETE marker); use 'auto' for the newest complete one")


def find_resume(resume, ckpt_dir, steps, rank):
    """(checkpoint dir or None, its step): global rank 0 decides and says what happens, every rank learns it."""
    found = [None, 0]
    if rank == 0 and resume:
        ck = dist.latest_checkpoint(ckpt_dir) if resume == "auto" else Path(resume)
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
    return int(dist.save_checkpoint(out / "ckpt", step, model, opt, state) is None)


def log_step(row, out, bar, wandb_run, shown):
    """Append the row to metrics.jsonl (and W&B); one readable line with the `shown` keys under the bar."""
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    if wandb_run:
        wandb_run.log(row, step=row["step"])
    if bar is not None:
        bar.update(1)
        bar.write(" ".join(f"{k.split('/')[-1]}={row[k]:.4g}" for k in shown if k in row))


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
