"""nanoforge vs TRL's GRPOTrainer, side by side on the same checkpoint, prompts, reward and hyperparameters.

Sizes and workloads (SIZES). The headline is "135m", SmolLM2-135M-Instruct with its real weights (fetch_model.py), on
three workloads: `short` (4 arithmetic prompts x 8 samples x 40 tokens, sampled, beta 0: nearly every row runs to
the limit), `short_kl` (the same with beta 0.04: a reference model on both sides) and `long` (2 GSM8K prompts x 8 x
128 tokens in the model's chat template with the \\boxed{} instruction: rows stop at different lengths). Kept
for reference: "tiny" (0.9M, overhead-dominated) and "50m" (48M, random, compute-dominated), `short` only.

What is held equal (TRL defaults that differ are pinned, see trl_worker; both read one parsed train_grpo config):
    prompts         data.step_batch order for steps 0..N-1 (TRL: shuffle_dataset=False, so it walks the
                    same list in the same order), question + instruction as one user turn of the chat template
    reward          rewards.MathReward (what train_grpo scores), group size G, B*G completions per step
    sampling        temperature 1, top_p 1, top_k off, max_tokens, stop at the checkpoint's eos
    update          one AdamW step per generation batch (TRL: num_iterations=1, steps_per_generation=1, all
                    completions in one batch), lr constant, betas (0.9, 0.99), grad clip 1.0, beta as the workload
    loss            token-mean over the whole batch (TRL loss_type="dapo"; nanoforge grpo agg="token_mean"),
                    advantages (r - mean) / (std + 1e-4) per group (TRL scale_rewards="group"), entropy computed
                    on every training forward by both, no truncation masking, k3 KL to the reference
    precision       fp32 everywhere (TRL: bf16=False, gradient_checkpointing=False on CPU); --bf16 also runs TRL
                    with bf16=True after it, beside nanoforge's "bf16" variant

Generation: TRL runs its transformers-generate path (its vLLM colocate mode crashes on CPU at the first weight
sync). nanoforge runs (VARIANTS) "torch" (one process, the torch generator colocated: "auto"'s pick on CPU),
"bf16" (the same computing in bf16 from fp32 master weights, model.dtype = "bfloat16":
not TRL's fp32, so reported beside the fp32 ratio, with its train/generator mismatch), "vllm" (one process, vLLM in
process), "vllm_bf16" (the same in bf16), "auto" (one process, nothing set: the generator, dtype and KV size "auto"
picks; "auto_fp32" the same in fp32), and the distributed layouts, 1 trainer rank + 1 generator rank under torchrun:
vLLM with max_staleness 0 ("sync") and 1 ("async"), the torch generator with max_staleness 1 ("async_torch"). Runs
are one after the other, never concurrent.

Reported per run: the median step over steps --measure-from..--steps (the first steps pay one-off warm-ups) and its
split, each part's median: generation / reference (the no-grad reference forward) / update (forward, backward,
AdamW) / sync (weights to the generator) / other (the step minus the rest: rewards, batching, logging); peak RSS;
step_time_ratio = nanoforge / TRL and rss_ratio. And a roofline, measured in the same run before each workload
(machine.roofline: CPU capability, cores, memory read GB/s, a 2048^3 matmul's GFLOP/s in fp32 and, where this CPU
has a bf16 path, bf16), the update's achieved GFLOP/s (perf/update_gflop / update seconds, FLOPs
counted by packing.forward_flops: 6 x block params x computed tokens + 6 x lm_head x response tokens + attention's
12 x layers x heads x head_dim per (query, key) pair SDPA computes) and its ratio to the fp32 matmul.

TRL lives in its own venv, bench/.venv-trl (created on first use: trl and accelerate pinned, everything else - CPU
torch, transformers 5.19, numpy 2.3.5 - reused from nanoforge's .venv through a .pth file and pinned as
constraints, so both sides run the same torch and transformers). --sides runs one side only and keeps the other's
last figures from the json (TRL's side of `135m` costs ~35 minutes and does not change when nanoforge does).

    .venv/bin/python bench/vs_trl.py                  # 135m, every workload, both sides: bench/results/vs_trl.json
    .venv/bin/python bench/vs_trl.py --sides nanoforge --workloads short --variants torch
    .venv/bin/python bench/vs_trl.py --sizes tiny --steps 3 --measure-from 2      # smoke run
"""
import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "bench" / ".venv-trl"
TRL_PINS = ["trl==1.16.0", "accelerate==1.15.0"]
SHARED_PINS = ["transformers==5.19.0", "numpy==2.3.5", "torch==2.13.0"]  # must match requirements-cpu.txt
GSM8K = ROOT / "data" / "gsm8k"
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
VARIANTS = ["torch", "torch_compiled", "bf16", "vllm", "vllm_bf16", "auto", "auto_fp32", "sync", "async", "async_torch"]
SIZES = {  # checkpoint (data.make_tiny_checkpoint kwargs, or "smollm2": the real one), base config, lr, workloads
    "tiny": dict(model=dict(), config="configs/tiny.py", lr=3e-4,
                 workloads={"short": dict(prompts=32, max_tokens=40)}, variants=["torch", "sync", "async", "async_torch"]),
    # 4 prompts x 8: every step costs ~10 s of compute on 2 cores already; the torch-vs-vLLM question is the tiny one
    "50m": dict(model=dict(hidden_size=512, num_hidden_layers=14, num_attention_heads=8, num_key_value_heads=8,
                           head_dim=64, intermediate_size=1536), config="configs/tiny.py", lr=3e-4,
                workloads={"short": dict(prompts=4, max_tokens=40)}, variants=["torch", "sync", "async", "async_torch"]),
    # the headline: real weights, the workloads users run on CPU; lr as a pretrained model wants (same both sides)
    "135m": dict(model="smollm2", config="configs/smollm2_cpu.py", lr=1e-5, workloads={
        "short": dict(prompts=4, max_tokens=40),                    # 1-digit arithmetic, sampled: rows run long
        "short_kl": dict(prompts=4, max_tokens=40, beta=0.04),      # the same with the reference model on both sides
        # GSM8K in the chat template (~110-token prompts), 128 tokens: rows stop at different lengths
        "long": dict(prompts=2, max_tokens=128, data=["--data.name=gsm8k", f"--data.source={GSM8K / 'train.jsonl'}",
                                                      f"--data.eval_source={GSM8K / 'test.jsonl'}",
                                                      f"--data.instruction={BOXED}"])},
                 variants=["torch", "vllm", "async"]),
}
G = 8


def train_overrides(size, wl, ckpt):
    """The train_grpo overrides that define a workload; TRL's settings are read back from the same parsed config."""
    w = SIZES[size]["workloads"][wl]
    return [f"--model.path={ckpt}", f"--rollout.prompts_per_step={w['prompts']}", f"--rollout.group_size={G}",
            f"--rollout.max_tokens={w['max_tokens']}", f"--optim.lr={SIZES[size]['lr']}", "--optim.betas=(0.9, 0.99)",
            "--optim.grad_clip=1.0", "--optim.schedule=constant", "--optim.warmup_steps=0", "--loss.name=grpo",
            f"--loss.kwargs={{'beta': {w.get('beta', 0.0)}, 'agg': 'token_mean'}}", "--loss.adv_eps=1e-4",
            f"--train.micro_batch={w['prompts'] * G}", *w.get("data", [])]


def ensure_trl_venv():
    py = VENV / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", "import trl, accelerate"], capture_output=True).returncode == 0
    if ok:
        return py
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    # reuse nanoforge's packages (CPU torch, transformers, datasets, ...) instead of downloading a second torch
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "nanoforge_main_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(SHARED_PINS) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", *TRL_PINS, "-c", f.name], check=True)
    return py


def trl_worker(a):
    """Runs inside bench/.venv-trl: TRL's GRPOTrainer for a.steps steps; per-step times and logs to a.out."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import data
    import rewards
    import rollout
    import train_grpo
    cfg = train_grpo.parse_config([SIZES[a.size]["config"], *train_overrides(a.size, a.workload, a.ckpt)])
    B, beta = cfg.rollout.prompts_per_step, cfg.loss.kwargs["beta"]
    train, _, _ = rollout.load_tasks(cfg, data.Tokenizer(a.ckpt))
    problems = [p for s in range(a.steps) for p in data.step_batch(train, s, B, cfg.train.seed)]
    # the same text data.prompt_ids renders: question + instruction as the one user turn
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p["question"] + cfg.data.instruction}],
                             "target": str(p["target"])} for p in problems])
    math_reward = rewards.MathReward()

    def reward(prompts, completions, target, **kw):
        return [float(math_reward("", c[0]["content"], t)) for c, t in zip(completions, target)]

    args = GRPOConfig(
        output_dir=a.tmp, max_steps=a.steps, seed=0, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False,
        per_device_train_batch_size=B * G, num_generations=G, steps_per_generation=1, gradient_accumulation_steps=1,
        num_iterations=1, max_completion_length=cfg.rollout.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=cfg.optim.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, beta=beta, use_bias_correction_kl=False, loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False, bf16=a.bf16, fp16=False,
        gradient_checkpointing=False, use_vllm=False, log_completions=False)
    model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.ckpt)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)

    times = {"gen": [], "rollout": [], "ref": []}

    def timed(fn, key=None):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            k = key or ("ref" if args[0] is trainer.ref_model else None)  # logprobs: only the reference's are timed
            if k:
                times[k].append(time.perf_counter() - t0)
            return out
        return wrapper
    trainer._generate = timed(trainer._generate, "gen")  # HF generate of the whole batch (+ decode)
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "rollout")
    trainer._get_per_token_logps_and_entropies = timed(trainer._get_per_token_logps_and_entropies)

    class StepTimer(TrainerCallback):
        steps = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(time.perf_counter() - self.t0)
    trainer.add_callback(StepTimer())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    Path(a.out).write_text(json.dumps(dict(
        step_s=StepTimer.steps, gen_s=times["gen"], rollout_s=times["rollout"], ref_s=times["ref"] or None,
        reward=[h["reward"] for h in logs], response_len=[h.get("completions/mean_length") for h in logs],
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, torch_threads=torch.get_num_threads())))


def split(rows, lo, hi):
    """Medians over steps lo..hi (1-based, inclusive) of the step and its parts: generation / reference / update /
    sync / other, "other" taken per step (step minus the parts) before its median. rows: dicts with step, gen, ref,
    update, sync and `busy` (the step's time not spent waiting for completions; = step - gen when colocated)."""
    sl = rows[lo - 1:hi]
    med = lambda k: statistics.median(r[k] for r in sl)  # noqa: E731
    parts = {k: med(k) for k in ("gen", "ref", "update", "sync")}
    parts["other"] = statistics.median(r["busy"] - r["ref"] - r["update"] - r["sync"] for r in sl)
    return dict(step_s=med("step"), parts_s=parts, steps_measured=f"{lo}..{hi}")


def run_trl(py, ckpt, size, wl, a, tmp, bf16):
    out = Path(tmp) / f"trl_{size}_{wl}.json"
    cmd = [str(py), __file__, "--trl-worker", "--ckpt", str(ckpt), "--steps", str(a.steps), "--size", size,
           "--workload", wl, "--out", str(out), "--tmp", str(Path(tmp) / "trl_out"), *(["--bf16"] if bf16 else [])]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    if res.returncode != 0:
        sys.exit(f"TRL run failed (rc={res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    r = json.loads(out.read_text())
    ref = r["ref_s"] or [0.0] * len(r["step_s"])
    # TRL's step = rollout (generate, reference logprobs, rewards, tokenising) + the update; no weight sync
    rows = [dict(step=s, gen=g, ref=f, update=s - ro, sync=0.0, busy=s - g)
            for s, g, ro, f in zip(r["step_s"], r["gen_s"], r["rollout_s"], ref)]
    return {**split(rows, a.measure_from, a.steps), "peak_rss_mb": r["peak_rss_mb"],
            "reward_mean": statistics.mean(r["reward"][a.measure_from - 1:a.steps]),
            "wall_s": time.perf_counter() - t0, "torch_threads": r["torch_threads"], "per_step": r}


def run_nanoforge(ckpt, size, wl, a, tmp, extra, nproc):
    step = _load_step()
    # one step more than TRL: train_grpo's last step also runs the final eval, keep it out of the window
    rows, rss, wall = step.run_grpo([*train_overrides(size, wl, ckpt), *extra], a.steps + 1,
                                    Path(tmp) / f"nf_{size}_{wl}_{len(os.listdir(tmp))}", nproc=nproc,
                                    timeout=a.timeout, config=SIZES[size]["config"], ckpt=ckpt)
    # colocated (nproc 1) generation runs inside the step; a generator rank's runs while the trainer waits or trains
    parts = [dict(step=r["perf/step_s"], gen=r["perf/gen_s"], ref=r["perf/ref_s"],
                  update=r["perf/train_s"] + r["perf/old_s"], sync=r["perf/sync_s"],
                  busy=r["perf/step_s"] - r["perf/wait_s"] - (r["perf/gen_s"] if nproc == 1 else 0.0)) for r in rows]
    s = split(parts, a.measure_from, a.steps)
    sl = rows[a.measure_from - 1:a.steps]
    gflop = statistics.median(r["perf/update_gflop"] for r in sl)
    s.update(peak_rss_mb=max(rss.values()), peak_rss_mb_per_rank=rss, wall_s=wall, overrides=extra,
             reward_mean=statistics.mean(r["rollout/reward_mean"] for r in sl),
             update_gflop=gflop, update_gflops=gflop / s["parts_s"]["update"],
             mismatch_abs_diff=statistics.median(r["mismatch/abs_diff"] for r in sl),
             per_step=[{k: r[k] for k in r if k.startswith(("perf/", "mismatch/")) or k == "rollout/reward_mean"}
                       for r in rows])
    if nproc > 1:  # the pipeline's bound: a step cannot beat the slower of its two overlapped halves
        s["step_over_max_gen_update"] = s["step_s"] / max(s["parts_s"]["gen"], s["parts_s"]["update"])
    return s


def _load_step():
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def checkpoint_for(size, tmp):
    """(path, parameter count) of a size's checkpoint: the real SmolLM2 from fetch_model, or a random one."""
    import data
    import fetch_model
    spec = SIZES[size]["model"]
    ckpt = fetch_model.fetch_smollm2() if spec == "smollm2" else data.make_tiny_checkpoint(
        Path(tmp) / f"ckpt_{size}", seed=0, **spec)
    from safetensors import safe_open
    with safe_open(Path(ckpt) / "model.safetensors", "pt") as f:  # a tied lm_head is not stored: counted once
        num_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    return ckpt, num_params


def print_table(results):
    """The json as the README's markdown table: one row per run, seconds and GB."""
    print("\n| workload | run | step | gen | ref | update | sync | other | nf / TRL | peak RSS | update GFLOP/s (/ fp32 mm) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, res in results.items():
        for k in [k for k in res if k.startswith(("trl", "nanoforge_")) and "parts_s" in res[k]]:
            r, p = res[k], res[k]["parts_s"]
            rate = f"{r['update_gflops']:.0f} ({r['update_over_fp32_matmul']:.2f})" if "update_over_fp32_matmul" in r \
                else ""
            rss = " + ".join(f"{mb / 1024:.1f}" for _, mb in sorted(r.get("peak_rss_mb_per_rank", {0: r["peak_rss_mb"]})
                                                                    .items()))
            print(f"| {key} | {k.removeprefix('nanoforge_')} | {r['step_s']:.2f} | {p['gen']:.2f} | {p['ref']:.2f} | "
                  f"{p['update']:.2f} | {p['sync']:.2f} | {p['other']:.2f} | {r.get('step_time_ratio', 1.0):.2f} | "
                  f"{rss} GB | {rate} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["135m"], choices=list(SIZES))
    p.add_argument("--workloads", nargs="+", default=None, help="default: every workload of each size")
    p.add_argument("--sides", nargs="+", default=["trl", "nanoforge"], choices=["trl", "nanoforge"],
                   help="run one side only; the other side's last figures are kept from --out (ratios recomputed)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--measure-from", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="nanoforge runs: torch (one process, colocated torch generator), bf16 (the "
                        "same with model.dtype=bfloat16: bf16 compute, fp32 master weights), vllm "
                        "(one process, vLLM in process), vllm_bf16, auto (nothing set: what 'auto' picks), auto_fp32, "
                        "torch_compiled (torch with dist.compile), sync (vLLM rank), async (vLLM rank, staleness 1), "
                        "async_torch (torch-generator rank, staleness 1); default: per size")
    p.add_argument("--timeout", type=int, default=2400)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "vs_trl.json"))
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--ckpt", "--tmp", "--size", "--workload"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--bf16", action="store_true", help="TRL with bf16=True (autocast over fp32 weights) too, after "
                                                          "fp32 TRL, kept as trl_bf16; nanoforge's bf16 is a variant")
    p.add_argument("--table", action="store_true", help="print --out as a markdown table and exit")
    a = p.parse_args()
    if a.trl_worker:
        return trl_worker(a)
    if a.table:
        return print_table(json.loads(Path(a.out).read_text())["runs"])

    sys.path.insert(0, str(ROOT))
    import machine
    py = ensure_trl_venv() if "trl" in a.sides else None
    rank = ["--dist.generator_ranks=1"]  # 1 trainer rank + 1 generator rank under torchrun, one core each
    fp32 = "--model.dtype=float32"  # like for like with TRL's fp32 (the configs' "auto" may pick bf16)
    variants = {"torch": (["--dist.generator_ranks=0", "--rollout.backend=torch", fp32], 1),
                # the same with each block torch.compile'd (dist.compile, opt-in): the update and logprob forwards
                "torch_compiled": (["--dist.generator_ranks=0", "--rollout.backend=torch", fp32, "--dist.compile=true"], 1),
                "bf16": (["--dist.generator_ranks=0", "--rollout.backend=torch", "--model.dtype=bfloat16"], 1),
                "vllm": (["--dist.generator_ranks=0", "--rollout.backend=vllm", "--rollout.kv_cache_mb=256", fp32], 1),
                "vllm_bf16": (["--dist.generator_ranks=0", "--rollout.backend=vllm", "--rollout.kv_cache_mb=256",
                               "--model.dtype=bfloat16"], 1),
                "auto": (["--dist.generator_ranks=0"], 1),  # what a user gets: backend, dtype and KV size "auto"
                "auto_fp32": (["--dist.generator_ranks=0", fp32], 1),  # the same in fp32, like for like with TRL
                "sync": ([*rank, "--rollout.backend=vllm", "--rollout.max_staleness=0", fp32], 2),
                "async": ([*rank, "--rollout.backend=vllm", "--rollout.max_staleness=1", fp32], 2),
                "async_torch": ([*rank, "--rollout.backend=torch", "--rollout.max_staleness=1", fp32], 2)}
    out_path = Path(a.out)
    saved = json.loads(out_path.read_text()) if out_path.exists() else {}
    results = saved.get("runs", {})
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes:
            ckpt, num_params = checkpoint_for(size, tmp)
            for wl in a.workloads or SIZES[size]["workloads"]:
                if wl not in SIZES[size]["workloads"]:
                    sys.exit(f"size {size} has no workload {wl!r}: choose from {list(SIZES[size]['workloads'])}")
                key, w = f"{size}/{wl}", SIZES[size]["workloads"][wl]
                res = results.setdefault(key, {})
                res.update(params=num_params, prompts_per_step=w["prompts"], group_size=G, max_tokens=w["max_tokens"],
                           beta=w.get("beta", 0.0), data="gsm8k" if w.get("data") else "arith", lr=SIZES[size]["lr"])
                # the roofline, measured beside the runs it judges
                roof = {**machine.roofline(), "date": time.strftime("%Y-%m-%d %H:%M")}
                trl_runs = ([False, True] if a.bf16 else [False]) if "trl" in a.sides else []
                for bf16 in trl_runs:
                    side = "trl_bf16" if bf16 else "trl"  # the ratios stay against fp32 TRL
                    res[side] = {**run_trl(py, ckpt, size, wl, a, tmp, bf16), "roofline": roof}
                    print(f"[{key}] {side}: step {res[side]['step_s']:.2f} s", flush=True)
                if "nanoforge" in a.sides:
                    for v in a.variants or SIZES[size]["variants"]:
                        extra, nproc = variants[v]
                        res[f"nanoforge_{v}"] = {**run_nanoforge(ckpt, size, wl, a, tmp, extra, nproc), "roofline": roof}
                        print(f"[{key}] nanoforge {v}: step {res[f'nanoforge_{v}']['step_s']:.2f} s", flush=True)
                for k in [k for k in res if k.startswith("nanoforge_") and "trl" in res]:
                    n = res[k]
                    n["step_time_ratio"] = n["step_s"] / res["trl"]["step_s"]
                    n["rss_ratio"] = n["peak_rss_mb"] / res["trl"]["peak_rss_mb"]
                    if "trl_bf16" in res:  # like for like in precision: against TRL's own bf16
                        n["step_time_ratio_vs_trl_bf16"] = n["step_s"] / res["trl_bf16"]["step_s"]
                    if "update_gflops" in n:
                        n["update_over_fp32_matmul"] = n["update_gflops"] / n["roofline"]["fp32_gflops"]
                # written after every workload: an interrupted run keeps what it measured
                out = dict(runs=results, steps=a.steps, measure_from=a.measure_from, trl=TRL_PINS,
                           cpu_count=os.cpu_count(), targets=dict(step_time_ratio=0.4, rss_ratio=0.6,
                                                                  update_over_fp32_matmul=0.7,
                                                                  async_step_over_max_gen_update=1.10))
                out_path.parent.mkdir(parents=True, exist_ok=True)
                out_path.write_text(json.dumps(out, indent=2) + "\n")
    print_table(results)


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
