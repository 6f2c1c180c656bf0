"""The multi-turn demo: GRPO teaches SmolLM2-135M-Instruct to use a calculator, next to single-turn GRPO from the
same checkpoint for the same time.

    make demo-tools                 (= python scripts/demo_tools.py after the install step; not in CI)
    python scripts/demo_tools.py --seed=1 --multi.train.steps=20

Two phases, each the real trainer in its own process, on the synthetic 2-digit word problems ("Leo has 98 pens. He
finds 69 more. How many pens now?"), held-out greedy accuracy on 200 problems (rollout.evaluate: multi-turn
episodes for the first, single replies for the second):
1. multi-turn: `train_grpo.py configs/smollm2_tools.py`, the calculator env (envs.py) with one worked episode in
   the opening conversation; evals every 5 steps.
2. single-turn: `train_grpo.py configs/smollm2_cpu.py` on the same task with the same batch, temperature, learning
   rate and generator, stopped once its training loop has used the time phase 1's did (the sum of perf/step_s,
   evals included); its last eval inside that budget is the comparison.
Both use vLLM in the trainer's process (eval is 200 multi-turn episodes: the torch generator re-prefills every turn).

Outputs, under <out>/demo_tools/: summary.json (both curves against loop seconds, the gains), demo_tools.png, and the
runs in multi/ and single/. Overrides: `--multi.<section>.<field>=v` and `--single.<section>.<field>=v`.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from demo import read_metrics, run_phase  # noqa: E402  (scripts/demo.py: a trainer in a subprocess, teed to a log)

SHARED = ["--rollout.backend=vllm", "--rollout.kv_cache_mb=1024", "--eval.every=5", "--eval.num_problems=200"]
SINGLE = ["--data.min_digits=2", "--data.max_digits=2", "--rollout.temperature=0.7", "--train.steps=1000",
          "--model.dtype=float32"]  # smollm2_cpu.py's "auto" could pick bf16: the same dtype as smollm2_tools.py
MIN_GAIN = 0.15  # the bar for the multi-turn run; it must also end above the single-turn run


def curve(rows):
    """[(loop seconds, held-out accuracy)]: the step-0 eval at 0 s, then each eval at the sum of step times so far."""
    out, t = [], 0.0
    for r in rows:
        t += r.get("perf/step_s", 0.0)
        if "eval/pass@1" in r:
            out.append((round(t, 1), r["eval/pass@1"]))
    return out


def run_for(cmd, run_dir, log_path, budget_s, poll_s=5.0):
    """Run a trainer until its loop has spent budget_s (read from its metrics), then stop it."""
    print(f"\n=== single-turn, for {budget_s:.0f} s of training loop: {' '.join(cmd)}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            time.sleep(poll_s)
            f = Path(run_dir, "metrics.jsonl")
            if f.exists() and sum(r.get("perf/step_s", 0.0) for r in read_metrics(run_dir)) >= budget_s:
                proc.terminate()
                proc.wait(timeout=60)
    if proc.returncode not in (0, -15):
        sys.exit(f"demo_tools: the single-turn run failed with exit code {proc.returncode} (log: {log_path})")


def plot(s, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("multi", "single"):
        t, acc = zip(*s[name]["curve"])
        ax.plot([x / 60 for x in t], acc, marker="o", label=f"{name}-turn")
    ax.set(title="SmolLM2-135M, 2-digit word problems: held-out greedy accuracy", xlabel="training loop minutes",
           ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(out, "demo_tools.png"), dpi=80)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out", help="outputs go to <out_dir>/demo_tools/")
    ap.add_argument("--seed", type=int, default=0)
    args, extra = ap.parse_known_args(argv)
    bad = [a for a in extra if not (a.startswith(("--multi.", "--single.")) and "=" in a)]
    if bad:
        sys.exit(f"demo_tools: unknown argument {bad[0]!r} (expected --multi.<section>.<field>=v or --single....)")
    own = {k: ["--" + a.split(".", 1)[1] for a in extra if a.startswith(f"--{k}.")] for k in ("multi", "single")}
    out = Path(args.out_dir, "demo_tools")
    out.mkdir(parents=True, exist_ok=True)
    common = [f"--log.out_dir={args.out_dir}", f"--train.seed={args.seed}", *SHARED]
    run_phase("multi-turn", [sys.executable, "train_grpo.py", "configs/smollm2_tools.py", *common,
                             "--log.run=demo_tools/multi", *own["multi"]], out / "multi.log")
    multi = curve(read_metrics(out / "multi"))
    run_for([sys.executable, "train_grpo.py", "configs/smollm2_cpu.py", *common, *SINGLE,
             "--log.run=demo_tools/single", *own["single"]], out / "single", out / "single.log", multi[-1][0])
    single = [(t, a) for t, a in curve(read_metrics(out / "single")) if t <= multi[-1][0]]
    s = {name: {"curve": c, "start": c[0][1], "end": c[-1][1], "gain": c[-1][1] - c[0][1]}
         for name, c in (("multi", multi), ("single", single))}
    n = json.loads((out / "multi" / "config.json").read_text())["eval"]["num_problems"]
    s.update(seed=args.seed, loop_seconds=multi[-1][0], num_eval_problems=n,
             met=s["multi"]["gain"] >= MIN_GAIN and s["multi"]["end"] > s["single"]["end"])
    Path(out, "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    plot(s, out)
    print(f"\nheld-out greedy accuracy, {n} problems, {s['loop_seconds']:.0f} s of training loop each (seed {args.seed}):")
    for name in ("multi", "single"):
        print(f"  {name}-turn: {s[name]['start']:.3f} -> {s[name]['end']:.3f} ({s[name]['gain']:+.3f})")
    print(f"bar (multi-turn gain >= +{MIN_GAIN}, and above single-turn): {'met' if s['met'] else 'NOT met'}")
    print(f"figures: {out}/summary.json   plot: {out}/demo_tools.png")
    return s


if __name__ == "__main__":
    main()
