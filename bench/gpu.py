"""GPU figures on one device (run by bench/gpu.sh): a real GRPO loop, trainer MFU, logprob peak memory, torch-generator
tokens/s. No network, no vLLM: the torch generator (train_grpo's GPU fallback without vLLM) generates.

0. GRPO, one GPU, colocated: a random Qwen2.5-0.5B-shaped checkpoint (494M params, vocabulary 151936, the arithmetic
   tokenizer: ids it does not know decode to nothing, so the reward is 0 and the entropy bonus supplies the gradient)
   is written on the spot, then train_grpo.main runs 20 steps of configs/tiny.py in this process in bf16 (16 prompts
   x 8 samples x 256 tokens). Reported: the step breakdown (medians of steps 3-19; "other" = step - gen - ref - train
   - sync, reward scoring included), generation tokens/s, peak GPU memory (torch.cuda.max_memory_allocated), and
   the update's MFU with the formula of 1. over the response tokens only (each prompt's ~20 tokens, run once per
   prompt, are left out: a lower bound).
1. Trainer step, FSDP2 on a world of one (dist.shard_model, bf16 params, fp32 reduce and fp32 master weights +
   AdamW, as train_grpo.py runs it): forward with targets (chunked fp32 logprobs + entropy), a policy-gradient
   surrogate loss, backward, grad clip, optimizer step. MFU = model FLOPs / step time / peak bf16 FLOP/s, with
       FLOPs per token = 6 * params + 12 * layers * heads * head_dim * seq_len     (PaLM appendix B; the attention
       term counts the full T x T score matrix, no causal discount; params include the tied lm_head once)
2. Logprob peak memory at T = 4096 (batch 1): torch.cuda.max_memory_allocated above the resident weights for a
   no-grad logprob forward (what ref/old logprobs cost) and for forward + backward, beside what materialising the
   full fp32 logits would take (T * V * 4 bytes).
3. Torch generator: generated tokens/s for prompts x samples x new tokens with a preallocated KV cache, bf16.
4. Parity on the GPU, the oracle being transformers: the 0.5B checkpoint of 0. loaded by model.py and by
   transformers' AutoModelForCausalLM on the same device, logits compared in fp32 and in bf16 on one batch. The bf16
   gap is set beside transformers' own bf16-vs-fp32 gap, the scale bf16 rounding alone produces.
5. grpo_rank: 0.'s loop at one trainer rank of configs/gsm8k.py (8 prompts x 8 x 512 tokens, micro-batch 16, beta
   0.04 with the reference model) on a random Qwen2.5-1.5B-shaped checkpoint, 5 steps (medians of steps 3-4): the
   8-GPU estimate's T_train in docs/gpu.md, measured. --profile adds torch.profiler's top operators by device time
   of its second update (that run's timings then carry the profiler's cost: read the table, not the step);
   --compile runs it with dist.compile on.
6. update: train_grpo.update alone at 5.'s shape (8 prompts of ~20 tokens x 8 responses of 128-512), per variant
   <eager|compiled|nocudnn>_<micro-batch>[_fresh]: blocks eager, torch.compile'd (dist.compile), or eager with
   cuDNN's attention backend off (SDPA picks another kernel: is the per-shape cost cuDNN's plans?); _fresh draws a
   new batch (new shapes) for every update, as training does. Each variant starts from the same weights: one
   untimed update, then --repeats timed ones (every sample is kept).
7. grpo_lora (not a default part: --parts grpo_lora, ~2 minutes): 0.'s loop with LoRA (rank 32,
   alpha 64, every Linear; docs/lora.md), 6 steps with beta 0.04, on the GPU path that CPU tests
   cannot reach: adapters on a bf16 base under FSDP2, the reference as the base with adapters off,
   each sync folding CUDA adapters into the checkpoint read from disk (lora.Merger), the export's
   merge. Reported as 0. is, plus the bytes a sync carries.
Each part runs on its own: one that fails records its error and the others still run; the JSON is rewritten after
every part, so a run cut short keeps what it measured.

    bash bench/gpu.sh                 # on the GPU machine: prints a table, writes bench/results/gpu.json
    bash bench/gpu.sh --parts grpo_rank --profile --rank-steps 2    # one part, profiled
    bash bench/gpu.sh --parts update --variants eager_16_fresh nocudnn_16_fresh compiled_16_fresh --repeats 8
    bash bench/gpu.sh --cpu-smoke     # anywhere: the same code at toy sizes on CPU (checks it runs, not speed)
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import importlib.util  # noqa: E402

# What the GRPO part needs beyond PyTorch (the probes need none of it): without them it is skipped, said out loud.
MISSING = [m for m in ("safetensors", "tokenizers", "jinja2", "tqdm") if importlib.util.find_spec(m) is None]
try:
    import safetensors  # noqa: F401  model.py imports it at the top; the probes load and save no checkpoint
except ImportError:
    stub = types.ModuleType("safetensors")
    stub.safe_open = None
    stub.torch = types.ModuleType("safetensors.torch")
    stub.torch.save_file = None
    sys.modules.update({"safetensors": stub, "safetensors.torch": stub.torch})

import torch  # noqa: E402

import dist  # noqa: E402
import generator  # noqa: E402
import machine  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

QWEN25_15B = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                  rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position_embeddings=32768,
                  tie_word_embeddings=True, attention_bias=True, qk_norm=False)
TOY = dict(QWEN25_15B, vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=32)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 FLOP/s (SXM datasheets)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, head_dim=64, vocab_size=151936)  # data.make_tiny_checkpoint's arguments
GRPO = dict(steps=20, prompts=16, samples=8, max_tokens=256, micro_batch=32)
# One trainer rank of configs/gsm8k.py (48 prompts / 6 ranks x 8 samples x 512 tokens, micro-batch 16, beta 0.04 with
# the reference model) at Qwen2.5-1.5B's shape: what docs/gpu.md's 8-GPU estimate calls T_train, measured.
QWEN25_15B_CKPT = {k: QWEN25_15B[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")}
GRPO_RANK = dict(steps=5, prompts=8, samples=8, max_tokens=512, micro_batch=16, beta=0.04)
PARTS = ("grpo", "parity", "generate", "logprob_memory", "train", "grpo_rank", "update",
         "grpo_lora")
DEFAULT_PARTS = PARTS[:-1]  # ~9 minutes on one H200; grpo_lora by name (the smoke runs every part)
GRPO_LORA = dict(GRPO, steps=6, beta=0.04)
LORA = ("--model.lora_rank=32", "--model.lora_alpha=64")
# the update levers at grpo_rank's batch (8 prompts x 8 samples, 20 prompt tokens, responses up to 512)
UPDATE = dict(prompts=8, samples=8, prompt_tokens=20, max_tokens=512, repeats=3)
UPDATE_VARIANTS = ("eager_16", "eager_32", "compiled_16", "compiled_32")
GRPO_SMOKE = dict(QWEN25_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, vocab_size=512)


def random_model(cfg, device, dtype):
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty() unties
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0, 0.02)
    return model.to(dtype)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_train(cfg, device, batch, seq, steps, mesh):
    model = dist.shard_model(random_model(cfg, device, torch.float32), mesh, param_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99))
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    adv = torch.randn(batch, 1, device=device)
    times = []
    for i in range(steps + 2):  # 2 warm-up steps
        sync(device)
        t0 = time.perf_counter()
        logp, ent = model(ids[:, :-1], targets=ids[:, 1:], return_entropy=True)  # (B, T) fp32
        loss = -(logp * adv).mean()  # entropy is computed (as train_grpo logs it) but not in the loss
        loss.backward()
        dist.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    step_s = statistics.median(times)
    flops_per_token = 6 * params + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq
    flops = flops_per_token * batch * seq
    del model, opt
    return dict(params=params, batch=batch, seq=seq, step_s=step_s, tokens_per_s=batch * seq / step_s,
                flops_per_step=flops, achieved_tflops=flops / step_s / 1e12)


def bench_logprob_memory(cfg, device, seq):
    model = random_model(cfg, device, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, seq + 1), device=device)
    out = dict(seq=seq, full_fp32_logits_mb=seq * cfg.vocab_size * 4 / 2**20)
    if device.type != "cuda":
        with torch.no_grad():
            model(ids[:, :-1], targets=ids[:, 1:])
        return {**out, "no_grad_peak_mb": None, "fwd_bwd_peak_mb": None}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(ids[:, :-1], targets=ids[:, 1:])
    torch.cuda.synchronize()
    out["no_grad_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    torch.cuda.reset_peak_memory_stats()
    logp = model(ids[:, :-1], targets=ids[:, 1:])
    logp.mean().backward()
    torch.cuda.synchronize()
    out["fwd_bwd_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20  # includes the bf16 grads
    del model
    return out


def bench_generate(cfg, device, prompts, n, prompt_len, new_tokens):
    model = random_model(cfg, device, torch.bfloat16)
    gen = generator.TorchGenerator(model, max_model_len=prompt_len + new_tokens + 1)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    gen.generate(batch[:2], n=2, max_tokens=8, stop_token_ids=[])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    out = gen.generate(batch, n=n, max_tokens=new_tokens, stop_token_ids=[], seed=0)
    sync(device)
    dt = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for grp in out for c in grp)
    del model, gen
    return dict(prompts=prompts, n=n, prompt_len=prompt_len, new_tokens=new_tokens, tokens=tokens, seconds=dt,
                tokens_per_s=tokens / dt)


def bench_grpo(ckpt, shape, run, device, workdir, peak, name="grpo", profile=False, compile=False,
               extra=()):
    """train_grpo.main in this process (it joins and leaves its own world of one); see the module docstring.
    profile: torch.profiler around the second step's update, its top operators by device time kept
    as text. extra: more train_grpo overrides (grpo_lora's adapters)."""
    import train_grpo
    update, calls, tables = train_grpo.update, [], []

    def profiled_update(*args, **kwargs):
        calls.append(1)
        if len(calls) != 2:  # the first update pays the kernels' warm-up
            return update(*args, **kwargs)
        acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (device.type == "cuda")
        with torch.profiler.profile(activities=acts) as prof:
            out = update(*args, **kwargs)
            sync(device)
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        tables.append(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
        return out
    if profile:
        train_grpo.update = profiled_update
    argv = [str(ROOT / "configs" / "tiny.py"), f"--model.path={ckpt}",
            "--model.dtype=bfloat16", "--rollout.backend=torch", "--dist.generator_ranks=0",
            f"--train.steps={run['steps']}", f"--rollout.prompts_per_step={run['prompts']}",
            f"--rollout.group_size={run['samples']}", f"--rollout.max_tokens={run['max_tokens']}",
            f"--train.micro_batch={run['micro_batch']}", "--loss.entropy_coef=0.01", "--eval.every=0",
            f"--eval.num_problems={run['prompts']}", "--log.plot_every_s=1e9", f"--log.out_dir={workdir}",
            f"--log.run={name}", f"--loss.kwargs={{'beta': {run.get('beta', 0.0)}, 'agg': 'token_mean'}}",
            "--rollout.overlong_cache=0",  # tiny.py's length penalty needs max_tokens > 16; a speed probe needs none
            f"--dist.compile={compile}", *extra]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        train_grpo.main(argv)
    finally:
        train_grpo.update = update
    wall = time.perf_counter() - t0
    if tables:
        print(tables[0], flush=True)
    rows = [json.loads(line) for line in open(Path(workdir) / name / "metrics.jsonl")]
    rows = [r for r in rows if "perf/step_s" in r][2:-1] or [r for r in rows if "perf/step_s" in r]  # no warm-up/eval
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    parts = {"gen": med("perf/gen_s"), "ref": med("perf/ref_s") + med("perf/old_s"), "train": med("perf/train_s"),
             "sync": med("perf/sync_s")}
    step = med("perf/step_s")
    parts["other"] = step - sum(parts.values())
    cfg = ModelConfig(**{**QWEN25_15B, **shape})
    params = _count_params(cfg)
    resp = med("rollout/response_len")
    tokens = run["prompts"] * run["samples"] * resp  # response tokens through the update
    seq = resp + 20  # ~20 prompt tokens
    flops = (6 * params + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq) * tokens
    return dict(params=params, steps=run["steps"], step_s=step, parts=parts, wall_s=wall,
                ref_tflops=flops / 3 / parts["ref"] / 1e12 if parts["ref"] > 1e-3 else None,
                gen_tokens_per_s=statistics.median(r["rollout/response_len"] * run["prompts"] * run["samples"]
                                                   / r["perf/gen_s"] for r in rows),
                update_tflops=flops / parts["train"] / 1e12, update_mfu=flops / parts["train"] / peak if peak else None,
                peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                mismatch_abs_diff=med("mismatch/abs_diff"), config=run,
                profile=tables[0] if tables else None, overrides=list(extra),
                sync_bytes=med("sync/bytes") if "sync/bytes" in rows[0] else None)


def bench_update(cfg, device, mesh, run, variants):
    """train_grpo.update itself, per variant (micro-batch, blocks compiled or eager, the same batch every update or a
    fresh one): the levers against the host-bound update grpo_rank measured. Every variant starts from the same
    random weights (seed 0), runs one untimed update (warm-up; compilation for a compiled variant), then
    run["repeats"] timed ones. The logprobs compared across variants are those of batch 0, before any update."""
    import checks
    import losses
    import packing
    import run as run_lib
    import train_grpo
    from generator import Completion
    P, R, G = run["prompt_tokens"], run["max_tokens"], run["samples"]

    def make(seed):  # GSM8K-like spread: lengths uniform in [R/4, R], prompts of P +- 25%: packing and shapes vary
        g = torch.Generator().manual_seed(seed)
        problems = [dict(prompt_ids=torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist())
                    for n in torch.randint(P * 3 // 4, P * 5 // 4 + 1, (run["prompts"],), generator=g).tolist()]
        groups = [[Completion(p["prompt_ids"], torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist(), "",
                              [0.0] * n, "length", 0) for n in torch.randint(R // 4, R + 1, (G,), generator=g).tolist()]
                  for p in problems]
        r = torch.zeros(len(problems), G)
        return train_grpo.StepData(problems, groups, r, r, packing.make_batch(problems, groups, 0),
                                   adv=torch.randn(len(problems) * G, 1, generator=g))
    st = make(0)
    batch = st.batch
    out, base_logp = dict(config=run, response_tokens=int(batch["mask"].sum())), None
    for name in variants:  # "eager_16", "compiled_32", "compiled_16_fresh" (a new batch, new shapes, every update)
        mode, mb, *fresh = name.split("_")
        torch._dynamo.reset()  # each variant compiles from scratch
        tcfg = train_grpo.parse_config([str(ROOT / "configs" / "tiny.py"), f"--train.micro_batch={mb}",
                                        "--loss.kwargs={'beta': 0.0, 'agg': 'token_mean'}", "--loss.entropy_coef=0.01",
                                        "--optim.lr=1e-6"])
        loss_fn = losses.LOSSES[tcfg.loss.name](**checks.loss_kwargs(tcfg))
        torch.manual_seed(0)
        model = dist.shard_model(random_model(cfg, device, torch.float32), mesh, param_dtype=torch.bfloat16,
                                 compile=mode == "compiled")
        opt, sched = run_lib.make_optimizer(model, tcfg.optim, 10)
        cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp and mode != "nocudnn")
        try:
            logp = packing.no_grad_logp(model, batch, int(mb), 1.0)
            base_logp = logp if base_logp is None else base_logp
            times = []
            free_gpu(device)
            for i in range(run["repeats"] + 1):  # the first: warm-up, and compilation
                b = make(i + 1) if fresh else st  # built before the clock
                sync(device)
                t0 = time.perf_counter()
                sums = train_grpo.update(model, opt, sched, loss_fn, b, tcfg, device, i)[0]
                sync(device)
                times.append(time.perf_counter() - t0)
            step = statistics.median(times[1:])
            mask = batch["mask"].bool()
            out[name] = dict(update_s=step, first_update_s=times[0], samples=times[1:],
                             tflops=sums["perf/update_gflop"] / step / 1e3, pad_frac=sums["perf/pad_frac"],
                             logp_abs_diff_vs_first=float((logp.cpu() - base_logp.cpu())[mask].abs().mean()),
                             graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
                             peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
        except Exception as e:  # noqa: BLE001  one variant failing (out of memory, a compile error) is a result
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
        print(f"update {name}: {out[name]}", flush=True)
        del model, opt, sched
        free_gpu(device)
    return out


def bench_parity(ckpt, vocab, device, batch, seq):
    """max |logits - transformers' logits| for model.py on `device`, in fp32 and bf16 (see the module docstring)."""
    from transformers import AutoModelForCausalLM
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    out, hf32 = {}, None
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ours = Transformer.from_pretrained(ckpt, dtype=dtype, device=device).eval()
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device).eval()
        with torch.no_grad():
            a, b = ours(ids).float(), hf(ids).logits.float()
        hf32 = b if hf32 is None else hf32
        out[f"{name}_max_abs"] = (a - b).abs().max().item()
        out[f"{name}_vs_hf_fp32_max_abs"] = (a - hf32).abs().max().item()
        out[f"hf_{name}_vs_hf_fp32_max_abs"] = (b - hf32).abs().max().item()
        del ours, hf
    return dict(batch=batch, seq=seq, logits_scale=hf32.abs().max().item(), **out)


def free_gpu(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_part(res, key, fn, out):
    """res[key] = fn(), or the error if it fails; the JSON rewritten either way (a one-shot machine keeps the rest)."""
    t0 = time.perf_counter()
    try:
        res[key] = fn()
    except Exception as e:  # noqa: BLE001  reported, not hidden: the table and the JSON say which part failed and why
        import traceback
        traceback.print_exc()
        res[key] = {"error": f"{type(e).__name__}: {e}"}
    res.setdefault("part_s", {})[key] = time.perf_counter() - t0
    print(f"{key}: {res[key]}", flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2) + "\n")


def _count_params(cfg):
    with torch.device("meta"):  # shapes only: a tied lm_head counted once
        return sum(p.numel() for p in Transformer(cfg).parameters())


def part_rows(res, key, title, rows):
    """A part's table rows: rows(result), or one FAILED row with its error, or none where the part did not run."""
    r = res.get(key)
    return [] if not r else [(title, "FAILED: " + r["error"])] if "error" in r else rows(r)


def table(res):
    """The results as a two-column Markdown table; a failed part shows its error."""
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731

    def grpo(title):
        return lambda gr: [
            (f"{title}, colocated, bf16, torch generator",
             f"{gr['config']['steps']} steps of {gr['config']['prompts']} x {gr['config']['samples']} x "
             f"{gr['config']['max_tokens']} tokens, beta {gr['config'].get('beta', 0.0)}: {gr['step_s']:.2f} s/step, "
             f"run {gr['wall_s']:.0f} s"),
            (f"{title} step: gen / ref / train / sync / other", " / ".join(f"{v:.3f}" for v in gr["parts"].values())
             + " s"),
            (f"{title} generation", f"{gr['gen_tokens_per_s']:.0f} tok/s"),
            (f"{title} update TFLOP/s, MFU; ref TFLOP/s", f"{gr['update_tflops']:.1f}, "
             f"{fmt(gr['update_mfu'], '.1%')}; {fmt(gr.get('ref_tflops'), '.1f')}"),
            (f"{title} peak GPU memory", f"{fmt(gr['peak_mem_gb'], '.1f')} GB"),
            (f"{title} mismatch/abs_diff (trainer vs generator)", f"{gr['mismatch_abs_diff']:.2e}")]
    rows = [("device", res["device"])]
    rows += part_rows(res, "grpo", "GRPO", grpo("GRPO"))
    rows += part_rows(res, "grpo_rank", "GRPO, one gsm8k.py trainer rank", grpo("GRPO, one gsm8k.py trainer rank"))
    rows += part_rows(res, "grpo_lora", "GRPO, LoRA r32", lambda gr: grpo("GRPO, LoRA r32")(gr) + [
        ("GRPO, LoRA r32 sync",
         f"{fmt(gr['sync_bytes'] and gr['sync_bytes'] / 2**20, '.1f')} MiB a sync"
         + (f" (full: {res['grpo']['sync_bytes'] / 2**20:.1f} MiB)"
            if res.get("grpo", {}).get("sync_bytes") else ""))])
    rows += part_rows(res, "parity", "parity vs transformers", lambda par: [(
        f"parity vs transformers, {par['batch']} x {par['seq']}, max |dlogits|",
        f"fp32 {par['fp32_max_abs']:.2e}; bf16 {par['bf16_max_abs']:.2e} (ours vs HF fp32 "
        f"{par['bf16_vs_hf_fp32_max_abs']:.2e}, HF bf16 vs HF fp32 {par['hf_bf16_vs_hf_fp32_max_abs']:.2e}; "
        f"logits up to {par['logits_scale']:.2f})")])
    rows += part_rows(res, "train", "trainer step (FSDP2, bf16)", lambda tr: [(
        "trainer step (FSDP2, bf16)", f"{tr['batch']} x {tr['seq']} tokens, {tr['step_s']:.3f} s, "
        f"{tr['tokens_per_s']:.0f} tok/s, {tr['achieved_tflops']:.1f} TFLOP/s, MFU {fmt(tr['mfu'], '.1%')}")])
    rows += part_rows(res, "logprob_memory", "logprob peak memory", lambda m: [
        (f"logprob peak, T={m['seq']} no grad", f"{fmt(m['no_grad_peak_mb'], '.0f')} MB (full fp32 logits: "
         f"{m['full_fp32_logits_mb']:.0f} MB)"),
        (f"logprob peak, T={m['seq']} fwd+bwd", f"{fmt(m['fwd_bwd_peak_mb'], '.0f')} MB")])
    rows += part_rows(res, "generate", "torch generator", lambda g: [(
        "torch generator", f"{g['prompts']} x {g['n']} x {g['new_tokens']} tokens: {g['tokens_per_s']:.0f} tok/s")])
    rows += part_rows(res, "update", "update levers", lambda u: [
        (f"update, {k}", v["error"] if "error" in v else
         f"{v['update_s']:.3f} s ({v['tflops']:.0f} TFLOP/s, MFU "
         f"{fmt(res['peak'] and v['tflops'] * 1e12 / res['peak'], '.1%')}), "
         f"first {v['first_update_s']:.1f} s, peak {fmt(v['peak_mem_gb'], '.1f')} GB, |dlogp| vs the first "
         f"{v['logp_abs_diff_vs_first']:.1e}") for k, v in u.items() if isinstance(v, dict) and k != "config"])
    rows.append(("total time", f"{res['total_s']:.0f} s"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:{w}s} | {v} |" for k, v in rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU: checks the script, not the speed")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    p.add_argument("--profile", action="store_true", help="grpo_rank: torch.profiler's top operators of one update")
    p.add_argument("--compile", action="store_true", help="grpo_rank: with dist.compile (torch.compile per block)")
    p.add_argument("--rank-steps", type=int, default=GRPO_RANK["steps"], help="grpo_rank's steps")
    p.add_argument("--parts", nargs="+", choices=PARTS,
                   help="which parts to run (default: all but grpo_lora; --cpu-smoke: all)")
    p.add_argument("--variants", nargs="+", default=UPDATE_VARIANTS,
                   help="update: <eager|compiled|nocudnn>_<micro-batch>[_fresh] (fresh: a new batch every update)")
    p.add_argument("--repeats", type=int, default=0, help="update: timed updates per variant (0: the default)")
    a = p.parse_args()
    smoke = a.cpu_smoke
    a.parts = a.parts or (PARTS if smoke else DEFAULT_PARTS)
    if not smoke and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device (use --cpu-smoke to check the script on CPU)")
    cfg = ModelConfig(**(TOY if smoke else QWEN25_15B))
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    out = None if smoke else a.out
    t_all = time.perf_counter()
    res = {"device": name, "peak": peak, "machine": machine.info(), "torch": torch.__version__,
           "model": "toy" if smoke else "Qwen2.5-1.5B-shaped (random)"}
    workdir = tempfile.TemporaryDirectory()  # the 0.5B checkpoint (2 GB in fp32) and the GRPO run's outputs
    shape = GRPO_SMOKE if smoke else QWEN25_05B
    if MISSING:
        res["grpo"] = res["parity"] = {"error": f"not installed: {' '.join(MISSING)}"}
        print(f"grpo, parity: SKIPPED, not installed: {' '.join(MISSING)} (pip install {' '.join(MISSING)})")
    else:
        import data
        ckpt = data.make_tiny_checkpoint(Path(workdir.name) / "ckpt", seed=0, **shape) \
            if {"grpo", "parity", "grpo_lora"} & set(a.parts) or smoke else None
        run = dict(GRPO, steps=4, prompts=4, samples=2, max_tokens=8, micro_batch=8) if smoke else GRPO
        if "grpo" in a.parts:
            run_part(res, "grpo", lambda: bench_grpo(ckpt, shape, run, device, workdir.name, peak), out)
        free_gpu(device)
        if "grpo_lora" in a.parts:
            lora_run = dict(run, steps=3, beta=GRPO_LORA["beta"]) if smoke else GRPO_LORA
            run_part(res, "grpo_lora", lambda: bench_grpo(
                ckpt, shape, lora_run, device, workdir.name, peak, "grpo_lora", extra=LORA), out)
            free_gpu(device)
        if "parity" in a.parts:
            run_part(res, "parity", lambda: bench_parity(ckpt, shape["vocab_size"], device,
                                                         *((2, 16) if smoke else (4, 512))), out)
        if "grpo_rank" in a.parts:
            free_gpu(device)
            rank_shape = shape if smoke else QWEN25_15B_CKPT
            rank_ckpt = ckpt if smoke else data.make_tiny_checkpoint(Path(workdir.name) / "ckpt15", seed=0,
                                                                     **rank_shape)
            rank_run = dict(run, beta=GRPO_RANK["beta"]) if smoke else dict(GRPO_RANK, steps=a.rank_steps)
            run_part(res, "grpo_rank", lambda: bench_grpo(rank_ckpt, rank_shape, rank_run, device, workdir.name,
                                                          peak, "grpo_rank", a.profile, a.compile), out)

    roles = dist.get_roles(0)  # train_grpo.main has left its world: a new one for the probes below
    if smoke:
        roles.device = torch.device("cpu")
    dist.init_distributed(roles, 600)
    mesh = dist.trainer_mesh(roles, 1, 1)
    free_gpu(device)
    if "generate" in a.parts:
        run_part(res, "generate", lambda: bench_generate(cfg, device, *((4, 2, 16, 8) if smoke else
                                                                        (64, 8, 128, 256))), out)
    if "logprob_memory" in a.parts:
        run_part(res, "logprob_memory", lambda: bench_logprob_memory(cfg, device, 64 if smoke else 4096), out)

    def train():
        tr = bench_train(cfg, device, *((2, 32, 2) if smoke else (8, 2048, 5)), mesh)
        return dict(tr, peak_flops=peak, mfu=tr["achieved_tflops"] * 1e12 / peak if peak else None)
    if "train" in a.parts:
        run_part(res, "train", train, out)
    if "update" in a.parts:
        upd = dict(UPDATE, prompts=2, samples=4, prompt_tokens=6, max_tokens=16, repeats=a.repeats or 2) if smoke \
            else dict(UPDATE, repeats=a.repeats or UPDATE["repeats"])
        # the smoke skips compiling (~90 s on a cold cache): dist.compile itself is tested in tests/test_dist.py
        variants = ("eager_16", "nocudnn_16_fresh") if smoke and a.variants == UPDATE_VARIANTS else a.variants
        run_part(res, "update", lambda: bench_update(cfg, device, mesh, upd, variants), out)
    res["total_s"] = time.perf_counter() - t_all
    if device.type == "cuda":
        res["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    if out:
        Path(out).write_text(json.dumps(res, indent=2) + "\n")
    workdir.cleanup()
    print("\n" + table(res))
    dist.shutdown()
    if any("error" in v or any(isinstance(u, dict) and "error" in u for u in v.values())
           for v in res.values() if isinstance(v, dict)):
        sys.exit("bench/gpu.py: a part failed (its error is in the table above and in the JSON)")


if __name__ == "__main__":
    main()
