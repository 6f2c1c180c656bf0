"""The torch generator's decode step against this machine's floor, by part, at SmolLM2-135M: one process, its threads.

A decode step feeds one token per row through the model with a KV cache, then samples. Its floor, from the same
run's roofline (machine.roofline):

    floor = max(weight bytes / read GB/s, FLOPs / fp32 matmul GFLOP/s) + KV-cache bytes / read GB/s

(the weights are read once per step whatever the batch; the FLOPs are packing.forward_flops of the step; each
cached key and value is read once: a prompt's once for the G = 8 rows that share it, as the generator holds it). The
step is timed whole (model forward at the last of S + 1 cached positions, --prompt of them a prompt's, then
generator.sample at T = 1), then by part, each alone on the same shapes:

    matmuls    every nn.Linear of the model (7 per block and the lm_head) on (rows, 1, in) inputs, called as model.py
               calls them
    attention  per layer: the new key and value written into the cache, then KVCache.attend (kvcache.py)
    sampling   generator.sample on (rows, vocab) fp32 logits at T = 1
    rest       step - the three: norms, RoPE, residual adds, the embedding, and the Python between them

Levers, side by side in the same run: `linear` (F.linear, the generator before) against `onednn` (the weights
reordered for oneDNN, q/k/v and gate/up stacked, machine.onednn_weights: what the generator runs on CPU); the KV
cache `shared` (each prompt's keys held once and attended once for its 8 rows, KVCache.share_prefix: what the
generator runs) against `copied` (the prompt copied into every row, the generator before; its floor reads every
row's copy), and for the copied layout attention `grouped` (a KV head's query heads as the rows of one SDPA, what
KVCache.attend runs) against SDPA's `enable_gqa`. Where the roofline finds a bf16 path, all of it again on a bf16
copy of the model (keys `*_bf16`; the floor at 2 bytes a value and the bf16 matmul rate). Each figure is the median
over --rounds rounds of the best of 3 calls (machine._best_s), every variant measured in every round (so a busy
minute on a shared box hits them alike); min and max are kept. Unless --no-generate, whole generate() calls on a
GRPO-shaped batch (2 GSM8K prompts x 8 samples at T = 1) are timed too, with each matmul lever.

    .venv/bin/python bench/decode.py                        # bench/results/decode.json (minutes)
    .venv/bin/python bench/decode.py --batches 8 --rounds 1 --context 64 --prompt 20 --no-generate   # smoke run
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
import kvcache  # noqa: E402
import machine  # noqa: E402
import packing  # noqa: E402

GSM8K_TEST = ROOT / "data" / "gsm8k" / "test.jsonl"
SUFFIX = {"fp32": "", "bf16": "_bf16"}  # result keys: fp32's as before bf16 was timed
G = 8  # rows a prompt: GRPO's group size (bench/vs_trl.py's)


def step_fns(m, rows, S, prompt, n=G):
    """The step and its parts as zero-argument callables on caches of random values, in the model's dtype (the
    generator's compute dtype: its KV cache and activations follow its weights), in two layouts of one context of
    S + 1 positions a row: `shared` (rows / n prompts of `prompt` positions held once, each row caching only its own
    S + 1 - prompt: kvcache.KVCache.share_prefix, what TorchGenerator runs) and `copied` (every row holding all S + 1:
    the generator before it shared prompts)."""
    cfg, dt = m.cfg, next(m.parameters()).dtype
    L, H, Hk, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    own = S + 1 - prompt
    copied, pre, shared = (kvcache.KVCache(cfg, b, t, dt, "cpu") for b, t in ((rows, S + 1), (rows // n, prompt),
                                                                                 (rows, own)))
    for c in (copied, pre, shared):
        c.k.normal_(), c.v.normal_()
    shared.share_prefix(pre, torch.ones(rows // n, prompt, dtype=torch.long), n)
    tok, pos = torch.randint(0, cfg.vocab_size, (rows, 1)), torch.full((rows, 1), S)
    rng, logits = torch.Generator().manual_seed(0), torch.randn(rows, cfg.vocab_size)
    x_h, x_o, x_i = (torch.randn(rows, 1, n, dtype=dt) for n in (cfg.hidden_size, H * D, cfg.intermediate_size))

    def matmuls():  # every Linear, called as model.py calls them (so qkv and gate_up as one matmul each on oneDNN)
        for block in m.model.layers:
            block.self_attn.qkv(x_h), block.self_attn.o_proj(x_o), block.mlp.gate_up(x_h), block.mlp.down_proj(x_i)
        m.lm_head(x_h)
    q, k, v = (torch.randn(rows, h, 1, D, dtype=dt) for h in (H, Hk, Hk))

    def step(cache, at):
        out = m(tok, position_ids=pos, kv_cache=cache, cache_pos=at)[:, -1]
        generator.sample(out.float(), 1.0, -1, 1.0, rng)

    def attention(cache, at, gqa=False):  # per layer: the new key and value into the cache, then attend
        for i in range(L):
            cache.k[i, :, :, at:at + 1], cache.v[i, :, :, at:at + 1] = k, v
            ks, vs = cache.k[i, :, :, :at + 1], cache.v[i, :, :, :at + 1]
            if gqa:
                F.scaled_dot_product_attention(q, ks, vs, enable_gqa=H != Hk)
            else:
                cache.attend(q, ks, vs, None, i)
    return dict(step=lambda: step(shared, own - 1), step_copied=lambda: step(copied, S),
                matmuls=matmuls,
                attention_shared=lambda: attention(shared, own - 1), attention_copied=lambda: attention(copied, S),
                attention_gqa=lambda: attention(copied, S, gqa=True),
                sampling=lambda: generator.sample(logits, 1.0, -1, 1.0, rng))


def floor(cfg, m, rows, S, roof, kv_positions):
    """In the model's dtype: bf16 halves the bytes and runs its FLOPs at the roofline's bf16 matmul rate.
    kv_positions: the cached positions the step reads, over all rows (a shared prompt's once)."""
    size, rate = (2, roof["bf16_gflops"]) if next(m.parameters()).dtype == torch.bfloat16 else (4, roof["fp32_gflops"])
    weight_bytes = sum(mod.weight.numel() * size for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    kv_bytes = 2 * cfg.num_hidden_layers * kv_positions * cfg.num_key_value_heads * cfg.head_dim * size
    flops = packing.forward_flops(cfg, rows, rows * (S + 1), rows)
    gb = roof["read_gbps"] * 1e9
    parts = dict(weights_s=weight_bytes / gb, flops_s=flops / (rate * 1e9), kv_s=kv_bytes / gb)
    return dict(floor_s=max(parts["weights_s"], parts["flops_s"]) + parts["kv_s"], weight_bytes=weight_bytes,
                kv_bytes=kv_bytes, gflop=flops / 1e9, **parts)


def summary(samples):
    return dict(median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples), samples=samples)


def time_step(m, cfg, rows, S, prompt, roof, rounds):
    """The step and its parts, each lever in every round; medians, floors, the rest and step / floor. The step as
    the generator runs it (shared prompts) with either matmul lever, and with the prompts copied (oneDNN)."""
    fns = step_fns(m, rows, S, prompt)
    packed = machine.onednn_weights(m, rows)
    samples = {}
    for _ in range(rounds):
        for lever, weights in (("linear", {}), ("onednn", packed)):
            with machine.linears_on(m, weights):
                for part in ("step", "matmuls") + (("step_copied",) if weights else ()):
                    key = part if part == "step_copied" else f"{part}_{lever}"
                    samples.setdefault(key, []).append(machine._best_s(fns[part]))
        for part in ("attention_shared", "attention_copied", "attention_gqa", "sampling"):
            samples.setdefault(part, []).append(machine._best_s(fns[part]))
    r = {k: summary(v) for k, v in samples.items()}
    med = {k: v["median_s"] for k, v in r.items()}
    fl = floor(cfg, m, rows, S, roof, rows // G * prompt + rows * (S + 1 - prompt))
    fl_copied = floor(cfg, m, rows, S, roof, rows * (S + 1))
    for lever in ("linear", "onednn"):
        parts = med[f"matmuls_{lever}"] + med["attention_shared"] + med["sampling"]
        r[f"rest_{lever}_s"] = med[f"step_{lever}"] - parts
        r[f"step_{lever}_over_floor"] = med[f"step_{lever}"] / fl["floor_s"]
    r["step_copied_over_floor_copied"] = med["step_copied"] / fl_copied["floor_s"]
    return dict(rows=rows, context=S, prompt=prompt, samples_per_prompt=G, dtype=str(next(m.parameters()).dtype)[6:],
                onednn_linears=len(packed), floor=fl, floor_copied=fl_copied, **r)


def print_step(r, dt):
    fl, med = r["floor"], {k: v["median_s"] for k, v in r.items() if isinstance(v, dict) and "median_s" in v}
    print(f"\n{r['rows']} rows, {r['context'] + 1} positions ({r['prompt']} of a prompt shared by {G} rows), {dt}: "
          f"floor {fl['floor_s'] * 1e3:.1f} ms (weights {fl['weights_s'] * 1e3:.1f}, FLOPs {fl['flops_s'] * 1e3:.1f}, "
          f"KV {fl['kv_s'] * 1e3:.1f}); prompts copied to each row: {r['floor_copied']['floor_s'] * 1e3:.1f} ms")
    for lever in ("linear", "onednn"):
        print(f"  {lever:7s} step {med[f'step_{lever}'] * 1e3:7.1f} ms = {r[f'step_{lever}_over_floor']:.2f} x floor "
              f"| matmuls {med[f'matmuls_{lever}'] * 1e3:6.1f}, attention {med['attention_shared'] * 1e3:5.1f}, "
              f"sampling {med['sampling'] * 1e3:4.1f}, rest {r[f'rest_{lever}_s'] * 1e3:5.1f}", flush=True)
    print(f"  prompts copied (oneDNN): step {med['step_copied'] * 1e3:7.1f} ms = "
          f"{r['step_copied_over_floor_copied']:.2f} x its floor | attention: grouped "
          f"{med['attention_copied'] * 1e3:5.1f}, SDPA enable_gqa {med['attention_gqa'] * 1e3:5.1f}", flush=True)


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
    p.add_argument("--prompt", type=int, default=90,
                   help="of them, the prompt's (a GSM8K question in the chat template: ~80-100)")
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
                results[key] = time_step(mm, cfg, rows, S, a.prompt, roof, a.rounds)
                print_step(results[key], dt)
    if not a.no_generate:
        tok = data.Tokenizer(path)
        qs = [json.loads(line)["question"] for line in open(GSM8K_TEST)][:2]
        prompts = [data.prompt_ids(tok, q) for q in qs]
        # the bf16 generator holds its own bf16 copy, as engine.build_generator makes
        for dt, mm in models.items():
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
