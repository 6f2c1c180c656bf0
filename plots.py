"""PNG plots of a run's metrics.jsonl: the curves you look at first when a run misbehaves.

One figure, one panel per question: is reward rising, is held-out accuracy following, is the
response length stable, are KL and entropy sane, is the policy loss finite, and where does a
step's time go. Missing metrics are skipped, so SFT and GRPO runs share this file.
"""
import json
from pathlib import Path

PANELS = [
    ("reward / accuracy", ["rollout/reward_mean", "rollout/accuracy", "eval/pass@1"]),
    ("response length", ["rollout/response_len"]),
    ("KL / entropy", ["loss/kl", "loss/entropy", "mismatch/kl"]),
    ("loss", ["loss/total", "loss/pg", "sft/loss", "sft/eval_loss"]),
    ("grad norm / lr", ["train/grad_norm"]),
]
TIME_KEYS = ["perf/gen_s", "perf/reward_s", "perf/ref_s", "perf/old_s", "perf/train_s", "perf/sync_s"]


def plot_run(jsonl, out_dir, name="curves.png"):
    import matplotlib
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if pts:
                ax.plot(*zip(*pts), label=k, marker="o" if k.startswith("eval/") else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    ax = axes.flat[-1]  # step-time breakdown, stacked
    timed = [r for r in rows if "perf/step_s" in r]
    if timed:
        steps, bottom = [r["step"] for r in timed], [0.0] * len(timed)
        for k in TIME_KEYS:
            vals = [r.get(k, 0.0) for r in timed]
            ax.bar(steps, vals, bottom=bottom, label=k.split("/")[1], width=1.0)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.plot(steps, [r["perf/step_s"] for r in timed], color="k", label="step", linewidth=1)
        ax.legend(fontsize=7)
    ax.set_title("step time breakdown (s)")
    fig.tight_layout()
    fig.savefig(Path(out_dir) / name, dpi=80)
    plt.close(fig)
