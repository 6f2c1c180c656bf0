"""Checkpoints: atomic distributed save and resume (torch.distributed.checkpoint), and the Hugging
Face export.

What a checkpoint holds. <ckpt_dir>/step_<N>/ has the model's and AdamW's shards (DCP writes every
trainer rank's own shards in parallel and reshards on load, so a run may resume on another mesh) and
one `extra_rank<r>.pt` per rank: what a resume needs beyond the weights (LR schedule, skip counters,
RNG states, which differ between ranks).

The atomicity protocol. A save is four local steps, each followed by one all-reduce over the trainer
ranks that tells every rank whether any rank failed (`_all_ok`):

    1. prepare   rank 0 makes step_N.tmp/ (removing a leftover one)
    2. shards    every rank writes its DCP shards into step_N.tmp/
    3. extra     every rank writes extra_rank<r>.pt
    4. commit    rank 0 renames step_N.tmp -> step_N (an older step_N, from before a resume, is
                 moved to step_N.old first), then writes step_N/COMPLETE, fsynced, and only then
                 deletes step_N.old

COMPLETE is written last, so its presence means every file above it is on disk: `latest_checkpoint`
takes only directories that have it and removes the rest. A SIGKILL at any point leaves either the
previous newest checkpoint or the new one, never a torn one that a resume would load. A failure on
any rank (disk full, no permission, DCP's own error) is agreed on by all trainer ranks at the next
`_all_ok`: every rank takes the same branch (a rank that skipped the collective would leave the
others waiting forever), the failure is reported with the free disk space, the partial files are
removed, and the run goes on with the previous checkpoint still the newest complete one.

The export. `export_hf` gathers full tensors (DTensor.full_tensor(), collective over the trainer
mesh) and trainer rank 0 writes a Hugging Face checkpoint (config.json + safetensors + tokenizer
files) that vLLM and transformers open as-is; a tied lm_head is stored once, as Hugging Face does.

Left out: asynchronous checkpointing (the save blocks the step), keeping only the last K
checkpoints.
"""
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
# a BaseException: caught by name
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

import dist
import lora
import weight_sync
import model as model_lib

# a checkpoint holds what trains: a frozen tensor (a LoRA run's base) equals the checkpoint the run
# loads it from, at every resume
TRAINED = StateDictOptions(ignore_frozen_params=True)
# loading: dcp.load fails on any trained tensor the checkpoint lacks; the frozen ones stay as loaded
LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def _trained_state(model, optimizer):
    """(model, optimizer) state dicts of what trains. torch keeps a tied lm_head of a frozen
    embedding (its second name): dropped too."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def _group_rank():
    group = dist.trainer_group()
    return tdist.get_rank(group) if group is not None else tdist.get_rank()


def _all_ok(ok: bool) -> bool:
    """True on every trainer rank iff it is True on all of them (and a barrier): after a local
    failure every rank must take the same branch, or the others would wait forever in the next
    collective."""
    flag = torch.tensor([0.0 if ok else 1.0])
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=dist.trainer_group())
    return flag.item() == 0.0


def save_checkpoint(ckpt_dir, step, model, optimizer, extra: dict) -> Path | None:
    """Model + optimizer (sharded, DCP) + this rank's `extra` into <ckpt_dir>/step_<step>/. Trainer
    ranks only.
    Returns the path, or None on every rank if any rank failed to write (reported on stderr; nothing
    partial is left, the previous checkpoint stays valid, the run can go on)."""
    ckpt_dir = Path(ckpt_dir)
    final, tmp, old = (ckpt_dir / f"step_{step}{suffix}" for suffix in ("", ".tmp", ".old"))
    rank, err = _group_rank(), None

    # one local step, unless an earlier one failed; then every rank learns if any rank failed
    def attempt(fn):
        nonlocal err
        if err is None:
            try:
                fn()
            except (Exception, CheckpointException) as e:
                # OSError, torch.save's RuntimeError, DCP's own
                err = e
        return _all_ok(err is None)

    def prepare():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    def write_shards():
        model_sd, optim_sd = _trained_state(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp,
                 process_group=dist.trainer_group())

    # per rank: RNG states differ between ranks. Fault "enospc": a real ENOSPC from /dev/full
    def write_extra():
        torch.save(extra, "/dev/full" if dist.fault("enospc", step)
                   else tmp / f"extra_rank{rank}.pt")
        dist.fault("kill_ckpt", step)  # every file written, no marker yet

    def commit():
        if rank == 0:
            # re-saving a step (after a resume): the old copy goes only once the new one is in
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            # written last: its presence means every file above is there
            with open(final / "COMPLETE", "w") as f:
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(old, ignore_errors=True)

    # each attempt() ends in a collective with the same answer on every rank: all ranks stop at the
    # same point
    if attempt(prepare) and attempt(write_shards) and attempt(write_extra) and attempt(commit):
        return final
    if err is not None:
        free = shutil.disk_usage(ckpt_dir).free / 2**20 if ckpt_dir.exists() else float("nan")
        print(f"WARNING: checkpoint {final} not saved (rank {rank}: {type(err).__name__}: {err}; "
              f"{free:.0f} MiB free on that disk); "
              "the previous checkpoint stays the newest complete one", file=sys.stderr, flush=True)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "COMPLETE").exists():
            shutil.rmtree(final, ignore_errors=True)
            if old.exists():
                old.rename(final)
    _all_ok(True)
    return None


def latest_checkpoint(ckpt_dir) -> Path | None:
    """Newest step_<N> with a COMPLETE marker. Partial ones (a crash mid-save) are removed by
    rank 0. Call it at startup, not while a save is in flight."""
    ckpt_dir, best = Path(ckpt_dir), None
    if not ckpt_dir.is_dir():
        return None
    for p in ckpt_dir.glob("step_*"):
        n = p.name.removeprefix("step_")
        if p.is_dir() and n.isdigit() and (p / "COMPLETE").exists():
            best = max(best or (-1, p), (int(n), p))
        elif not tdist.is_initialized() or tdist.get_rank() == 0:
            print(f"removing partial checkpoint {p} (no COMPLETE marker)", file=sys.stderr,
                  flush=True)
            shutil.rmtree(p, ignore_errors=True)
    return best and best[1]


def is_complete(path) -> bool:
    return Path(path, "COMPLETE").exists()


def load_checkpoint(path, model, optimizer) -> dict:
    """Restore model + optimizer in place (any mesh: DCP reshards); returns this rank's `extra`."""
    path = Path(path)
    # the target layout: our shards of every tensor
    model_sd, optim_sd = _trained_state(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=dist.trainer_group())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=LOAD_TRAINED)
    extra = path / f"extra_rank{_group_rank()}.pt"
    if not extra.exists():  # resumed on more ranks than saved: fall back to rank 0's
        extra = path / "extra_rank0.pt"
    return torch.load(extra, weights_only=False)


def export_hf(model, path, tokenizer_dir=None, adapter=None):
    """Full weights as a Hugging Face checkpoint (collective on trainers; trainer rank 0 writes).
    With LoRA adapters, `adapter` (a dir, and the lora.peft_config dict) gets them alone in PEFT's
    format, and the weights are the base checkpoint with the adapters merged (lora.Merger)."""
    rank = _group_rank() if tdist.is_initialized() else 0
    adapted = bool(lora.adapted(model))  # with LoRA only the adapters are gathered
    full = {name: t.to("cpu", copy=True)
            for name, t in weight_sync.full_params(model, trained_only=adapted) if rank == 0}
    if rank == 0 and adapted:
        lora.save_adapter(full, *adapter)
        # merged onto the base checkpoint on disk, as the generators merge each sync (the trainer
        # may hold its frozen base in bf16: run.load_model)
        conf = adapter[1]
        merge = lora.Merger(conf["base_model_name_or_path"], conf["r"], conf["lora_alpha"])
        full = dict(merge(full.items()))
    if rank == 0:
        with torch.device("meta"):  # no random init; to_empty() keeps a tied lm_head tied
            out = model_lib.Transformer(model.cfg)
        out = out.to_empty(device="cpu")
        if model.cfg.tie_word_embeddings:  # to_empty() gives each module its own tensor: re-tie
            out.lm_head.weight = out.model.embed_tokens.weight
        missing = out.load_state_dict(full, strict=False).missing_keys
        if set(missing) - {"lm_head.weight"} or (missing and not model.cfg.tie_word_embeddings):
            raise RuntimeError(f"export_hf: no full tensor for {missing}")
        out.name_or_path = getattr(model, "name_or_path", None)
        out.save_pretrained(path, tokenizer_dir=tokenizer_dir)
    if tdist.is_initialized():
        tdist.barrier(dist.trainer_group())
    return Path(path)
