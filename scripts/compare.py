"""Every loss in losses.py, one command: the same GRPO run on the tiny task, same seed, same budget.

    make compare                                  (= python scripts/compare.py)
    python scripts/compare.py --losses=grpo,cispo --steps=60
    python scripts/compare.py --grpo.optim.lr=1e-4   (an override applied to every run)

How a researcher judges a new loss in minutes: add the class to losses.LOSSES, give it a row in KNOBS below
if it needs non-default settings, run this, look at out/compare/compare.png and the table.

What is held fixed: the start checkpoint (the demo's SFT export out/demo/sft/hf when it exists, else a fresh
SFT run into out/compare/sft, stopped at the same ~0.4 accuracy), the seed (same prompts every step, same
sampling seeds, same 500 held-out problems), rollouts (32 prompts x 8 samples, temperature 1, 40 tokens),
the optimizer (configs/tiny.py: AdamW, lr 3e-4, (0.9, 0.99), clip 1.0, one step per batch) and the
pipeline, which differs from the demo in one flag: one-batch-ahead generation (rollout.max_staleness=1).
That matters for a fair comparison: the batch a step trains on was sampled by the weights one step older, and the generator's
logprobs are the losses' old_logprobs, so the ratio r = pi / pi_old is not 1 and each loss's clipping or
importance weighting really acts (fully on-policy with one step per batch, r is exactly 1 and GRPO, DAPO,
CISPO, ... reduce to nearly the same gradient). No KL term anywhere (beta = 0).

What each loss keeps of its own (KNOBS): Dr.GRPO its unnormalised advantages and constant normaliser
(C = rollout.max_tokens, set by the trainer); DAPO its clip-higher range and dynamic-sampling filter;
GSPO its tiny sequence-level clip range (3e-4 / 4e-4, by design: its ratio is a per-token geometric mean);
CISPO and REINFORCE their clipped importance weights. Everything else is the loss class's defaults. GSPO's
range is narrow next to one step of drift at this learning rate: read its loss/clip_frac in
out/compare/gspo/metrics.jsonl before judging it, and retry it alone with wider bounds, e.g.
--losses=gspo --grpo.loss.kwargs="{'clip_low': 3e-3, 'clip_high': 4e-3}".

Budget: each run is `--steps` GRPO steps (default 100) with an eval of 500 problems every 20 steps, under
torchrun with one trainer rank and one vLLM rank, exactly like the demo. On 2 idle CPU cores a run takes
about 2.5 minutes (~1.2 s/step measured with one-batch-ahead generation, plus ~30 s of start-up and
evals), so all eight take ~20 minutes (plus ~6 minutes of SFT when no demo checkpoint exists). These are
estimates from the demo's measured step times; the comparison has not yet been run end to end on 2 cores. 100 steps is enough to separate a loss that learns from one that
does not; differences of a few points between losses that all learn are within the eval noise (about
+-0.04 between evals at a plateau), so compare the smoothed column and rerun with another --seed before
believing them.

Outputs, under <out>/compare/: compare.png (reward moving average and held-out accuracy per loss),
summary.json (the table), and one run directory per loss (metrics.jsonl, curves.png, config.json, hf/).
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo  # noqa: E402  (scripts/demo.py: run_phase, read_metrics, moving_average, ROOT)

sys.path.insert(0, str(demo.ROOT))
import losses  # noqa: E402

# 1 trainer + 1 vLLM rank, stale by one batch (see the docstring: r != 1, so clipping acts)
SHARED = ["--dist.generator_ranks=1", "--rollout.backend=vllm", "--rollout.max_staleness=1", "--eval.every=20"]
# Per-loss settings on top of the shared ones; a new loss needs a row only if its defaults are not enough.
KNOBS = {
    "grpo": ['--loss.kwargs={"beta": 0.0, "agg": "token_mean"}'],        # the demo's calibrated setting
    "dr_grpo": ["--loss.kwargs={}", "--loss.adv=drgrpo"],                 # no std division; C = max_tokens
    "dapo": ["--loss.kwargs={}", "--rollout.filter_zero_std=true"],       # clip 0.2 / 0.28 + dynamic sampling
    "cispo": ["--loss.kwargs={}"],                                        # clipped IS weight (4.0) on lp
    "gspo": ["--loss.kwargs={}"],                                         # sequence ratio, clip 3e-4 / 4e-4
    "sapo": ["--loss.kwargs={}"],                                         # soft gate instead of a clip
    "simple_grpo": ['--loss.kwargs={"beta": 0.0}'],                       # torchforge's, without its KL
    "reinforce": ["--loss.kwargs={}"],                                    # token-mean REINFORCE, IS in [0.1, 10]
}


def start_checkpoint(out_dir, seed):
    """The demo's SFT export if present; else run the demo's SFT phase into <out>/compare/sft."""
    demo_hf = Path(out_dir, "demo", "sft", "hf")
    if (demo_hf / "config.json").exists():
        return demo_hf
    out = Path(out_dir, "compare")
    out.mkdir(parents=True, exist_ok=True)
    demo.run_phase("SFT (start checkpoint)", [sys.executable, "train_sft.py", "configs/sft_tiny.py",
                   f"--log.out_dir={out_dir}", "--log.run=compare/sft", f"--train.seed={seed}",
                   f"--model.path=tiny:{out_dir}/tiny/init"], out / "sft.log")
    return out / "sft" / "hf"


def summarize(name, rows, seconds):
    train = [r for r in rows if "perf/step_s" in r]
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    last3 = [a for _, a in evals[1:]][-3:]
    reward = [r["rollout/reward_mean"] for r in train]
    return {"loss": name, "start_accuracy": evals[0][1], "final_accuracy": evals[-1][1],
            "final_accuracy_smoothed": sum(last3) / len(last3),
            "reward_first10": sum(reward[:10]) / len(reward[:10]),
            "reward_last10": sum(reward[-10:]) / len(reward[-10:]),
            "entropy_last": train[-1].get("loss/entropy"), "step_s": sum(r["perf/step_s"] for r in train) / len(train),
            "seconds": round(seconds, 1), "steps": train[-1]["step"]}


def plot(runs, out):
    import matplotlib
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, rows in runs.items():
        train = [r for r in rows if "perf/step_s" in r]
        steps = [r["step"] for r in train]
        axes[0].plot(steps, demo.moving_average([r["rollout/reward_mean"] for r in train], 10), label=name)
        axes[1].plot(*zip(*[(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]), marker="o",
                     markersize=3, label=name)
        axes[2].plot(steps, demo.moving_average([r["loss/entropy"] for r in train], 10), label=name)
    axes[0].set(title="reward on training batches (moving average, 10 steps)", xlabel="step")
    axes[1].set(title="held-out greedy accuracy (500 problems)", xlabel="step")
    axes[2].set(title="policy entropy (moving average, 10 steps)", xlabel="step")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out, "compare.png"), dpi=80)
    plt.close(fig)


def print_table(results):
    print("\n" + "=" * 88)
    print(f"{'loss':<12} {'start acc':>9} {'final acc':>9} {'last 3 evals':>12} {'reward 1-10':>11} "
          f"{'reward last 10':>14} {'s/step':>7}")
    for r in results:
        print(f"{r['loss']:<12} {r['start_accuracy']:>9.3f} {r['final_accuracy']:>9.3f} "
              f"{r['final_accuracy_smoothed']:>12.3f} {r['reward_first10']:>11.3f} {r['reward_last10']:>14.3f} "
              f"{r['step_s']:>7.2f}")
    print("=" * 88)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out", help="outputs go to <out_dir>/compare/")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps per loss (the shared budget)")
    ap.add_argument("--losses", default=",".join(losses.LOSSES), help="comma-separated keys of losses.LOSSES")
    args, extra = ap.parse_known_args(argv)
    _, shared = demo.split_overrides(extra)  # --grpo.<section>.<field>=v, applied to every run
    names = args.losses.split(",")
    unknown = [n for n in names if n not in losses.LOSSES]
    if unknown:
        sys.exit(f"compare: unknown loss {unknown} (losses.LOSSES has {list(losses.LOSSES)})")
    out = Path(args.out_dir, "compare")
    out.mkdir(parents=True, exist_ok=True)
    start = start_checkpoint(args.out_dir, args.seed)
    runs, results = {}, []
    for name in names:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "train_grpo.py", "configs/tiny.py", f"--log.out_dir={args.out_dir}", f"--log.run=compare/{name}",
               f"--model.path={start}", f"--train.seed={args.seed}",
               f"--train.steps={args.steps}", *SHARED,
               f"--loss.name={name}", *KNOBS.get(name, []), *shared]
        t0 = time.perf_counter()
        seconds = demo.run_phase(f"GRPO with loss {name}", cmd, out / f"{name}.log")
        runs[name] = demo.read_metrics(out / name)
        results.append(summarize(name, runs[name], seconds))
        plot(runs, out)  # refreshed after every run, so a long comparison can be watched
        Path(out, "summary.json").write_text(json.dumps(results, indent=2) + "\n")
        print(f"{name}: {time.perf_counter() - t0:.0f} s")
    print_table(results)
    print(f"plot: {out}/compare.png   table: {out}/summary.json")
    return results


if __name__ == "__main__":
    main()
