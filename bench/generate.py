"""Rollout throughput: VLLMGenerator vs TorchGenerator on the same prompts and settings.

Default workload: the tiny random checkpoint from data.make_tiny_checkpoint, 64 arithmetic prompts x 8 samples x
64 new tokens at T=1 (no stop tokens, so every row generates exactly 64 tokens). Each backend gets one untimed
warm-up call (vLLM's first generate pays a one-off 8-17 s), then the best of --repeats timed calls is reported.
The torch generator runs first, before vLLM starts: vLLM's CPU worker pins threads and turns
torch.set_num_threads into a no-op for the whole process, which would skew the torch numbers.

    .venv/bin/python bench/generate.py            # writes bench/results/generate.json
    .venv/bin/python bench/generate.py --prompts 8 --n 2 --tokens 16 --repeats 1  # smoke run

Generated tokens per second = sum of completion lengths / wall seconds of one generate() call.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch  # noqa: E402

import data  # noqa: E402
import generator  # noqa: E402


def time_generate(gen, prompts, args):
    kw = dict(n=args.n, temperature=args.temperature, max_tokens=args.tokens, stop_token_ids=[])
    gen.generate(prompts, seed=0, **kw)  # warm-up: one-off kernel/shape setup, not counted
    best = None
    for r in range(args.repeats):
        t0 = time.perf_counter()
        out = gen.generate(prompts, seed=args.seed, **kw)
        dt = time.perf_counter() - t0
        num_tokens = sum(len(c.token_ids) for g in out for c in g)
        if best is None or num_tokens / dt > best["tok_s"]:
            best = dict(tok_s=num_tokens / dt, seconds=dt, tokens=num_tokens)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=None, help="per-request seeds (vLLM: ~15%% slower on CPU)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "generate.json"))
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = data.make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        tok = data.Tokenizer(ckpt)
        prompts = [data.prompt_ids(tok, ex["question"]) for ex in data.make_arith(args.prompts, seed=0)]
        max_len = max(map(len, prompts)) + args.tokens + 1

        torch_threads = torch.get_num_threads()
        res = {"torch": time_generate(generator.TorchGenerator(str(ckpt), max_model_len=max_len), prompts, args)}
        vgen = generator.VLLMGenerator(str(ckpt), max_model_len=max_len, kv_cache_memory_bytes=256 << 20,
                                       max_num_seqs=args.prompts * args.n)
        res["vllm"] = time_generate(vgen, prompts, args)

    ratio = res["vllm"]["tok_s"] / res["torch"]["tok_s"]
    for name, r in res.items():
        print(f"{name:6s} {r['tok_s']:9.0f} tok/s  ({r['tokens']} tokens in {r['seconds']:.2f} s)")
    print(f"vllm / torch = {ratio:.2f}x")
    result = dict(workload=dict(prompts=args.prompts, n=args.n, max_tokens=args.tokens, temperature=args.temperature,
                                seed=args.seed, mean_prompt_len=sum(map(len, prompts)) / len(prompts), model="make_tiny_checkpoint"),
                  vllm=res["vllm"], torch=res["torch"], ratio_vllm_over_torch=ratio, torch_threads=torch_threads,
                  cpu_count=os.cpu_count(), torch_version=torch.__version__)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")



if __name__ == "__main__":
    main()
