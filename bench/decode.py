"""The torch generator's decode step against this machine's floor, by part, at SmolLM2-135M: one process, its threads.

A decode step feeds one token per row through the model with a KV cache, then samples. Its floor, from the same
run's roofline (machine.roofline):

    floor = max(weight bytes / read GB/s, FLOPs / fp32 matmul GFLOP/s) + KV-cache bytes / read GB/s

(the weights are read once per step whatever the batch; the FLOPs are packing.forward_flops of the step; the KV cache
is read once). The step is timed whole (model forward at cache position S, then generator.sample at T = 1), then
by part, each alone on the same shapes:

    matmuls    every nn.Linear of the model (7 per block and the lm_head) on (rows, 1, in) inputs
    attention  per layer: the new key and value written into the cache, SDPA over the S + 1 cached positions
    sampling   generator.sample on (rows, vocab) fp32 logits at T = 1
    rest       step - the three: norms, RoPE, residual adds, the embedding, the mask, and the Python between them

Levers, side by side in the same run: `linear` (F.linear, the generator before) against `onednn` (the weights
reordered for oneDNN, machine.onednn_weights: what the generator runs on CPU in fp32); attention `gqa` (SDPA with
enable_gqa, what model.Attention runs) against `grouped` (the query heads that share a KV head folded into SDPA's
query dimension). Where the roofline finds a bf16 path, all of it again on a bf16 copy of the model (keys `*_bf16`;
the floor at 2 bytes a value and the bf16 matmul rate; model.Attention runs `grouped` there). Each figure is the
median over --rounds rounds of the best of 3 calls (machine._best_s), every
variant measured in every round (so a busy minute on a shared box hits them alike); min and max are kept. Unless
--no-generate, whole generate() calls on a GRPO-shaped batch (2 GSM8K prompts x 8 samples at T = 1) are timed too,
with each matmul lever.

    .venv/bin/python bench/decode.py                        # bench/results/decode.json (~6 minutes on box B)
    .venv/bin/python bench/decode.py --batches 4 --rounds 1 --context 64 --no-generate   # smoke run
"""
import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import generator  # noqa: E402
import machine  # noqa: E402
import model as model_lib  # noqa: E402
import packing  # noqa: E402

GSM8K_TEST = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
SUFFIX = {"fp32": "", "bf16": "_bf16"}  # result keys: fp32's as before bf16 was timed


def step_fns(m, rows, S):
    """The step and its parts as zero-argument callables on one (rows, S + 1) cache of random values, in the
    model's dtype (the generator's compute dtype: its KV cache and activations follow its weights)."""
    cfg, dt = m.cfg, next(m.parameters()).dtype
    L, H, Hk, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cache = model_lib.KVCache(cfg, rows, S + 1, dt, "cpu")
    cache.k.normal_(), cache.v.normal_()
    mask = torch.ones(rows, S + 1, dtype=torch.long)
    tok, pos = torch.randint(0, cfg.vocab_size, (rows, 1)), torch.full((rows, 1), S)
    rng, logits = torch.Generator().manual_seed(0), torch.randn(rows, cfg.vocab_size)
    linears = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
    xs = [torch.randn(rows, 1, lin.in_features, dtype=dt) for lin in linears]
    q, k, v = (torch.randn(rows, h, 1, D, dtype=dt) for h in (H, Hk, Hk))
    am = model_lib.padding_mask(mask, S, 1)

    def step():
        out = m(tok, position_ids=pos, attention_mask=mask, kv_cache=cache, cache_pos=S)[:, -1]
        generator.sample(out.float(), 1.0, -1, 1.0, rng)

    def attention(grouped):
        for i in range(L):
            cache.k[i, :, :, S:S + 1], cache.v[i, :, :, S:S + 1] = k, v
            ks, vs = cache.k[i, :, :, :S + 1], cache.v[i, :, :, :S + 1]
            if grouped:
                F.scaled_dot_product_attention(q.view(rows, Hk, H // Hk, D), ks, vs, attn_mask=am)
            else:
                F.scaled_dot_product_attention(q, ks, vs, attn_mask=am, enable_gqa=H != Hk)
    return dict(step=step, matmuls=lambda: [lin(x) for lin, x in zip(linears, xs)],
                attention_gqa=lambda: attention(False), attention_grouped=lambda: attention(True),
                sampling=lambda: generator.sample(logits, 1.0, -1, 1.0, rng))


def floor(cfg, m, rows, S, roof):
    """In the model's dtype: bf16 halves the bytes and runs its FLOPs at the roofline's bf16 matmul rate."""
    size, rate = (2, roof["bf16_gflops"]) if next(m.parameters()).dtype == torch.bfloat16 else (4, roof["fp32_gflops"])
    weight_bytes = sum(mod.weight.numel() * size for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    kv_bytes = 2 * cfg.num_hidden_layers * rows * cfg.num_key_value_heads * (S + 1) * cfg.head_dim * size
    flops = packing.forward_flops(cfg, rows, rows * (S + 1), rows)
    gb = roof["read_gbps"] * 1e9
    parts = dict(weights_s=weight_bytes / gb, flops_s=flops / (rate * 1e9), kv_s=kv_bytes / gb)
    return dict(floor_s=max(parts["weights_s"], parts["flops_s"]) + parts["kv_s"], weight_bytes=weight_bytes,
                kv_bytes=kv_bytes, gflop=flops / 1e9, **parts)


def summary(samples):
    return dict(median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples), samples=samples)


def time_step(m, cfg, rows, S, roof, rounds):
    """The step and its parts, each lever in every round; medians, floor and each lever's rest and step / floor."""
    fns = step_fns(m, rows, S)
    packed = machine.onednn_weights(m, rows)
    samples = {}
    for _ in range(rounds):
        for lever, weights in (("linear", {}), ("onednn", packed)):
            with machine.linears_on(weights):
                for part in ("step", "matmuls"):
                    samples.setdefault(f"{part}_{lever}", []).append(machine._best_s(fns[part]))
        for part in ("attention_gqa", "attention_grouped", "sampling"):
            samples.setdefault(part, []).append(machine._best_s(fns[part]))
    r = {k: summary(v) for k, v in samples.items()}
    med = {k: v["median_s"] for k, v in r.items()}
    fl = floor(cfg, m, rows, S, roof)
    att = "attention_grouped" if next(m.parameters()).dtype == torch.bfloat16 else "attention_gqa"  # model.Attention's
    for lever in ("linear", "onednn"):
        r[f"rest_{lever}_s"] = med[f"step_{lever}"] - med[f"matmuls_{lever}"] - med[att] - med["sampling"]
        r[f"step_{lever}_over_floor"] = med[f"step_{lever}"] / fl["floor_s"]
    return dict(rows=rows, context=S, dtype=str(next(m.parameters()).dtype)[6:], onednn_linears=len(packed),
                attention=att, floor=fl, **r)


def print_step(r, dt):
    fl, med = r["floor"], {k: v["median_s"] for k, v in r.items() if isinstance(v, dict) and "median_s" in v}
    print(f"\n{r['rows']} rows, {r['context'] + 1} positions, {dt}: floor {fl['floor_s'] * 1e3:.1f} ms (weights "
          f"{fl['weights_s'] * 1e3:.1f}, FLOPs {fl['flops_s'] * 1e3:.1f}, KV {fl['kv_s'] * 1e3:.1f})")
    for lever in ("linear", "onednn"):
        print(f"  {lever:7s} step {med[f'step_{lever}'] * 1e3:7.1f} ms = "
              f"{r[f'step_{lever}_over_floor']:.2f} x floor | matmuls {med[f'matmuls_{lever}'] * 1e3:6.1f}, "
              f"attention: gqa {med['attention_gqa'] * 1e3:5.1f}, grouped {med['attention_grouped'] * 1e3:5.1f} "
              f"({r['attention'][10:]} runs), "
              f"sampling {med['sampling'] * 1e3:4.1f}, rest {r[f'rest_{lever}_s'] * 1e3:5.1f}", flush=True)


def time_generate(gen, prompts, max_tokens, rounds):
    """Seconds per generated token of whole generate() calls, onednn against linear, alternating."""
    res = {"onednn": [], "linear": []}
    for r in range(rounds + 1):  # round 0 warms both up
        for name in res:
            gen.onednn = name == "onednn"
            gen._packed = None  # each call pays its reordering, as after a weight update
            t0 = time.perf_counter()
            out = gen.generate(prompts, n=8, temperature=1.0, max_tokens=max_tokens, seed=r)
            dt = time.perf_counter() - t0
            if r:
                res[name].append(dt / max(len(c.token_ids) for g in out for c in g))
    gen.onednn = True
    return {name: summary(s) for name, s in res.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--context", type=int, default=300, help="cached positions the step attends to")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--generate-tokens", type=int, default=64)
    p.add_argument("--no-generate", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode.json"))
    a = p.parse_args()
    import fetch_model
    path = fetch_model.fetch_smollm2()
    gen = generator.TorchGenerator(str(path), max_model_len=1024)
    m, cfg, S = gen.model, gen.model.cfg, a.context
    roof = machine.roofline([(b, cfg.hidden_size, cfg.intermediate_size) for b in a.batches])
    print(f"read {roof['read_gbps']:.1f} GB/s, fp32 2048^3 matmul {roof['fp32_gflops']:.0f} GFLOP/s, "
          f"{roof['threads']} threads, {roof['cpu_capability']}", flush=True)
    # bf16 too where the probe found a hardware bf16 path (on AVX2 a bf16 step takes minutes: not timed there)
    models = {"fp32": m, **({"bf16": copy.deepcopy(m).to(torch.bfloat16)} if roof["dtype_probe"]["bf16_path"] else {})}
    results = {}
    with torch.no_grad():
        for dt, mm in models.items():
            for rows in a.batches:
                key = f"rows_{rows}" + SUFFIX[dt]
                results[key] = time_step(mm, cfg, rows, S, roof, a.rounds)
                print_step(results[key], dt)
    if not a.no_generate:
        tok = data.Tokenizer(path)
        qs = [json.loads(line)["question"] for line in open(GSM8K_TEST)][:2]
        prompts = [data.prompt_ids(tok, q) for q in qs]
        for dt, mm in models.items():  # the bf16 generator holds its own bf16 copy, as rollout.build_generator makes
            g = gen if dt == "fp32" else generator.TorchGenerator(mm, tokenizer_path=str(path), max_model_len=1024)
            t0 = time.perf_counter()
            machine.onednn_weights(mm, 16)
            sfx = SUFFIX[dt]
            results["reorder_s" + sfx] = time.perf_counter() - t0
            res = results["generate_s_per_token" + sfx] = time_generate(g, prompts, a.generate_tokens, a.rounds)
            print(f"\ngenerate 2 GSM8K prompts x 8 x {a.generate_tokens} tokens, {dt}, s per token: onednn "
                  f"{res['onednn']['median_s']:.3f}, linear {res['linear']['median_s']:.3f} (reordering the weights "
                  f"{results['reorder_s' + sfx]:.2f} s a call)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(machine=roof, date=time.strftime("%Y-%m-%d %H:%M"), **results), indent=2)
                           + "\n")


if __name__ == "__main__":
    main()
