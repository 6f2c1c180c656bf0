"""Where the GRPO update's time goes at a real model's size, and what each lever buys: one process, 2 cores.

The update is train_grpo.update itself (forward with shared prompts, chunked logprob + entropy, GRPO loss, backward,
grad clip, AdamW) on one step's batch of SmolLM2-135M-Instruct: the step's real prompts (data.step_batch of the
workload's config) and responses of exactly --response tokens (random ids: the cost depends on shapes, not on
content). Each variant builds its own model and optimizer, runs one untimed update, then --repeats timed ones:

    fsdp_fp32      what train_grpo runs in one process: FSDP2 over a 1-rank mesh, fp32, fused AdamW
    padded_fp32    fsdp_fp32 with the responses never packed (packing.py), each micro-batch padded to its longest
    plain_fp32     the bare module, no fully_shard (a 1-rank FSDP2 still gathers and frees every block)
    fsdp_bf16      model.dtype = "bfloat16": FSDP2 computes in bf16 from fp32 master weights (fp32 grads, AdamW)
    adamw_loop     fsdp_fp32 with torch's CPU default AdamW (a loop over the parameters; fused=False)
    autograd_logp  fsdp_fp32 with the logprob/entropy chunk left to autograd (the implementation before
                   model.ChunkLogp: checkpointed log_softmax / gather / exp chain)
    chunk_<n>      fsdp_fp32 with the logprob/entropy chunk at n tokens instead of 1024
    compile        plain_fp32 under torch.compile (needs a C++ compiler)
    fsdp_compiled  fsdp_fp32 with dist.compile: each block torch.compile'd inside FSDP2 (needs a C++ compiler)

Reported per variant: median update seconds, its achieved GFLOP/s (packing.forward_flops x 3) against a fp32 and a
bf16 2048^3 matmul measured in the same run, the optimizer step's share, the reference forward (no grad) in the
same precision, and |logp - logp_fp32| on the batch's response tokens (the mismatch bf16 costs). --profile adds
torch.profiler's top operators by self CPU time of one extra, untimed update of the first variant and fsdp_bf16.

    .venv/bin/python bench/update.py                     # bench/results/update.json
    .venv/bin/python bench/update.py --variants fsdp_fp32 plain_fp32 --repeats 1 --profile
"""
import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import dist  # noqa: E402
import generator  # noqa: E402
import losses  # noqa: E402
import machine  # noqa: E402
import model as model_lib  # noqa: E402
import packing  # noqa: E402
import checks  # noqa: E402
import rollout  # noqa: E402
import train_grpo  # noqa: E402
from generator import Completion  # noqa: E402
from vs_trl import G, SIZES, train_overrides  # noqa: E402

CHUNKED_LOGPROBS, RESPONSE_LOGP = model_lib.chunked_logprobs, packing.response_logp
VARIANTS = ["fsdp_fp32", "padded_fp32", "plain_fp32", "fsdp_bf16", "adamw_loop", "autograd_logp", "chunk_256",
            "chunk_4096", "compile", "fsdp_compiled"]


def make_step_batch(cfg, tok, R, path, sampled=False):
    """One step's batch as train_grpo builds it: the step's prompts, G responses of R tokens each, or (sampled)
    the G responses the model itself samples for them at the workload's temperature, up to R tokens: real lengths."""
    train, _, _ = rollout.load_tasks(cfg, tok)
    problems = data.step_batch(train, 0, cfg.rollout.prompts_per_step, cfg.train.seed)
    gen = torch.Generator().manual_seed(0)
    if sampled:
        engine = generator.make_generator("torch", path, max_model_len=cfg.data.max_prompt_tokens + R, seed=0)
        groups = engine.generate([p["prompt_ids"] for p in problems], n=G, temperature=cfg.rollout.temperature,
                                 max_tokens=R)
        del engine
    else:
        groups = [[Completion(p["prompt_ids"], torch.randint(3, 49_000, (R,), generator=gen).tolist(), "", [0.0] * R,
                              "length", 0) for _ in range(G)] for p in problems]
    batch = packing.make_batch(problems, groups, tok.pad_token_id)
    adv = torch.randn(len(batch["ids"]), generator=gen)
    return batch, adv


def autograd_chunked_logprobs(hidden, lm_head, targets, temperature=1.0, return_entropy=False, chunk=1024):
    """The previous model.chunked_logprobs, for the autograd_logp variant: each chunk checkpointed, autograd's
    backward through div, log_softmax, gather, exp and mul."""
    from torch.utils.checkpoint import checkpoint

    def one(h, t):
        logp_all = torch.log_softmax(lm_head(h).float() / temperature, dim=-1)
        logp = logp_all.gather(-1, t[:, None]).squeeze(-1)
        return (logp, -(logp_all.exp() * logp_all).sum(-1)) if return_entropy else (logp,)
    B, T, D = hidden.shape
    h, t = hidden.reshape(B * T, D), targets.reshape(B * T)
    outs = [checkpoint(one, h[i:i + chunk], t[i:i + chunk], use_reentrant=False) if torch.is_grad_enabled()
            else one(h[i:i + chunk], t[i:i + chunk]) for i in range(0, B * T, chunk)]
    res = [torch.cat(parts).view(B, T).clone() for parts in zip(*outs)]
    return tuple(res) if return_entropy else res[0]


def build(variant, path, mesh, cfg):
    model_lib.chunked_logprobs = autograd_chunked_logprobs if variant == "autograd_logp" else CHUNKED_LOGPROBS
    packing.response_logp = functools.partial(RESPONSE_LOGP, packed=False) if variant == "padded_fp32" \
        else RESPONSE_LOGP
    m = model_lib.Transformer.from_pretrained(path)
    if variant not in ("plain_fp32", "compile"):
        dist.shard_model(m, mesh, param_dtype=torch.bfloat16 if variant == "fsdp_bf16" else None,
                         compile=variant == "fsdp_compiled")
    if variant.startswith("chunk_"):
        n, forward = int(variant.split("_")[1]), m.forward
        m.forward = lambda *a, **kw: forward(*a, **kw, logits_chunk=n)
    opt = torch.optim.AdamW(m.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, fused=variant != "adamw_loop")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    if variant == "compile":
        m = torch.compile(m)
    return m, opt, sched


def time_update(m, opt, sched, loss_fn, batch, adv, cfg, repeats, prof=None):
    step_opt = opt.step
    opt_s = []

    def timed_step(*a, **kw):  # the optimizer step's own share of the update
        t0 = time.perf_counter()
        out = step_opt(*a, **kw)
        opt_s.append(time.perf_counter() - t0)
        return out
    opt.step = timed_step
    times = []
    for i in range(repeats + 1):  # the first is untimed: warm-up (and compilation)
        t0 = time.perf_counter()
        sums = train_grpo.update(m, opt, sched, loss_fn, batch, adv, None, None, cfg, "cpu", i)[0]
        times.append(time.perf_counter() - t0)
    if prof is not None:  # one more, profiled, outside the timings (the profiler slows what it records)
        with prof:
            train_grpo.update(m, opt, sched, loss_fn, batch, adv, None, None, cfg, "cpu", repeats + 1)
    return (statistics.median(times[1:]), statistics.median(opt_s[1:repeats + 1]), times[0], sums["perf/pad_frac"],
            sums["perf/update_gflop"])


def top_ops(prof, n=15):
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [dict(op=e.key, self_s=round(e.self_cpu_time_total / 1e6, 3), share=round(e.self_cpu_time_total / total, 3),
                 calls=e.count) for e in rows]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="short", choices=list(SIZES["135m"]["workloads"]))
    p.add_argument("--response", type=int, default=None, help="response tokens per row (default: the workload's)")
    p.add_argument("--sampled", action="store_true", help="responses the model samples (real lengths, up to "
                   "--response) instead of exactly --response random tokens")
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "update.json"))
    a = p.parse_args()
    import fetch_model
    path = fetch_model.fetch_smollm2()
    cfg = train_grpo.parse_config([SIZES["135m"]["config"], *train_overrides("135m", a.workload, path)])
    R = a.response or cfg.rollout.max_tokens
    tok = data.Tokenizer(path)
    batch, adv = make_step_batch(cfg, tok, R, path, a.sampled)
    loss_fn = losses.LOSSES["grpo"](**checks.loss_kwargs(cfg))
    os.environ.setdefault("WORLD_SIZE", "1")
    roles = dist.get_roles(0)
    dist.init_distributed(roles)
    mesh = dist.trainer_mesh(roles, 1, 1)
    # the limit at 2048^3 and at the update's own shape: its tokens x hidden against the MLP's hidden x intermediate
    c = model_lib.ModelConfig.from_hf(json.loads((Path(path) / "config.json").read_text()))
    tokens = cfg.rollout.prompts_per_step * (batch["P"] - 1) + len(batch["ids"]) * R
    mlp = f"{tokens}x{c.hidden_size}x{c.intermediate_size}"
    roof = machine.roofline([(tokens, c.hidden_size, c.intermediate_size)])
    print(f"batch {tuple(batch['ids'].shape)} (P={batch['P']}, R={R}, {tokens} tokens padded); GFLOP/s of a 2048^3 "
          f"matmul fp32 {roof['fp32_gflops']:.0f}, bf16 {roof.get('bf16_gflops', 0):.0f}; at the MLP's shape fp32 "
          f"{roof['fp32_gflops_' + mlp]:.0f}, bf16 {roof.get('bf16_gflops_' + mlp, 0):.0f} "
          f"({roof['threads']} threads; bf16 0 = no bf16 path on this CPU, not timed)", flush=True)
    results, base_logp, profiles = {}, None, {}
    for v in a.variants:
        m, opt, sched = build(v, path, mesh, cfg)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
            if a.profile and v in (a.variants[0], "fsdp_bf16") else None
        try:
            # the reference forward (no grad), on the checkpoint's weights: every variant's logp are comparable
            logp = packing.no_grad_logp(m, batch, cfg.train.micro_batch, 1.0)  # warm-up
            t0 = time.perf_counter()
            logp = packing.no_grad_logp(m, batch, cfg.train.micro_batch, 1.0)
            ref_s = time.perf_counter() - t0
            t, t_opt, first_s, pad_frac, gflop = time_update(m, opt, sched, loss_fn, batch, adv, cfg, a.repeats, prof)
        except Exception as e:  # compile needs a working C++ toolchain: a failure is a result, not a crash
            results[v] = dict(error=f"{type(e).__name__}: {str(e)[:500]}")
            print(f"{v:12s} failed: {results[v]['error'][:200]}", flush=True)
            continue
        base_logp = logp if base_logp is None else base_logp
        mask = batch["mask"].bool()
        results[v] = dict(update_s=t, first_update_s=first_s, optimizer_s=t_opt, pad_frac=pad_frac, gflop=gflop,
                          gflops=gflop / t,
                          over_fp32_matmul=gflop / t / roof["fp32_gflops"], ref_forward_s=ref_s,
                          logp_abs_diff_vs_first=float((logp - base_logp)[mask].abs().mean()))
        if prof is not None:
            profiles[v] = top_ops(prof)
        r = results[v]
        print(f"{v:12s} update {t:6.2f} s (AdamW {t_opt:.2f}) pad_frac {pad_frac:.3f} {r['gflops']:6.1f} GFLOP/s = "
              f"{r['over_fp32_matmul']:.2f} of fp32 matmul; ref fwd {ref_s:.2f} s; |dlogp| {r['logp_abs_diff_vs_first']:.2e}", flush=True)
        del m, opt
        lens = batch["attn"][:, batch["P"]:].sum(1).tolist()
        Path(a.out).write_text(json.dumps(dict(workload=a.workload, batch_shape=list(batch["ids"].shape), P=batch["P"],
                                               R=R, sampled=a.sampled, response_lens=lens, tokens=tokens, roofline=roof,
                                               variants=results, profiles=profiles, date=time.strftime("%Y-%m-%d %H:%M")), indent=2) + "\n")
    for v, ops in profiles.items():
        print(f"\n{v}: top operators by self CPU time")
        for o in ops:
            print(f"  {o['self_s']:7.3f} s {o['share']:6.1%} {o['calls']:6d}  {o['op']}")
    dist.shutdown()


if __name__ == "__main__":
    main()
