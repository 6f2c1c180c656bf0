"""Weight-sync bandwidth: weight_sync.broadcast_weights (the real trainer -> generator path) vs a raw broadcast.

Two ranks under torchrun, gloo on CPU: rank 0 is the trainer (the model sharded by dist.shard_model, exactly as
train_grpo.py holds it), rank 1 a generator. For each model and bucket size, in the same process group:

    raw        one dist.broadcast of a flat uint8 buffer of the same number of bytes (the ceiling)
    raw bucketed  one broadcast per bucket of preallocated buffers, no packing: the ceiling for a bucket size
    real       weight_sync.broadcast_weights(...): buckets of whole decoder blocks, tensors >= --direct-kb sent from their own
               memory, the rest packed; the generator receives into two reused buffers and yields zero-copy views;
               receive=None, so the transport alone
    real+load  the same, and the generator copies every tensor into a same-shaped model (TorchGenerator's
               update_weights; vLLM's reload_weights is heavier and is timed inside bench/step.py's sync); a
               checksum then confirms the generator holds the trainer's weights

Figures are GB/s = bytes / seconds (median of --repeats, after one untimed warm-up that also ships the bucket
plan), both ranks timed from a barrier to a barrier. Ratio = real / raw, target >= 0.8. Models: the tiny random
checkpoint (3.5 MB) and a random Qwen2.5-0.5B-shaped model (494M params, 1.98 GB in fp32, the dtype the trainer
keeps its master weights in).

    .venv/bin/python bench/sync.py            # writes bench/results/sync.json
    .venv/bin/python bench/sync.py --models tiny --buckets 1 4 --repeats 1     # smoke run
    .venv/bin/python bench/sync.py --models qwen2-0.5b --buckets 64 --direct-kb 64 --out sync_64k.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Qwen2.5-0.5B's shape (config.json of the Hub checkpoint), random weights
QWEN2_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                 rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position_embeddings=32768,
                 tie_word_embeddings=True, attention_bias=True, qk_norm=False)


def make_model(name, tmp):
    import data
    from model import ModelConfig, Transformer
    import torch
    if name == "tiny":
        return Transformer.from_pretrained(data.make_tiny_checkpoint(Path(tmp) / "tiny", seed=0))
    with torch.device("meta"):
        model = Transformer(ModelConfig(**QWEN2_05B))
    model = model.to_empty(device="cpu")
    model.lm_head.weight = model.model.embed_tokens.weight  # to_empty() unties
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(0.02 + 1e-4 * i)  # touches every page; one value per tensor, so the checksum sees a mix-up
    return model


def timed(fn, group, repeats):
    import torch.distributed as tdist
    fn()  # warm-up (and, for the real path, the one-off bucket-plan broadcast)
    times = []
    for _ in range(repeats):
        tdist.barrier(group)
        t0 = time.perf_counter()
        fn()
        tdist.barrier(group)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _checksum(model_or_dict):
    """A position-weighted sum, so a tensor delivered at the wrong offset or under the wrong name changes it."""
    import torch
    from torch.distributed.tensor import DTensor
    items = model_or_dict.named_parameters() if hasattr(model_or_dict, "named_parameters") else model_or_dict.items()
    total = 0.0
    for i, (name, t) in enumerate(sorted(items, key=lambda kv: kv[0])):
        t = t.detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t
        total += (i + 1) * float(t.double().sum()) + float(t.reshape(-1)[:: max(1, t.numel() // 97)].double().sum())
    return total


def worker(args):
    sys.path.insert(0, str(ROOT))
    import tempfile
    import torch
    import torch.distributed as tdist
    import dist
    import weight_sync
    if args.direct_kb is not None:
        weight_sync._DIRECT_BYTES = args.direct_kb * 1024  # NOTE: private knob, measured here
    roles = dist.get_roles(1)
    dist.init_distributed(roles, 600)
    mesh = dist.trainer_mesh(roles, 1, 1)
    group = weight_sync.sync_group(roles)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model, sink = None, None
            if roles.is_trainer:
                model = dist.shard_model(make_model(name, tmp), mesh)
                nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
                meta = [nbytes, [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]]
            else:
                meta = [None, None]
            tdist.broadcast_object_list(meta, src=0, group=group)
            nbytes, shapes = meta
            if roles.is_generator:  # the "load" target: a same-shaped set of tensors, like a torch generator
                sink = {n: torch.empty(s, dtype=d) for n, s, d in shapes}

            def load(named):
                for n, t in named:
                    sink[n].copy_(t)

            raw_buf = torch.empty(nbytes, dtype=torch.uint8)
            raw_buf.fill_(1)
            row = dict(model=name, bytes=nbytes, params=nbytes // 4, direct_bytes=weight_sync._DIRECT_BYTES, buckets=[])
            for mb in args.buckets:
                # the ceiling, re-measured beside every bucket size: the shared machine drifts by +-20%
                raw_s = timed(lambda: tdist.broadcast(raw_buf, src=0, group=group), group, args.repeats)
                weight_sync._SYNC_PLANS.clear()  # NOTE: private cache; a new bucket size needs a new plan on both sides
                real_s = timed(lambda: weight_sync.broadcast_weights(model, group, roles, mb), group, args.repeats)
                if sink:  # start from zeros, so the checksum below sees what the sync delivered
                    for t in sink.values():
                        t.zero_()
                load_s = timed(lambda: weight_sync.broadcast_weights(model, group, roles, mb, receive=load if sink else None),
                               group, args.repeats)
                mine = _checksum(model if roles.is_trainer else sink)
                sent = [mine if roles.is_trainer else None]
                tdist.broadcast_object_list(sent, src=0, group=group)
                if abs(sent[0] - mine) > 1e-6 * max(1.0, abs(sent[0])):
                    raise RuntimeError(f"broadcast_weights delivered different weights: checksum {mine} vs {sent[0]}")
                plan = weight_sync._SYNC_PLANS[group]
                bucket_bufs = [torch.ones(b[0], dtype=torch.uint8) for b in plan]  # preallocated, no packing
                rawb_s = timed(lambda: [tdist.broadcast(b, src=0, group=group) for b in bucket_bufs], group,
                               args.repeats)
                del bucket_bufs
                direct = sum(off >= b[1] for b in plan for *_, off in b[2])
                row["buckets"].append(dict(
                    raw_s=raw_s, raw_gbps=nbytes / raw_s / 1e9, bucket_mb=mb, num_buckets=len(plan),
                    num_direct=direct, num_packed=sum(len(b[2]) for b in plan) - direct,
                    real_s=real_s, real_gbps=nbytes / real_s / 1e9,
                    real_over_raw=raw_s / real_s, load_s=load_s, load_gbps=nbytes / load_s / 1e9,
                    load_over_raw=raw_s / load_s, raw_bucketed_s=rawb_s, raw_bucketed_over_raw=raw_s / rawb_s))
                if roles.rank == 0:
                    b = row["buckets"][-1]
                    print(f"{name} {mb:5d} MB x{b['num_buckets']:3d}: raw {b['raw_gbps']:.2f} GB/s, "
                          f"real {b['real_gbps']:.2f} ({b['real_over_raw']:.2f}), +load {b['load_gbps']:.2f} "
                          f"({b['load_over_raw']:.2f}), raw in buckets ({b['raw_bucketed_over_raw']:.2f})", flush=True)
            results.append(row)
            del model, sink, raw_buf
    if roles.rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "qwen2-0.5b"], choices=["tiny", "qwen2-0.5b"])
    p.add_argument("--buckets", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024], help="bucket sizes, MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--direct-kb", type=int, default=None,
                   help="tensors this big are broadcast from their own memory (default: weight_sync.py's threshold)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sync.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import machine
    roof = machine.roofline()  # first: the figures this run's speeds are read against
    if args.worker:
        return worker(args)
    tmp_out = Path(args.out).with_suffix(".tmp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           "--models", *args.models, "--buckets", *map(str, args.buckets), "--repeats", str(args.repeats),
           "--out", str(tmp_out)] + (["--direct-kb", str(args.direct_kb)] if args.direct_kb is not None else [])
    res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        sys.exit(f"bench/sync.py: torchrun failed (rc={res.returncode})")
    rows = json.loads(tmp_out.read_text())
    tmp_out.unlink()
    print(f"\n{'model':11s} {'bucket MB':>9s} {'buckets':>7s} {'raw GB/s':>8s} {'real GB/s':>9s} {'real/raw':>8s} "
          f"{'+load/raw':>9s} {'raw bucketed/raw':>16s}")
    for r in rows:
        for b in r["buckets"]:
            print(f"{r['model']:11s} {b['bucket_mb']:9d} {b['num_buckets']:7d} {b['raw_gbps']:8.2f} "
                  f"{b['real_gbps']:9.2f} {b['real_over_raw']:8.2f} {b['load_over_raw']:9.2f} "
                  f"{b['raw_bucketed_over_raw']:16.2f}")
        best = max(r["buckets"], key=lambda b: b["real_over_raw"])
        r["best"] = dict(bucket_mb=best["bucket_mb"], real_over_raw=best["real_over_raw"])
    result = dict(backend="gloo", world_size=2, repeats=args.repeats, target_real_over_raw=0.8, models=rows,
                  machine=roof)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
