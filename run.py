"""A training run's bookkeeping, shared by train_sft.py and train_grpo.py.

The trainers own the algorithm; this file owns what every run does around it, the same way for both:
the command line (`--help`, `--print-config`), where the starting checkpoint comes from
("tiny:<dir>[@seed]" is the only path that creates one) and its cheap sanity check, loading it
sharded (`load_model`; frozen for a model that only scores), the optimizer and its learning-rate
schedule, what a resume continues from (said out loud, so a resume can never silently train zero
steps) and restoring it, when evals and checkpoints fall due, saving one, and the process exit (a
config error is one line; a failed collective names the lost rank). What a run logs: metrics.py.
"""
import dataclasses
import inspect
import json
import math
import random
import re
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

import checkpoint
import config
import data
import dist


def help_text(sections):
    """Every field as `--section.field=default  type  # comment`, the comments read from the
    dataclass source (a comment-only line below a field continues its comment)."""
    out = []
    for name, obj in sections.items():
        notes, last = {}, None
        for line in inspect.getsource(type(obj)).splitlines():
            if m := re.match(r"\s+(\w+)\s*:[^#]*(?:#\s*(.*))?$", line):
                last, comment = m[1], m[2]
            elif (m := re.match(r"\s+#\s*(.*)$", line)) and last:
                comment = m[1]
            else:
                last = comment = None
            if comment:
                notes[last] = f"{notes[last]} {comment}" if last in notes else comment
        out.append(f"\n[{name}]")
        for f in dataclasses.fields(obj):
            typ, note = getattr(f.type, "__name__", str(f.type)), notes.get(f.name)
            out.append(f"  --{name}.{f.name}={getattr(obj, f.name)!r}".ljust(46) + f" {typ:6}"
                       + (f" # {note}" if note else ""))
    return "\n".join(out)


def parse_cli(sections, argv):
    """config.parse, then `--help`: every field with its default (after the config files, so what
    this run would use), type and comment, then exit 0. `--print-config` is answered by
    print_config, after the trainer's checks."""
    sections = config.parse(sections, argv)
    if {"--help", "-h"} & set(argv):
        print(f"usage: {Path(sys.argv[0]).name} [config.py ...] [--section.field=value ...] "
              "[--print-config] [--help]"
              + help_text(sections))
        raise SystemExit(0)
    return sections


def print_config(cfg, argv):
    """With `--print-config`: print the resolved, validated config as JSON and say so (the caller
    exits)."""
    if "--print-config" in argv:
        print(json.dumps(config.to_dict(vars(cfg)), indent=2))
    return "--print-config" in argv


def tiny_spec(path):
    """"tiny:<dir>" -> (dir, 0); "tiny:<dir>@<seed>" -> (dir, seed): two tiny models (a student and
    a teacher) differ by their seed, not only by their directory."""
    spec = path.removeprefix("tiny:")
    head, at, seed = spec.rpartition("@")
    return (head, int(seed)) if at and seed.isdigit() else (spec, 0)


def resolve_model(path, field="model.path"):
    """The checkpoint directory to load. "tiny:<dir>[@seed]": the tiny random checkpoint, made once
    there (under a file lock: every local rank calls this) if missing. A local directory as is.
    Anything else is a hub name, downloaded (the only branch that needs network); if that fails,
    nothing was created and the error names the path. Either way the directory is checked
    (check_checkpoint) before anything heavy is loaded. `field` is the config field the path came
    from, named in every error."""
    if path.startswith("tiny:"):
        import fcntl
        path, seed = tiny_spec(path)
        stamp = Path(path, "nanoforge_tiny.json")
        held = json.loads(stamp.read_text()).get("seed", 0) if stamp.exists() else seed
        if held != seed:
            raise config.ConfigError(f"{field}=tiny:{path}@{seed}: {path} holds the tiny model of "
                                     f"seed {held}; name another directory")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(str(path) + ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            data.make_tiny_checkpoint(path, seed=seed)
    if not Path(path, "config.json").exists():
        from huggingface_hub import snapshot_download
        try:
            path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                           "*.model", "*.jinja"])
        except Exception as e:
            raise config.ConfigError(f"{field}={path!r}: no such local checkpoint, and the hub "
                                     f"could not provide it ({type(e).__name__}); a local path "
                                     f"must hold config.json, and `tiny:{path}` would make a "
                                     "random tiny model there") from None
    check_checkpoint(path, field)
    return str(path)


def check_checkpoint(path, field="model.path"):
    """Cheap checks of a checkpoint directory, so a bad one fails in seconds, naming the file or
    field, instead of after an inference engine has started: config.json parses into a supported
    architecture, and the weights and the tokenizer are there."""
    from model import ModelConfig
    path = Path(path)
    cfg_file = path / "config.json"
    try:
        ModelConfig.from_hf(json.loads(cfg_file.read_text()), str(cfg_file))
    except (OSError, json.JSONDecodeError, ValueError) as e:
        raise config.ConfigError(f"{field}: {e}") from None
    if (not (path / "model.safetensors").exists()
            and not (path / "model.safetensors.index.json").exists()):
        raise config.ConfigError(
            f"{field}: no model.safetensors (nor model.safetensors.index.json) in {path}")
    if not (path / "tokenizer.json").exists():
        raise config.ConfigError(f"{field}: missing tokenizer file {path / 'tokenizer.json'}")


def lr_lambda(warmup_steps, schedule, min_lr_ratio, horizon):
    """Linear warmup, then constant or cosine decay to min_lr_ratio at `horizon` steps
    (LambdaLR factor)."""
    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        t = (step - warmup_steps) / max(1, horizon - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1)))
    return f


def step_if_finite(opt, gnorm):
    """The optimizer step, unless the gradient norm is NaN/inf (a NaN loss gives NaN grads, and the
    norm is global, so every rank skips the same steps); grads are zeroed either way. Returns 1 for
    a skipped step: counted and logged, and train.max_skipped_steps in a row abort the run."""
    finite = bool(torch.isfinite(gnorm))
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return int(not finite)


def load_model(path, device, mesh, cfg, frozen=False, adapters=None):
    """A Hugging Face checkpoint as this rank's shard of the model (dist.shard_model: FSDP2, and
    tensor parallel when dist.tp > 1), computing in model.dtype. frozen=True: a model that only
    scores the batch's tokens, with no grad (the reference model; a fork's second frozen model, such
    as a teacher, is one more call). adapters: a config section with lora_rank > 0 (train_grpo's
    `model`): LoRA adapters on the frozen base (lora.py), A drawn from train.seed."""
    import lora
    from model import Transformer
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
    # what does not train (a frozen model, LoRA's base) is stored in the compute dtype: FSDP2 would
    # cast it to exactly these numbers at each gather, so the same forward in half the memory of
    # fp32 master weights. What trains keeps fp32 master weights (LoRA's adapters: lora.py)
    store = dtype if dtype is not None and (frozen or adapters is not None) else torch.float32
    model = Transformer.from_pretrained(path, dtype=store, device=device)
    if adapters is not None:
        a = adapters
        lora.add(model, a.lora_rank, a.lora_alpha, a.lora_targets, a.lora_dropout, cfg.train.seed)
    model = dist.shard_model(
        model, mesh, param_dtype=dtype,
        activation_checkpointing=cfg.dist.activation_checkpointing and not frozen,
        compile=cfg.dist.compile)
    return model.requires_grad_(False) if frozen else model


def make_optimizer(model, optim, horizon):
    """AdamW over the (sharded) parameters and its LambdaLR schedule from an `optim` config
    section."""
    # fused: one kernel over all parameters; on CPU the step measured 4x faster than the default
    # per-tensor loop
    # what trains: every parameter, or with LoRA the adapters only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=optim.lr,
                            betas=optim.betas, weight_decay=optim.weight_decay, fused=True)
    f = lr_lambda(optim.warmup_steps, optim.schedule, optim.min_lr_ratio, horizon)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, f)


def eval_due(step, cfg):
    """After step `step` (0-based): every `eval.every` steps, and always after the last one."""
    return step == cfg.train.steps - 1 or bool(cfg.eval.every and (step + 1) % cfg.eval.every == 0)


def find_resume(resume, ckpt_dir, steps, rank):
    """(checkpoint dir or None, its step): global rank 0 decides and says what happens, every rank
    learns it."""
    found = [None, 0]
    if rank == 0 and resume:
        ck = checkpoint.latest_checkpoint(ckpt_dir) if resume == "auto" else Path(resume)
        found = [str(ck), int(ck.name.split("_")[-1])] if ck else [None, 0]
        if ck is None:
            print(f"ckpt.resume=auto: no complete checkpoint in {ckpt_dir}, starting from step 0",
                  flush=True)
        elif found[1] >= steps:
            print(f"resume: {ck} is at step {found[1]} and train.steps={steps}: nothing to train "
                  "(raise --train.steps to continue); exporting the checkpoint's model", flush=True)
        else:
            print(f"resume: {ck}, continuing at step {found[1] + 1} of {steps}", flush=True)
    tdist.broadcast_object_list(found, src=0)
    return found


def restore(ckpt_path, model, opt, sched):
    """Resume restoration: model, optimizer, schedule and RNG states in place. -> (skipped_total,
    skipped_run)."""
    if not ckpt_path:
        return 0, 0
    extra = checkpoint.load_checkpoint(ckpt_path, model, opt)
    sched.load_state_dict(extra["sched"])
    # NOTE: nothing in the loops draws from the global RNGs (every stream is seeded from
    # (seed, step)); they are restored anyway so that a fork which adds dropout or random masking
    # still resumes exactly
    if "rng" in extra:
        torch.set_rng_state(extra["rng"])
        random.setstate(extra["py_rng"])
    return tuple(extra.get("skipped", (0, 0)))


def checkpoint_due(step, cfg):
    """After `step` steps: every `ckpt.every` steps (0 = never)."""
    return bool(cfg.ckpt.every) and step % cfg.ckpt.every == 0


def save_checkpoint(out, step, model, opt, sched, skipped) -> int:
    """A checkpoint with what a resume needs beyond the weights (schedule, skip counters, RNG).
    Returns 1 when the save failed (reported; the run goes on), else 0."""
    state = {"sched": sched.state_dict(), "skipped": skipped, "rng": torch.get_rng_state(),
             "py_rng": random.getstate()}
    return int(checkpoint.save_checkpoint(out / "ckpt", step, model, opt, state) is None)


def export(model, out, cfg, path):
    """The run's end: <out>/hf, a Hugging Face checkpoint vLLM, transformers and train_grpo.py open
    (collective on trainers). With LoRA (model.lora_rank > 0) that is the base checkpoint at `path`
    with the adapters merged, and <out>/adapter holds the adapters alone in PEFT's format
    (lora.py)."""
    import lora
    m = cfg.model
    adapter = (out / "adapter", lora.peft_config(m.lora_rank, m.lora_alpha, m.lora_targets,
                                                 m.lora_dropout, path)) if m.lora_rank else None
    return checkpoint.export_hf(model, out / "hf", tokenizer_dir=path, adapter=adapter)


def run_main(main):
    """The trainers' `__main__`: a config error is one clear line; a failed collective names the
    lost rank(s)."""
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
