"""Every loss in losses.py on one task, each at its own learning rate, over seeds, on-policy and one step stale.

    make compare                                   (= python scripts/compare.py: the default grid, <= 60 min)
    python scripts/compare.py --quick              (every loss x 3 lrs, on-policy, 1 seed: <= 10 min)
    python scripts/compare.py --losses=grpo,sapo_tau5 --lrs=1e-4 --seeds=0,1,2 --staleness=1
    python scripts/compare.py --grpo.rollout.prompts_per_step=16    (an override applied to every cell)

A comparison at one learning rate measures the learning rate, not the loss (docs/losses.md, its last
section: at 3e-4 with stale batches four of eight losses collapsed). So a cell is (loss, lr,
staleness, seed) and the grid is every loss x LRS x STALENESS x SEEDS. Each cell is `python
train_grpo.py configs/tiny.py` with that loss's KNOBS, `--optim.lr`, `--rollout.max_staleness` and
`--train.seed`, run in this process (one process, the torch generator colocated: the fastest layout
on 2 cores, and no start-up per cell), one cell at a time. Staleness 1 here is the pipeline's data
without its overlap: the batch a step trains on was sampled by the weights one step older, and the
generator's logprobs are old_logp, so r = pi / pi_old != 1 and each loss's clip or importance weight
acts. On-policy with one update per batch r == 1, and the losses differ only in aggregation and
normalisation. No KL term anywhere (beta = 0).

Held fixed: the start checkpoint (the demo's SFT export out/demo/sft/hf, made first if missing: held-out 0.386
at seed 0), rollouts (32 prompts x 8 samples, temperature 1, 40 tokens), AdamW (0.9, 0.99), clip 1.0, one
update per batch, greedy eval on 500 held-out problems at steps 0, 10, 20, 22. The seed changes the prompts,
the sampling and the held-out set (so the start accuracy differs a little between seeds). The lr is constant
from the first step (FIXED), as the grid measured it, not configs/tiny.py's warm-up and decay: 22 steps would be
mostly warm-up. `--grpo.optim.warmup_steps=20 --grpo.optim.schedule=cosine --grpo.rollout.overlong_cache=16`
runs cells with the demo's schedule instead (docs/losses.md: the 50-step runs on both numeric paths).

Why 22 steps and these lrs: 144 cells must fit 60 minutes on 2 cores, 25 s a cell. Measured in a first grid
at 26 steps: a step costs 0.8-1.0 s (generation 0.31 s, update 0.44 s, more when the box is busy), an eval
0.6 s, a cell's start ~1.6 s, and DAPO's refill rounds add ~30% to its cells: 26 steps averaged 28.5 s a cell,
68 minutes for the grid. Probes before the grid (GRPO, seed 0, on-policy): lr 1e-4 gave 0.386 -> 0.46 at
step 20 and 0.53 at 40; 3e-4 fell to 0.20-0.29 by step 20-50 before recovering (the demo's dip); 1e-3
collapsed to 0. LRS spans 3e-5..3e-4 (10x) around that. 22 steps separate a loss that learns from one that
collapses; they are short of what a +0.10 gain needs, so `--name=long --steps=100` reruns each loss's best
cell longer (README "Loss comparison").

A cell is `diverged` if it aborted (non-finite steps) or its final accuracy is below half its start.
Resumable: results.json is rewritten after every cell and a rerun skips every cell already in it (same
loss, lr, staleness, seed, steps and overrides); an interrupted cell starts over.

Outputs, under <out_dir>/compare/: results.json (every cell: start/final/last-3 accuracy, reward curve,
eval curve, wall time, diverged), table.md (each loss at its best on-policy lr, mean +- std over seeds, both
staleness settings; then every cell group), gain_vs_lr.png, best_curves.png, runs/<cell>/ (metrics, log).
"""
import argparse
import contextlib
import json
import math
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo  # noqa: E402  (scripts/demo.py: run_phase, split_overrides, read_metrics, ROOT)

sys.path.insert(0, str(demo.ROOT))
import losses  # noqa: E402

LRS, STALENESS, SEEDS, STEPS, EVAL_EVERY = (3e-5, 1e-4, 3e-4), (0, 1), (0, 1, 2), 22, 10
QUICK = dict(lrs=LRS, staleness=(0,), seeds=(0,), steps=20)
# name -> (losses.LOSSES key, its own settings). configs/tiny.py's loss.kwargs are GRPO's, so each row sets its own.
KNOBS = {
    "grpo": ("grpo", ['--loss.kwargs={"beta": 0.0, "agg": "token_mean"}']),  # the demo's calibrated setting
    "dr_grpo": ("dr_grpo", ["--loss.kwargs={}", "--loss.adv=dr_grpo"]),        # no std division;
                                                                               # C = max_tokens
    "dapo": ("dapo", ["--loss.kwargs={}", "--rollout.filter_zero_std=true"]),  # clip 0.2/0.28, dynamic sampling
    "cispo": ("cispo", ["--loss.kwargs={}"]),                                 # clipped IS weight (cap 5) on lp
    "gspo": ("gspo", ["--loss.kwargs={}"]),                                   # sequence ratio, clip 3e-4 / 4e-4
    "sapo": ("sapo", ['--loss.kwargs={"tau_pos": 1.0, "tau_neg": 1.05}']),    # soft gate at the paper's tau
    "simple_grpo": ("simple_grpo", ['--loss.kwargs={"beta": 0.0}']),          # torchforge's, without its KL
    "reinforce": ("reinforce", ["--loss.kwargs={}"]),                         # token-mean, IS weight in [0.1, 10]
    # not in the default grid: SAPO with a gate that closes (tau ~ 1 barely gates: docs/losses.md)
    "sapo_tau5": ("sapo", ['--loss.kwargs={"tau_pos": 5.0, "tau_neg": 5.0}']),
}
# the built-ins; --losses=my_loss runs a fork's too
DEFAULT = [name for name in KNOBS if name != "sapo_tau5"]

# the grid's optimizer, whatever configs/tiny.py's recipe says (docstring); --grpo.* overrides come after these
FIXED = ["--optim.warmup_steps=0", "--optim.schedule=constant", "--rollout.overlong_cache=0"]


def start_checkpoint(out_dir):
    """The demo's SFT export if present; else the demo's SFT phase, run into <out_dir>/demo/sft."""
    hf = Path(out_dir, "demo", "sft", "hf")
    if not (hf / "config.json").exists():
        hf.parent.parent.mkdir(parents=True, exist_ok=True)
        demo.run_phase("SFT (the start checkpoint)", [sys.executable, "train_sft.py", "configs/sft_tiny.py",
                       f"--log.out_dir={out_dir}", "--log.run=demo/sft", f"--model.path=tiny:{out_dir}/tiny/init"],
                       hf.parent.parent / "sft.log")
    return hf


def cell_args(cell, start, runs_dir, eval_every, shared):
    """The train_grpo command line of one cell (the same line a configs/tiny_<loss>.py recipe reproduces)."""
    # a fork's loss: its defaults
    loss, knobs = KNOBS.get(cell["loss"], (cell["loss"], ["--loss.kwargs={}"]))
    return ["configs/tiny.py", f"--model.path={start}", f"--log.out_dir={runs_dir}", f"--log.run={cell['id']}",
            f"--train.seed={cell['seed']}", f"--train.steps={cell['steps']}", f"--optim.lr={cell['lr']}",
            f"--rollout.max_staleness={cell['staleness']}", f"--eval.every={eval_every}", "--log.plot_every_s=-1",
            f"--loss.name={loss}", *knobs, *FIXED, *shared]


def run_cell(argv, log_path):
    """train_grpo.main(argv) in this process, its output into log_path; returns (seconds, error or None)."""
    import torch.distributed as tdist
    import train_grpo
    t0, error = time.perf_counter(), None
    with open(log_path, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            train_grpo.main(argv)
        except Exception as e:  # recorded in the cell (a non-finite abort is a divergence, not a crash of the grid)
            error = f"{type(e).__name__}: {e}"
            print(error)
        finally:
            if tdist.is_initialized():  # an aborted run leaves its group behind; the next cell makes its own
                tdist.destroy_process_group()
    return time.perf_counter() - t0, error


def summarize(cell, rows, seconds, error):
    train = [r for r in rows if "perf/step_s" in r]
    evals = [[r["step"], r["eval/pass@1"]] for r in rows if "eval/pass@1" in r]
    start, final = evals[0][1], evals[-1][1]
    last3 = [a for _, a in evals[1:]][-3:] or [start]
    return {**cell, "start_accuracy": start, "final_accuracy": final, "last3_accuracy": sum(last3) / len(last3),
            "gain": final - start, "evals": evals, "reward_curve": [r["rollout/reward_mean"] for r in train],
            "steps_done": train[-1]["step"] if train else 0, "seconds": round(seconds, 1), "error": error,
            "diverged": bool(error and "non-finite" in error) or final < start / 2}


def mean_std(xs):
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (math.nan, math.nan)


def group(cells):
    """{(loss, lr, staleness): [cells over seeds]}"""
    out = {}
    for c in cells:
        out.setdefault((c["loss"], c["lr"], c["staleness"]), []).append(c)
    return out


def best_lrs(cells):
    """{(loss, staleness): lr with the highest mean gain over seeds}"""
    best = {}
    for (loss, lr, st), cs in group(cells).items():
        g = mean_std([c["gain"] for c in cs])[0]
        if (loss, st) not in best or g > best[loss, st][1]:
            best[loss, st] = (lr, g)
    return {k: v[0] for k, v in best.items()}


def fmt(cs, key="gain"):
    m, s = mean_std([c[key] for c in cs])
    return f"{m:+.3f} ± {s:.3f}" if key == "gain" else f"{m:.3f} ± {s:.3f}"


def table(cells):
    """Markdown: each loss at its best on-policy lr (both staleness settings), then every (loss, lr, staleness)."""
    groups, best = group(cells), best_lrs(cells)
    names = list(dict.fromkeys(c["loss"] for c in cells))
    lines = ["| loss | best lr (on-policy) | gain, on-policy | final acc. | gain, stale 1 at that lr | "
             "best lr, stale 1 | gain, stale 1 at its best | diverged |", "|" + " --- |" * 8]
    for name in names:
        lr0, lr1 = best.get((name, 0)), best.get((name, 1))
        on, st, st_best = groups.get((name, lr0, 0), []), groups.get((name, lr0, 1), []), groups.get((name, lr1, 1), [])
        div = sum(c["diverged"] for c in on + st)
        lines.append(f"| {name} | {lr0 if lr0 is not None else '-'} | {fmt(on) if on else '-'} | "
                     f"{fmt(on, 'final_accuracy') if on else '-'} | {fmt(st) if st else '-'} | "
                     f"{lr1 if lr1 is not None else '-'} | {fmt(st_best) if st_best else '-'} | "
                     f"{div}/{len(on + st)} |")
    lines += ["", "Every cell group (mean ± std over seeds; gain = final − start held-out accuracy):", "",
              "| loss | lr | staleness | seeds | start | gain | last-3 acc. | diverged | s/cell |",
              "|" + " --- |" * 9]
    for (name, lr, st), cs in sorted(groups.items(), key=lambda kv: (names.index(kv[0][0]), kv[0][2], kv[0][1])):
        lines.append(f"| {name} | {lr:g} | {st} | {len(cs)} | {fmt(cs, 'start_accuracy')} | {fmt(cs)} | "
                     f"{fmt(cs, 'last3_accuracy')} | {sum(c['diverged'] for c in cs)} | "
                     f"{statistics.mean(c['seconds'] for c in cs):.0f} |")
    return "\n".join(lines) + "\n"


def plot(cells, out):
    import matplotlib
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    groups, best = group(cells), best_lrs(cells)
    names = list(dict.fromkeys(c["loss"] for c in cells))
    stal = sorted({c["staleness"] for c in cells})
    fig, axes = plt.subplots(1, len(stal), figsize=(6.5 * len(stal), 4.5), squeeze=False)
    for ax, st in zip(axes[0], stal):
        for name in names:
            pts = sorted((lr, *mean_std([c["gain"] for c in cs])) for (n, lr, s), cs in groups.items()
                         if n == name and s == st)
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                            capsize=3, label=name)
        ax.axhline(0, color="gray", lw=0.8)
        ax.axhline(0.10, color="gray", lw=0.8, ls="--")
        ax.set(xscale="log", title=f"held-out accuracy gain vs lr, staleness {st}", xlabel="learning rate",
               ylabel="final - start (mean ± std over seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out, "gain_vs_lr.png"), dpi=80)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name in names:
        cs = groups.get((name, best.get((name, 0)), 0), [])
        if cs:
            steps = [s for s, _ in cs[0]["evals"]]
            acc = [statistics.mean(c["evals"][i][1] for c in cs if len(c["evals"]) > i) for i in range(len(steps))]
            axes[0].plot(steps, acc, marker="o", markersize=3, label=f"{name} (lr {cs[0]['lr']:g})")
            n = min(len(c["reward_curve"]) for c in cs)
            axes[1].plot(range(1, n + 1), demo.moving_average(
                [statistics.mean(c["reward_curve"][i] for c in cs) for i in range(n)], 5), label=name)
    axes[0].set(title="held-out greedy accuracy at each loss's best lr (on-policy, mean over seeds)", xlabel="step")
    axes[1].set(title="training reward (moving average, 5 steps)", xlabel="step")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out, "best_curves.png"), dpi=80)
    plt.close(fig)


def write_outputs(results, out, plots=True):
    tmp = Path(out, "results.json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(Path(out, "results.json"))  # atomic: an interrupted grid never leaves half a file
    Path(out, "table.md").write_text(table(results["cells"]))
    if plots:
        plot(results["cells"], out)


def floats(text):
    return tuple(float(x) for x in text.split(","))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out", help="outputs go to <out_dir>/<name>/")
    ap.add_argument("--name", default="compare", help="a grid of its own: <out_dir>/<name>/ (e.g. longer runs)")
    ap.add_argument("--quick", action="store_true", help=f"the <= 10 minute grid: {QUICK}")
    ap.add_argument("--losses", default=",".join(DEFAULT),
                    help=f"comma-separated: {list(KNOBS)}, another "
                    "losses.LOSSES key or 'file.py:Class' (run with its defaults)")
    ap.add_argument("--lrs", help=f"comma-separated (default {LRS}), or 'best': each loss's best on-policy lr in "
                    "<out_dir>/compare/results.json")
    ap.add_argument("--staleness", type=lambda t: tuple(int(x) for x in t.split(",")), help=f"default {STALENESS}")
    ap.add_argument("--seeds", type=lambda t: tuple(int(x) for x in t.split(",")), help=f"default {SEEDS}")
    ap.add_argument("--steps", type=int, help=f"GRPO steps per cell (default {STEPS})")
    ap.add_argument("--eval_every", type=int, default=EVAL_EVERY)
    args, extra = ap.parse_known_args(argv)
    _, shared = demo.split_overrides(extra)  # --grpo.<section>.<field>=v, applied to every cell
    base = QUICK if args.quick else dict(lrs=LRS, staleness=STALENESS, seeds=SEEDS, steps=STEPS)
    grid = {k: getattr(args, k) or v for k, v in base.items()}
    names = args.losses.split(",")
    if grid["lrs"] == "best":  # e.g. longer runs of each loss's best cell: --name=long --lrs=best --steps=60
        best = best_lrs(json.loads(Path(args.out_dir, "compare", "results.json").read_text())["cells"])
        lrs = {name: (best[name, 0],) for name in names}
    else:
        lrs = {name: floats(grid["lrs"]) if isinstance(grid["lrs"], str) else grid["lrs"] for name in names}
    unknown = [n for n in names if n not in KNOBS and n not in losses.LOSSES and ":" not in n]
    if unknown:
        sys.exit(f"compare: unknown loss {unknown} (KNOBS has {list(KNOBS)}; "
                 f"losses.LOSSES {list(losses.LOSSES)})")
    out = Path(args.out_dir, args.name)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    start = start_checkpoint(args.out_dir)
    results = {"cells": []}
    if (out / "results.json").exists():
        results = json.loads((out / "results.json").read_text())
    done = {c["key"] for c in results["cells"]}
    todo = []
    for name in names:
        safe = re.sub(r"\W", "_", name)  # a user's "file.py:Class" as a directory name
        for st in grid["staleness"]:
            for lr in lrs[name]:
                for seed in grid["seeds"]:
                    cell = dict(loss=name, lr=lr, staleness=st, seed=seed, steps=grid["steps"])
                    cell["id"] = f"{safe}_lr{lr:g}_st{st}_s{seed}_n{grid['steps']}"
                    cell["key"] = " ".join([cell["id"], f"eval{args.eval_every}", *shared])
                    if cell["key"] not in done:
                        todo.append(cell)
    print(f"compare: {len(todo)} cells to run, {len(done)} already in {out}/results.json; start {start}", flush=True)
    t_grid = time.perf_counter()
    for i, cell in enumerate(todo):
        run_dir = out / "runs" / cell["id"]
        shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted cell starts over
        run_dir.mkdir(parents=True)
        seconds, error = run_cell(cell_args(cell, start, out / "runs", args.eval_every, shared), run_dir / "train.log")
        shutil.rmtree(run_dir / "hf", ignore_errors=True)  # 144 exports would be ~0.5 GB; the recipe remakes one
        results["cells"].append(summarize(cell, demo.read_metrics(run_dir), seconds, error))
        results["wall_s"] = results.get("wall_s", 0.0) + seconds
        write_outputs(results, out, plots=i == len(todo) - 1 or i % 24 == 23)  # plots cost ~2 s: now and then
        c = results["cells"][-1]
        print(f"[{i + 1}/{len(todo)}] {cell['id']}: {c['start_accuracy']:.3f} -> {c['final_accuracy']:.3f} "
              f"({seconds:.0f} s){' DIVERGED' if c['diverged'] else ''}{' ' + error if error else ''}", flush=True)
    if not todo:
        write_outputs(results, out)
    print(f"\n{table(results['cells'])}\ngrid: {time.perf_counter() - t_grid:.0f} s this run, "
          f"{results.get('wall_s', 0):.0f} s of cells in all; {out}/table.md, gain_vs_lr.png, best_curves.png")
    return results


if __name__ == "__main__":
    main()
