"""nanoforge vs TRL's GRPOTrainer, side by side on the same checkpoint, prompts, reward and hyperparameters.

What is held equal (TRL defaults that differ are pinned, see trl_worker):
    checkpoint      a random Qwen2-shaped model from data.make_tiny_checkpoint: "tiny" (0.9M params, overhead-
                    dominated) and "50m" (48M params, compute-dominated), with the arithmetic tokenizer
    prompts         data.step_batch order for steps 0..N-1 (TRL: shuffle_dataset=False, so it walks the
                    same list in the same order), rendered by the checkpoint's chat template
    reward          rewards.MathReward (what train_grpo scores), group size G, B*G completions per step
    sampling        temperature 1, top_p 1, top_k off, max_tokens
    update          one AdamW step per generation batch (TRL: num_iterations=1, steps_per_generation=1, all
                    completions in one batch), lr constant, betas (0.9, 0.99), grad clip 1.0, beta (KL) 0
    loss            token-mean over the whole batch (TRL loss_type="dapo"; nanoforge grpo agg="token_mean"),
                    advantages (r - mean) / (std + 1e-4) per group (TRL scale_rewards="group"), entropy computed
                    on every training forward by both, no truncation masking
    precision       fp32 everywhere (TRL: bf16=False, gradient_checkpointing=False on CPU)

Generation: TRL runs its transformers-generate path (its vLLM colocate mode crashes on CPU at the first weight
sync). nanoforge runs its CPU default ("torch": configs/tiny.py, one process, the torch generator colocated), and
the distributed layout, one trainer rank + one generator rank under torchrun: vLLM with max_staleness 0 ("sync")
and 1 ("async"), and the torch generator with max_staleness 1 ("async_torch"). Runs are one after the other, never concurrent. Reported: median step time over steps 5..N (first
steps pay one-off warm-ups), its split into generation and the rest ("train": reward, logprobs, update, sync,
overhead), peak RSS, and the reward at the last step. step_time_ratio = nanoforge / TRL.

TRL lives in its own venv, bench/.venv-trl (created on first use: trl and accelerate pinned, everything else - CPU
torch, transformers 5.19, numpy 2.3.5 - reused from nanoforge's .venv through a .pth file and pinned as
constraints, so both sides run the same torch and transformers).

    .venv/bin/python bench/vs_trl.py          # writes bench/results/vs_trl.json
    .venv/bin/python bench/vs_trl.py --sizes tiny --steps 3 --measure-from 2 --prompts 4   # smoke run
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
SIZES = {  # data.make_tiny_checkpoint kwargs, and the per-step workload (B prompts x G samples)
    "tiny": dict(model=dict(), prompts=32, variants=["torch", "sync", "async", "async_torch"]),
    # 4 prompts x 8: every step costs ~10 s of compute on 2 cores already; the torch-vs-vLLM question is the tiny one
    "50m": dict(model=dict(hidden_size=512, num_hidden_layers=14, num_attention_heads=8, num_key_value_heads=8,
                           head_dim=64, intermediate_size=1536), prompts=4, variants=["torch", "sync", "async", "async_torch"]),
}
G, MAX_TOKENS, LR = 8, 40, 3e-4


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
    import train_grpo
    B = a.prompts
    cfg = train_grpo.parse_config(["configs/tiny.py", f"--model.path={a.ckpt}",
                                   f"--rollout.prompts_per_step={B}"])
    train, _, _ = train_grpo.load_tasks(cfg, data.Tokenizer(a.ckpt))
    problems = [p for s in range(a.steps) for p in data.step_batch(train, s, B, cfg.train.seed)]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p["question"]}], "target": str(p["target"])}
                            for p in problems])
    math_reward = rewards.MathReward()

    def reward(prompts, completions, target, **kw):
        return [float(math_reward("", c[0]["content"], t)) for c, t in zip(completions, target)]

    args = GRPOConfig(
        output_dir=a.tmp, max_steps=a.steps, seed=0, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False,
        per_device_train_batch_size=B * G, num_generations=G, steps_per_generation=1, gradient_accumulation_steps=1,
        num_iterations=1, max_completion_length=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, use_bias_correction_kl=False, loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False, bf16=False, fp16=False,
        gradient_checkpointing=False, use_vllm=False, log_completions=False)
    model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.ckpt)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)

    times = {"gen": [], "rollout": []}

    def timed(key, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            times[key].append(time.perf_counter() - t0)
            return out
        return wrapper
    trainer._generate = timed("gen", trainer._generate)  # HF generate of the whole batch (+ decode)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)

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
        step_s=StepTimer.steps, gen_s=times["gen"], rollout_s=times["rollout"],
        reward=[h["reward"] for h in logs], response_len=[h.get("completions/mean_length") for h in logs],
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, torch_threads=torch.get_num_threads())))


def summarize(step_s, gen_s, reward, rss_mb, lo, hi, wait_s=None):
    """Median over steps lo..hi (1-based, inclusive). train_s = the step's time outside generation: step - gen, or
    for nanoforge step - wait (the time the trainer did not spend waiting for completions; with max_staleness=1
    generation overlaps training, so gen + train > step there)."""
    sl = slice(lo - 1, hi)
    step, gen = statistics.median(step_s[sl]), statistics.median(gen_s[sl])
    busy = [s - w for s, w in zip(step_s, wait_s or gen_s)][sl]
    return dict(step_s=step, gen_s=gen, train_s=statistics.median(busy),
                reward_last=reward[hi - 1], reward_mean_last5=statistics.mean(reward[max(0, hi - 5):hi]),
                peak_rss_mb=rss_mb, steps_measured=f"{lo}..{hi}")


def run_trl(py, ckpt, size, a, tmp):
    out = Path(tmp) / f"trl_{size}.json"
    cmd = [str(py), __file__, "--trl-worker", "--ckpt", str(ckpt), "--steps", str(a.steps),
           "--prompts", str(SIZES[size]["prompts"] if a.prompts is None else a.prompts), "--out", str(out),
           "--tmp", str(Path(tmp) / "trl_out")]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    if res.returncode != 0:
        sys.exit(f"TRL run failed (rc={res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    r = json.loads(out.read_text())
    s = summarize(r["step_s"], r["gen_s"], r["reward"], r["peak_rss_mb"], a.measure_from, a.steps)
    return {**s, "wall_s": time.perf_counter() - t0, "torch_threads": r["torch_threads"], "per_step": r}


def run_nanoforge(ckpt, size, a, tmp, extra, nproc):
    step = _load_step()
    B = SIZES[size]["prompts"] if a.prompts is None else a.prompts
    overrides = [f"--rollout.prompts_per_step={B}", f"--rollout.group_size={G}", f"--rollout.max_tokens={MAX_TOKENS}",
                 f"--optim.lr={LR}", "--optim.betas=(0.9, 0.99)", "--optim.grad_clip=1.0", "--optim.schedule=constant",
                 "--loss.name=grpo", "--loss.kwargs={'beta': 0.0, 'agg': 'token_mean'}", "--loss.adv_eps=1e-4",
                 f"--train.micro_batch={B * G}", "--rollout.kv_cache_mb=64", *extra]
    # one step more than TRL: train_grpo's last step also runs the final eval, keep it out of the window
    rows, rss, wall = step.run_grpo(overrides, a.steps + 1,
                                    Path(tmp) / f"nf_{size}_{len(os.listdir(tmp))}", nproc=nproc,
                                    timeout=a.timeout, ckpt=ckpt)
    s = summarize([r["perf/step_s"] for r in rows], [r["perf/gen_s"] for r in rows],
                  [r["rollout/reward_mean"] for r in rows], max(rss.values()), a.measure_from, a.steps,
                  # colocated (nproc 1): generation runs inside the step before the wait, so it counts too
                  wait_s=[r["perf/wait_s"] + (r["perf/gen_s"] if nproc == 1 else 0.0) for r in rows])
    s["peak_rss_mb_per_rank"] = rss
    per_step = [{k: r[k] for k in r if k.startswith("perf/") or k == "rollout/reward_mean"} for r in rows]
    return {**s, "wall_s": wall, "overrides": extra, "per_step": per_step}


def _load_step():
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "50m"], choices=list(SIZES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--measure-from", type=int, default=5)
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: per size)")
    p.add_argument("--variants", nargs="+", default=None, choices=["sync", "async", "async_torch", "torch"],
                   help="nanoforge runs: torch (the CPU default: one process, colocated torch generator), sync "
                        "(vLLM rank), async (vLLM rank, staleness 1), async_torch (torch-generator rank, staleness 1)")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "vs_trl.json"))
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_worker:
        return trl_worker(a)

    sys.path.insert(0, str(ROOT))
    import data
    py = ensure_trl_venv()
    rank = ["--dist.generator_ranks=1"]  # 1 trainer rank + 1 generator rank under torchrun, one core each
    variants = {"sync": ([*rank, "--rollout.backend=vllm", "--rollout.max_staleness=0"], 2),
                "async": ([*rank, "--rollout.backend=vllm", "--rollout.max_staleness=1"], 2),
                "async_torch": ([*rank, "--rollout.backend=torch", "--rollout.max_staleness=1"], 2),
                "torch": (["--dist.generator_ranks=0", "--rollout.backend=torch"], 1)}  # the CPU default
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes:
            ckpt = data.make_tiny_checkpoint(Path(tmp) / f"ckpt_{size}", seed=0, **SIZES[size]["model"])
            from safetensors import safe_open
            with safe_open(ckpt / "model.safetensors", "pt") as f:  # tied lm_head is not stored: counted once
                num_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
            res = {"params": num_params, "prompts_per_step": SIZES[size]["prompts"] if a.prompts is None else a.prompts,
                   "group_size": G, "max_tokens": MAX_TOKENS}
            res["trl"] = run_trl(py, ckpt, size, a, tmp)
            print(f"[{size}] TRL: step {res['trl']['step_s']:.3f} s (gen {res['trl']['gen_s']:.3f})", flush=True)
            for v in a.variants or SIZES[size]["variants"]:
                extra, nproc = variants[v]
                res[f"nanoforge_{v}"] = run_nanoforge(ckpt, size, a, tmp, extra, nproc)
                n = res[f"nanoforge_{v}"]
                n["step_time_ratio"] = n["step_s"] / res["trl"]["step_s"]
                print(f"[{size}] nanoforge {v}: step {n['step_s']:.3f} s (gen {n['gen_s']:.3f}), "
                      f"ratio {n['step_time_ratio']:.2f}", flush=True)
            results[size] = res
    print(f"\n{'size':5s} {'run':16s} {'step s':>7s} {'gen s':>6s} {'train s':>7s} {'nf/TRL':>6s} {'RSS MB':>7s} "
          f"{'reward@N':>8s}")
    for size, res in results.items():
        for k in [k for k in res if k == "trl" or k.startswith("nanoforge_")]:
            r = res[k]
            print(f"{size:5s} {k:16s} {r['step_s']:7.3f} {r['gen_s']:6.3f} {r['train_s']:7.3f} "
                  f"{r.get('step_time_ratio', 1.0):6.2f} {r['peak_rss_mb']:7.0f} {r['reward_last']:8.3f}")
    out = dict(sizes=results, steps=a.steps, measure_from=a.measure_from, trl=TRL_PINS, cpu_count=os.cpu_count(),
               targets=dict(sync_ratio=0.8, async_ratio=0.5))
    if "tiny" in results and "nanoforge_torch" in results["tiny"]:  # headline: tiny, both sync, the CPU default
        out["step_time_ratio"] = results["tiny"]["nanoforge_torch"]["step_time_ratio"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
