"""Rollout throughput: VLLMGenerator vs TorchGenerator, side by side in one run, at two model sizes and two workloads.

Sizes: `toy` = data.make_tiny_checkpoint (0.9M parameters, random weights: it never stops early) and `smollm2` =
SmolLM2-135M-Instruct from fetch_model.py. Workloads, both with the checkpoint's eos as the stop token:
- `short_sampled`: GRPO's CPU step: 4 arithmetic prompts x 8 samples at T=1, up to 40 tokens (at 135M nearly
  every row runs to the limit);
- `long_greedy`: the held-out eval of a GSM8K run: 32 GSM8K test questions, greedy, up to 256 tokens (at 135M about
  half the rows stop early, between 130 and 230 tokens).
The torch generator is timed twice: as shipped, and with `compact_finished = False` (finished rows stay in the
decode batch until the longest row ends: the loop before this change), so its gain is measured in the same run.

Each timed call follows one untimed warm-up call (vLLM's first generate pays a one-off 8-20 s). Before every vLLM
call the prefix cache is reset: GRPO resets it after each weight update, and a warm cache would otherwise hand
vLLM the warm-up's prompts for free. The torch generator runs first, before any vLLM engine starts: vLLM's CPU
worker pins threads and turns torch.set_num_threads into a no-op for the whole process.

    .venv/bin/python bench/generate.py                    # writes bench/results/generate.json (~5 minutes)
    .venv/bin/python bench/generate.py --sizes toy --repeats 1        # smoke run

Generated tokens per second = sum of completion lengths / wall seconds of one generate() call (best of --repeats).
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
import machine  # noqa: E402
import tasks  # noqa: E402

GSM8K_TEST = ROOT / "data" / "gsm8k" / "test.jsonl"
WORKLOADS = {  # name: (prompt kind, prompts, samples per prompt, temperature, max tokens)
    "short_sampled": ("arith", 4, 8, 1.0, 40),
    "long_greedy": ("gsm8k", 32, 1, 0.0, 256),
}


def workload_prompts(tok, kind, num):
    if kind == "arith":
        qs = [p["question"] + " Answer with just the number." for p in tasks.make_arith(num, seed=0, max_digits=1)]
    else:
        rows = [json.loads(line) for line in open(GSM8K_TEST)][:num]
        qs = [r["question"] + "\nPlease reason step by step, and put your final answer within \\boxed{}." for r in rows]
    return [data.prompt_ids(tok, q) for q in qs]


def time_generate(gen, prompts, n, temperature, max_tokens, repeats):
    kw = dict(n=n, temperature=temperature, seed=0)
    gen.generate(prompts, max_tokens=min(max_tokens, 8), **kw)  # warm-up: one-off kernel/shape setup, not counted
    best = None
    for _ in range(repeats):
        if hasattr(gen, "llm"):
            gen.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = gen.generate(prompts, max_tokens=max_tokens, **kw)
        dt = time.perf_counter() - t0
        lens = [len(c.token_ids) for g in out for c in g]
        if best is None or sum(lens) / dt > best["tok_s"]:
            best = dict(tok_s=sum(lens) / dt, seconds=dt, tokens=sum(lens), rows=len(lens),
                        stopped_early=sum(c.finish_reason == "stop" for g in out for c in g))
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="toy,smollm2")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "generate.json"))
    args = p.parse_args()
    roof = machine.roofline()  # first: the figures this run's speeds are read against
    sizes, workloads = args.sizes.split(","), args.workloads.split(",")

    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for size in sizes:
            if size == "toy":
                paths[size] = data.make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
            else:
                import fetch_model
                paths[size] = fetch_model.fetch_smollm2()
        cases = {}  # (size, workload) -> prompts and settings
        for size in sizes:
            tok = data.Tokenizer(paths[size])
            for w in workloads:
                kind, num, n, temperature, max_tokens = WORKLOADS[w]
                cases[size, w] = dict(prompts=workload_prompts(tok, kind, num), n=n, temperature=temperature,
                                      max_tokens=max_tokens)
        res = {f"{s}/{w}": {} for s, w in cases}
        torch_threads = torch.get_num_threads()
        for size in sizes:  # every torch measurement before the first vLLM engine exists (see the docstring)
            tgen = generator.TorchGenerator(str(paths[size]), max_model_len=1024)
            for (s, w), c in cases.items():
                if s != size:
                    continue
                for name, compact in (("torch", True), ("torch_no_compaction", False)):
                    tgen.compact_finished = compact
                    res[f"{s}/{w}"][name] = time_generate(tgen, c["prompts"], c["n"], c["temperature"],
                                                          c["max_tokens"], args.repeats)
                    print(s, w, name, res[f"{s}/{w}"][name], flush=True)
            del tgen
        for size in sizes:
            vgen = generator.VLLMGenerator(str(paths[size]), max_model_len=1024, kv_cache_memory_bytes=512 << 20,
                                           max_num_seqs=64)
            for (s, w), c in cases.items():
                if s == size:
                    res[f"{s}/{w}"]["vllm"] = time_generate(vgen, c["prompts"], c["n"], c["temperature"],
                                                            c["max_tokens"], args.repeats)
                    print(s, w, "vllm", res[f"{s}/{w}"]["vllm"], flush=True)
            del vgen

    print(f"\n{'size/workload':28s} {'vllm':>9s} {'torch':>9s} {'torch, no compaction':>21s}  vllm/torch  "
          "compaction gain")
    for key, r in res.items():
        r["ratio_vllm_over_torch"] = r["vllm"]["tok_s"] / r["torch"]["tok_s"]
        r["compaction_speedup"] = r["torch"]["tok_s"] / r["torch_no_compaction"]["tok_s"]
        print(f"{key:28s} {r['vllm']['tok_s']:9.1f} {r['torch']['tok_s']:9.1f} {r['torch_no_compaction']['tok_s']:21.1f}"
              f"  {r['ratio_vllm_over_torch']:10.2f}  {r['compaction_speedup']:15.2f}")
    result = dict(workloads={w: dict(zip(("prompts", "num_prompts", "n", "temperature", "max_tokens"), WORKLOADS[w]))
                             for w in workloads},
                  results=res, torch_threads=torch_threads, machine=roof)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
