"""PNG plots of a run's metrics.jsonl: the curves you look at first when a run misbehaves.

One figure, one panel per question: is reward rising and held-out accuracy following, what each
reward contributes, is the response length stable, is the KL to the reference sane, is the entropy
collapsing, do trainer and generator still agree on the sampled tokens' logprobs (mismatch), is the
loss finite, is the gradient norm steady, and where does a step's time go. Missing metrics are
skipped, so SFT and GRPO runs share this file.
"""
import json
from pathlib import Path

PANELS = [  # (title, keys); a key ending in "*" takes every metric with that prefix
    ("reward / accuracy", ["rollout/reward_mean", "rollout/accuracy", "eval/pass@1"]),
    ("rewards (each, unweighted mean)", ["rewards/*_mean"]),
    ("response length (tokens)", ["rollout/response_len"]),
    ("KL to the reference", ["loss/kl"]),
    ("entropy", ["loss/entropy"]),
    ("train / inference mismatch", ["mismatch/abs_diff", "mismatch/kl"]),
    ("loss", ["loss/total", "loss/pg", "sft/loss", "sft/eval_loss"]),
    ("grad norm", ["train/grad_norm"]),
]
TIME_KEYS = ["perf/gen_s", "perf/reward_s", "perf/ref_s", "perf/old_s", "perf/train_s",
             "perf/sync_s", "perf/eval_s"]


def plot_run(jsonl, out_dir, name="curves.png"):
    import matplotlib
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(3, 3, figsize=(15, 11))
    names = sorted({k for r in rows for k in r})
    for ax, (title, keys) in zip(axes.flat, PANELS):
        keys = [n for k in keys for n in ([k] if "*" not in k else
                                           [n for n in names if n.startswith(k.split("*")[0])
                                            and n.endswith(k.split("*")[1])])]
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if pts:
                ax.plot(*zip(*pts), label=k, marker="o" if k.startswith("eval/") else None,
                        markersize=3)
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
