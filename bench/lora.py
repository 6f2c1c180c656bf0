"""LoRA against full fine-tuning, side by side in one run: what a sync carries, its time, the step,
the update's share of it, and the trainer's memory, with and without a KL to the reference.

Each setting is the real trainer under torchrun (bench/step.py's run_grpo): 1 trainer rank + 1 vLLM
generator rank, on SmolLM2-135M-Instruct by default (configs/smollm2_cpu.py's workload: 8 prompts x
8 samples, <= 32 tokens, in fp32 as the real-model demo runs), warm-up steps dropped, medians
over the measured ones:

    full        every parameter trains, syncs, and has AdamW state
    lora r8     model.lora_rank=8 (alpha 16, every Linear of every block): adapters train and sync;
                the generator folds them into its base (lora.Merger)
    lora r32    the same at rank 32

and each again with loss beta = 0.04, where full fine-tuning loads a second, frozen copy of the
model as the reference and LoRA scores the reference with its adapters off (no copy): the
trainer's peak RSS difference is the memory the second model no longer takes.

Figures per setting: sync/bytes (exact), sync/seconds as the trainer rank sees it (the wire: the
generator folds and reloads after the last tensor arrives, and that time lands in the next step's
wait), step and update (perf/train_s) seconds, and each rank's peak RSS. The machine's roofline
comes first, as in every bench result. Then the torch generator's decode on merged weights
(what a sync gives it) against the adapted module unmerged (`decode`), and vLLM's on the merged
checkpoint against vLLM serving the adapter itself with enable_lora (`vllm`), and the
generator's merge alone (`merge`).

    .venv/bin/python bench/lora.py                          # bench/results/lora_smollm2.json
    .venv/bin/python bench/lora.py --model tiny --steps 2 --warmup 1 --out /tmp/l.json   # smoke run
    .venv/bin/python bench/lora.py --parts=decode,vllm     # the decode comparisons alone
    .venv/bin/python bench/lora.py --parts=merge           # the generator's merge alone
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import step  # noqa: E402  (bench/step.py: run_grpo)

SETTINGS = {"full": [], "lora_r8": ["--model.lora_rank=8", "--model.lora_alpha=16"],
            "lora_r32": ["--model.lora_rank=32", "--model.lora_alpha=64"]}


def adapted_model(ckpt, rank):
    """SmolLM2 (or `ckpt`) with rank-`rank` adapters whose B looks trained (zero would be the
    base), and the same weights merged into a plain model."""
    import torch
    import lora
    from model import Transformer
    adapted = lora.add(Transformer.from_pretrained(ckpt), rank, 2.0 * rank, seed=0)
    g = torch.Generator().manual_seed(0)
    for m in lora.adapted(adapted).values():
        m.lora_B.data.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.01)
    merged = Transformer.from_pretrained(ckpt)
    full = {n: p.detach() for n, p in adapted.named_parameters()}
    merged.load_state_dict(lora.fold(full, 2.0), strict=False)  # a tied lm_head is embed_tokens
    return adapted, merged, full


def decode(ckpt, rank=8, rows=64, tokens=32, repeats=3):
    """The torch generator on LoRA weights, merged (what the trainer's sync gives it: a plain model,
    oneDNN-packed Linears on CPU) against unmerged (the adapted module itself: each LoRALinear runs
    its own forward, which the packed path leaves alone). Greedy, the same prompts; best of
    `repeats` seconds each, and whether the two decode the same tokens."""
    import time
    from generator import TorchGenerator
    adapted, merged, _ = adapted_model(ckpt, rank)
    out = {}
    for name, model in (("merged", merged), ("unmerged", adapted)):
        gen = TorchGenerator(model, tokenizer_path=ckpt)
        times, ids = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            ids = [c[0].token_ids for c in gen.generate(PROMPTS[:rows], temperature=0.0,
                                                        max_tokens=tokens, stop_token_ids=[])]
            times.append(time.perf_counter() - t0)
        out[name] = dict(seconds=min(times), ids=ids)
    same = sum(a == b for a, b in zip(out["merged"]["ids"], out["unmerged"]["ids"]))
    return dict(rows=rows, tokens=tokens, rank=rank, merged_s=out["merged"]["seconds"],
                unmerged_s=out["unmerged"]["seconds"],
                unmerged_vs_merged=out["unmerged"]["seconds"] / out["merged"]["seconds"],
                same_greedy_rows=f"{same}/{rows}")


def merge(ckpt, ranks=(8, 32), repeats=3):
    """lora.Merger alone, the generator's side of a LoRA sync once the adapters have arrived: every
    base tensor read through the checkpoint's memory map (a warm page cache: best of `repeats`)
    and scale B A added to each target. Its bytes per second scale the cost to a bigger model
    (docs/lora.md#why-merge-on-the-generator)."""
    import time
    import lora
    out = []
    for rank in ranks:
        _, _, full = adapted_model(ckpt, rank)
        sent = [(n, t) for n, t in full.items() if n.endswith((".lora_A", ".lora_B"))]
        merger, times = lora.Merger(ckpt, rank, 2.0 * rank), []
        for _ in range(repeats):
            t0, nbytes = time.perf_counter(), 0
            for _, w in merger(iter(sent)):
                nbytes += w.numel() * w.element_size()
            times.append(time.perf_counter() - t0)
        out.append(dict(rank=rank, seconds=min(times), merged_bytes=nbytes,
                        gb_per_s=nbytes / min(times) / 1e9))
    return out


PROMPTS = [[1, 5 + i % 100, 28, 2] for i in range(256)]


def vllm_serve(ckpt, rank=8, rows=64, tokens=32, repeats=3):
    """vLLM on the same LoRA weights two ways, each engine in its own process: the merged checkpoint
    (what nanoforge's sync gives it: a plain model) against the base with vLLM serving the adapter
    itself (enable_lora, max_lora_rank; a LoRARequest naming PEFT's files on disk, as a per-sync
    reload would). Greedy, the same prompts; best of `repeats` seconds each, the rows decoded
    alike, and the largest logprob difference where the tokens agree."""
    import subprocess
    import lora
    _, merged, full = adapted_model(ckpt, rank)
    with tempfile.TemporaryDirectory() as tmp:
        merged.save_pretrained(Path(tmp, "merged"), tokenizer_dir=ckpt)
        lora.save_adapter(full, Path(tmp, "adapter"),
                          lora.peft_config(rank, 2 * rank, lora.TARGETS, 0.0, ckpt))
        out = {}
        for mode, model, adapter in (("merged", Path(tmp, "merged"), None),
                                     ("lora", ckpt, Path(tmp, "adapter"))):
            job = dict(mode=mode, model=str(model), adapter=adapter and str(adapter), rank=rank,
                       rows=rows, tokens=tokens, repeats=repeats,
                       out=str(Path(tmp, f"{mode}.json")))
            subprocess.run([sys.executable, __file__, "--serve", json.dumps(job)], check=True)
            out[mode] = json.loads(Path(tmp, f"{mode}.json").read_text())
    a, b = out["merged"], out["lora"]
    diff = max(abs(p - q) for ra, rb, ia, ib in zip(a["logp"], b["logp"], a["ids"], b["ids"])
               for p, q, u, v in zip(ra, rb, ia, ib) if u == v)
    return dict(rows=rows, tokens=tokens, rank=rank, merged_s=a["seconds"],
                enable_lora_s=b["seconds"], enable_lora_vs_merged=b["seconds"] / a["seconds"],
                same_greedy_rows=f"{sum(x == y for x, y in zip(a['ids'], b['ids']))}/{rows}",
                max_logp_diff=diff)


def serve(job):
    """One engine of vllm_serve(), in this process."""
    import os
    import time
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest
    lora_args = (dict(enable_lora=True, max_lora_rank=job["rank"], max_loras=1)
                 if job["adapter"] else {})
    llm = LLM(model=job["model"], dtype="float32", max_model_len=256, seed=0,
              skip_tokenizer_init=True, kv_cache_memory_bytes=256 << 20, enforce_eager=True,
              enable_chunked_prefill=False, max_num_batched_tokens=4096, **lora_args)
    req = job["adapter"] and LoRARequest("policy", 1, job["adapter"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:job["rows"]]]
    sp = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True, logprobs=0,
                        detokenize=False)
    times = []
    for _ in range(job["repeats"]):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=req or None)
        times.append(time.perf_counter() - t0)
    rows = [o.outputs[0] for o in outs]
    Path(job["out"]).write_text(json.dumps(dict(
        seconds=min(times), ids=[list(r.token_ids) for r in rows],
        logp=[[r.logprobs[t][tok].logprob for t, tok in enumerate(r.token_ids)] for r in rows])))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny (the random tiny checkpoint)")
    p.add_argument("--steps", type=int, default=4, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and not counted")
    p.add_argument("--betas", default="0,0.04", help="loss beta values, comma-separated")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_smollm2.json"))
    p.add_argument("--parts", default="train,decode,vllm,merge",
                   help="train (the settings under torchrun), decode (torch generator), vllm "
                        "(merged vs enable_lora) and/or merge (lora.Merger alone); parts given "
                        "replace those parts in an existing --out")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # vllm_serve()'s engine process
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if a.serve:
        return serve(json.loads(a.serve))
    parts = a.parts.split(",")
    import machine
    roof = machine.roofline()  # first: the figures this run's speeds are read against
    if a.model == "smollm2":
        import fetch_model
        config, ckpt = "configs/smollm2_cpu.py", str(fetch_model.fetch_smollm2())
    else:
        config, ckpt = "configs/tiny.py", None
    results = []
    for beta in (float(b) for b in a.betas.split(",")) if "train" in parts else ():
        for name, extra in SETTINGS.items():
            with tempfile.TemporaryDirectory() as tmp:
                rows, rss, wall = step.run_grpo(
                    [*extra, f"--loss.kwargs={{'beta': {beta}, 'agg': 'token_mean'}}",
                     "--rollout.backend=vllm", "--model.dtype=float32"],
                    a.warmup + a.steps + 1, tmp, nproc=2, config=config, ckpt=ckpt)
            rows = rows[a.warmup:a.warmup + a.steps]
            med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
            res = dict(setting=name, beta=beta, overrides=extra, sync_bytes=med("sync/bytes"),
                       sync_s=med("sync/seconds"), step_s=med("perf/step_s"),
                       train_s=med("perf/train_s"), ref_s=med("perf/ref_s"),
                       gen_wait_s=med("perf/wait_s"), mismatch=max(r["mismatch/abs_diff"]
                                                                   for r in rows),
                       peak_rss_mb={f"rank{r}": mb for r, mb in sorted(rss.items())}, wall_s=wall)
            res["train_share"] = res["train_s"] / res["step_s"]
            results.append(res)
            print(f"beta={beta} {name:9s} sync {res['sync_bytes'] / 2**20:8.2f} MiB "
                  f"in {res['sync_s']:.3f} s | step {res['step_s']:.2f} s, update "
                  f"{res['train_s']:.2f} s ({res['train_share']:.0%}) | trainer RSS "
                  f"{rss.get(0, 0):.0f} MB | mismatch {res['mismatch']:.1e}", flush=True)
    full = {r["beta"]: r for r in results if r["setting"] == "full"}
    for r in results:
        f = full[r["beta"]]
        r["sync_bytes_vs_full"] = r["sync_bytes"] / f["sync_bytes"]
        r["step_s_vs_full"] = r["step_s"] / f["step_s"]
        r["trainer_rss_vs_full_mb"] = r["peak_rss_mb"]["rank0"] - f["peak_rss_mb"]["rank0"]
    out = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    if "train" in parts:
        out.update(model=a.model, config=config, steps=a.steps, warmup=a.warmup,
                   layout="1 trainer + 1 vLLM rank (torchrun, gloo)", results=results,
                   goal=dict(sync_bytes_vs_full_at_r8=0.03), machine=roof)
    if "decode" in parts:
        out.update(decode=decode(ckpt or data_tiny(), repeats=3), decode_machine=roof)
    if "vllm" in parts:
        out.update(vllm_serve=vllm_serve(ckpt or data_tiny(), repeats=3), vllm_machine=roof)
    if "merge" in parts:
        out.update(merge=merge(ckpt or data_tiny()), merge_machine=roof)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    if "decode" in parts:
        dec = out["decode"]
        print(f"torch generator decode, {dec['rows']} rows x {dec['tokens']} tokens: merged "
              f"{dec['merged_s']:.2f} s, unmerged {dec['unmerged_s']:.2f} s "
              f"({dec['unmerged_vs_merged']:.2f}x), same greedy rows {dec['same_greedy_rows']}")
    if "vllm" in parts:
        v = out["vllm_serve"]
        print(f"vLLM decode, {v['rows']} rows x {v['tokens']} tokens: merged "
              f"{v['merged_s']:.2f} s, enable_lora {v['enable_lora_s']:.2f} s "
              f"({v['enable_lora_vs_merged']:.2f}x), same greedy rows {v['same_greedy_rows']}, "
              f"max logprob diff {v['max_logp_diff']:.1e}")
    for m in out["merge"] if "merge" in parts else ():
        print(f"merge, rank {m['rank']}: {m['merged_bytes'] / 2**20:.0f} MiB of merged weights in "
              f"{m['seconds']:.3f} s ({m['gb_per_s']:.2f} GB/s)")


def data_tiny():
    import data
    return data.make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0)


if __name__ == "__main__":
    main()
