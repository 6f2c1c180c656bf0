"""The demo over seeds and numeric paths: does its learning hold on any machine and any seed?

    python scripts/demo_seeds.py                                  (5 seeds x both paths, ~1.5 h on 2 cores)
    python scripts/demo_seeds.py --seeds=0,1 --paths=avx2 --jobs=1 --grpo.optim.lr=1e-4

A learning claim from one run on one machine is an anecdote: on an AVX2-only box the demo that gained +0.25 on an
AVX-512 box lost 0.29 (docs/machines.md#learning-on-box-b). Floating-point results differ between
CPU kernel paths in the last bits, and over a thousand SFT steps and a few hundred sampled GRPO
steps those bits grow into a different start checkpoint and different samples, exactly as a
different seed does. So every cell here is a whole `scripts/demo.py` run (SFT from scratch, then
GRPO) for one (path, seed):

- path "native": whatever this CPU gives (AVX-512 where it exists);
- path "avx2": the kernels an AVX2-only machine runs, forced on any x86 box by ATEN_CPU_CAPABILITY=avx2 (PyTorch's
  own kernels), MKL_CBWR=AVX2 (MKL's) and ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's). Each trainer prints the capability it
  ran with (`machine:` line), and the table records it.

`--jobs=2` runs two cells side by side with one thread each, 1.26x the throughput on 2 cores;
wall times are then not the demo's. One thread is not bit-identical to two in GRPO any more (it
was when measured over 150 steps): on 2026-12-06 native seed 0 had the same SFT phase and the same
evals to step 100, then ended 0.734 against 0.736 (docs/demo.md#two-numeric-paths-on-one-machine):
as close as two runs of one seed get, not the same bits.

The verdict per cell is the issue's bar for a demo with margin (held-out greedy accuracy, 500 problems, GRPO's step-0
eval of the SFT export against its later evals): final gain >= +0.10, and no eval more than 0.05 below the start;
over the cells, mean gain >= +0.15. Also reported per cell: SFT's stop step and dev accuracy, the GRPO start's token
entropy, zero-signal share and reward, and the eval curve.

Outputs, under <out_dir>/<name>/: results.json (every cell), table.md, and each cell's whole demo in
<path>_s<seed>/demo/. Resumable: a cell with a summary.json is not rerun (same overrides), an unfinished one starts over.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo  # noqa: E402  (scripts/demo.py: ROOT, read_metrics, split_overrides)

PATHS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
MIN_MEAN_GAIN = demo.MIN_MEAN_GAIN  # the bar (docstring; a cell holds by demo.holds)


def reuse_sft(src_cell, cell_dir):
    """Copy a finished cell's SFT phase (SFT is deterministic for a (path, seed): the same bits again)."""
    src = src_cell / "demo"
    if not (src / "sft" / "hf" / "config.json").exists():
        sys.exit(f"demo_seeds: --sft_from: {src}/sft has no finished SFT export")
    shutil.copytree(src / "sft", cell_dir / "demo" / "sft")
    phase = cell_dir / "demo" / "sft" / "phase.json"
    if not phase.exists():  # a cell from before demo.py wrote phase.json: its wall time is in its summary
        phase.write_text(json.dumps({"seconds": json.loads((src / "summary.json").read_text())["sft_seconds"]}))


def run_cell(path, seed, cell_dir, extra, threads, sft_from=None):
    """One whole demo for (path, seed), its output in cell_dir/demo.log; returns (seconds, return code)."""
    env = {**os.environ, **PATHS[path]}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    shutil.rmtree(cell_dir, ignore_errors=True)  # an unfinished cell starts over
    cell_dir.mkdir(parents=True)
    if sft_from:
        reuse_sft(sft_from / cell_dir.name, cell_dir)
    t0 = time.perf_counter()
    with open(cell_dir / "demo.log", "w") as log:
        rc = subprocess.run([sys.executable, "scripts/demo.py", f"--out_dir={cell_dir}", f"--seed={seed}", *extra,
                             *(["--skip_sft"] if sft_from else [])],
                            cwd=demo.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return time.perf_counter() - t0, rc


def kind(problem):
    """A problem's type from its worked solution: "+" or "-", and whether a column carries (a sum
    whose units add to 10 or more) or borrows (a difference whose units digit is the smaller)."""
    a, op, b = problem["solution"].split("=")[0].split()
    a, b = int(a), int(b)
    carry = a % 10 + b % 10 >= 10 if op == "+" else a % 10 < b % 10
    return f"{op} carry" if carry else f"{op} no carry"


def calibration(hf_dir, seed, n=8, bins=10):
    """The SFT export as GRPO meets it, on GRPO's own 500 held-out problems: greedy accuracy,
    overall and per problem type (kind); how well its confidence in its greedy answer (the
    completion's probability) predicts being right (ECE over `bins` equal-width bins, and mean
    confidence against accuracy); and at temperature 1 with n samples (a GRPO group), the mean
    reward and the share of problems whose n samples all agree (no GRPO signal), split into all
    right and all wrong."""
    import torch
    sys.path.insert(0, str(demo.ROOT))
    import data
    import generator
    import rewards
    import train_grpo
    tok = data.Tokenizer(hf_dir)
    cfg = train_grpo.parse_config([str(demo.ROOT / "configs" / "tiny.py"), f"--train.seed={seed}"])
    # train_grpo's held-out set (rollout.load_tasks)
    problems = data.problems(cfg.data, "test", seed, 500)
    prompts = [data.prompt_ids(tok, p["question"]) for p in problems]
    gen = generator.TorchGenerator(str(hf_dir), max_model_len=96)
    reward = rewards.MathReward(symbolic=False)
    right = lambda c, p: reward(p["question"], c.text, str(p["target"])) >= 1  # noqa: E731
    greedy = [g[0] for g in gen.generate(prompts, n=1, temperature=0.0, max_tokens=40, seed=0)]
    ok = torch.tensor([float(right(c, p)) for c, p in zip(greedy, problems)])
    conf = torch.tensor([math.exp(sum(c.logprobs)) for c in greedy])
    which = (conf * bins).long().clamp(max=bins - 1)
    ece = sum(float((which == b).sum() * (conf[which == b].mean() - ok[which == b].mean()).abs())
              for b in range(bins) if (which == b).any()) / len(ok)
    sampled = gen.generate(prompts, n=n, temperature=1.0, max_tokens=40, seed=1)
    r = torch.tensor([[float(right(c, p)) for c in cs] for cs, p in zip(sampled, problems)])
    kinds = [kind(p) for p in problems]
    by_kind = {k: {"share": round(kinds.count(k) / len(kinds), 3),
                   "greedy": round(float(ok[[i for i, x in enumerate(kinds) if x == k]].mean()), 3),
                   "sampled": round(float(r[[i for i, x in enumerate(kinds) if x == k]].mean()), 3)}
               for k in sorted(set(kinds))}
    return {"greedy_accuracy": float(ok.mean()), "confidence_mean": float(conf.mean()), "ece": ece,
            "sampled_reward": float(r.mean()),
            "all_same_frac": float(((r.sum(1) == 0) | (r.sum(1) == n)).float().mean()),
            "all_right_frac": float((r.sum(1) == n).float().mean()),
            "all_wrong_frac": float((r.sum(1) == 0).float().mean()), "by_kind": by_kind}


def probe(path, cell_dir, steps):
    """The cell's first `steps` GRPO steps again with log.drift on: the same trajectory (drift adds no-grad forwards
    and a frozen start copy, nothing the update sees), now with each update's size. Needs the schedule's first
    `steps` lrs not to depend on train.steps (constant, or inside the warm-up)."""
    cfg = json.loads((cell_dir / "demo" / "grpo" / "config.json").read_text())
    if cfg["optim"]["schedule"] != "constant" and cfg["optim"]["warmup_steps"] < steps:
        sys.exit(f"demo_seeds: --analyze: {cell_dir}'s lr schedule depends on train.steps after its warm-up; "
                 "rerun it with --grpo.log.drift=true instead")
    cfg["train"]["steps"], cfg["eval"]["every"], cfg["eval"]["num_problems"] = steps, 0, 1  # its evals: not looked at
    cfg["log"].update(run="probe", out_dir=str(cell_dir.resolve()), drift=True, plot_every_s=-1)
    cfg["model"]["path"] = str((cell_dir / "demo" / "sft" / "hf").resolve())  # the demo ran from its own cwd
    args = [f"--{sec}.{k}={v if isinstance(v, str) else repr(v)}"
            for sec, fields in cfg.items() for k, v in fields.items()]
    subprocess.run([sys.executable, "train_grpo.py", *args], cwd=demo.ROOT, env={**os.environ, **PATHS[path]},
                   check=True, capture_output=True)
    rows = [r for r in demo.read_metrics(cell_dir / "probe") if "perf/step_s" in r]
    keys = ("drift/kl_step", "drift/moved_frac", "drift/kl_start", "train/grad_norm", "rollout/reward_mean",
            "rollout/zero_std_frac", "loss/entropy")
    return {k.split("/")[1]: [round(r[k], 5) for r in rows] for k in keys}


def summarize(path, seed, cell_dir, seconds, rc):
    """The cell's figures from its demo's summary.json and both phases' metrics."""
    cell = {"path": path, "seed": seed, "seconds": round(seconds, 1), "rc": rc}
    out = cell_dir / "demo"
    if rc or not (out / "summary.json").exists():
        return {**cell, "error": (cell_dir / "demo.log").read_text()[-2000:]}
    s = json.loads((out / "summary.json").read_text())
    grpo = [r for r in demo.read_metrics(out / "grpo") if "perf/step_s" in r]
    machine = json.loads((out / "grpo" / "machine.json").read_text())
    evals = s["grpo_evals"]
    start = evals[0][1]
    cell.update(capability=machine["cpu_capability"], sft_steps=s["sft_steps"], sft_dev_accuracy=s["sft_dev_accuracy"],
                start_accuracy=start, final_accuracy=evals[-1][1], gain=evals[-1][1] - start,
                worst_dip=min(a for _, a in evals) - start, evals=evals,
                start_entropy=grpo[0]["loss/entropy"], start_reward=grpo[0]["rollout/reward_mean"],
                start_zero_std_frac=grpo[0]["rollout/zero_std_frac"],
                reward_first10=statistics.mean(r["rollout/reward_mean"] for r in grpo[:10]),
                reward_last10=statistics.mean(r["rollout/reward_mean"] for r in grpo[-10:]),
                sft_seconds=s["sft_seconds"], grpo_seconds=s["grpo_seconds"])
    # the groups without signal over the whole GRPO phase, by side (logged since the seed change)
    for k in ("zero_std_frac", "all_right_frac", "all_wrong_frac"):
        if f"rollout/{k}" in grpo[0]:
            cell[f"{k}_mean"] = statistics.mean(r[f"rollout/{k}"] for r in grpo)
    cell["holds"] = demo.holds(cell["gain"], cell["worst_dip"])
    return cell


def table(cells):
    """Markdown: one row per cell, then per path the mean gain and how many cells hold."""
    lines = ["| path | seed | SFT stop step | SFT dev acc. | start acc. | start entropy | start zero-std | "
             "evals (GRPO steps 0, every, ..., end) | gain | worst dip | holds |", "|" + " --- |" * 11]
    for c in cells:
        if "error" in c:
            lines.append(f"| {c['path']} | {c['seed']} | failed (rc {c['rc']}) |" + " |" * 8)
            continue
        curve = " ".join(f"{a:.3f}" for _, a in c["evals"])
        lines.append(f"| {c['path']} ({c['capability']}) | {c['seed']} | {c['sft_steps']} | {c['sft_dev_accuracy']:.3f} | "
                     f"{c['start_accuracy']:.3f} | {c['start_entropy']:.3f} | {c['start_zero_std_frac']:.2f} | {curve} | "
                     f"{c['gain']:+.3f} | {c['worst_dip']:+.3f} | {'yes' if c['holds'] else 'NO'} |")
    lines += ["", "| path | cells | gain, mean ± std | min gain | worst dip | cells that hold | mean gain >= +0.15 |",
              "|" + " --- |" * 7]
    for path in dict.fromkeys(c["path"] for c in cells):
        cs = [c for c in cells if c["path"] == path and "error" not in c]
        if not cs:
            continue
        gains = [c["gain"] for c in cs]
        m, sd = statistics.mean(gains), statistics.stdev(gains) if len(gains) > 1 else 0.0
        lines.append(f"| {path} | {len(cs)} | {m:+.3f} ± {sd:.3f} | {min(gains):+.3f} | "
                     f"{min(c['worst_dip'] for c in cs):+.3f} | {sum(c['holds'] for c in cs)}/{len(cs)} | "
                     f"{'yes' if m >= MIN_MEAN_GAIN else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out")
    ap.add_argument("--name", default="demo_seeds", help="outputs go to <out_dir>/<name>/")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--paths", default="native,avx2", help=f"comma-separated, of {list(PATHS)}")
    ap.add_argument("--jobs", type=int, default=2, help="cells at once; >1 gives each one thread")
    ap.add_argument("--sft_from", help="another run's name under <out_dir>: reuse its cells' SFT phases (same --sft.* "
                    "overrides), so a GRPO recipe is measured from the same starts in half the time")
    ap.add_argument("--analyze", type=int, default=0, metavar="N", help="for every finished cell: its SFT export's "
                    "calibration, and the first N GRPO steps again with log.drift (how big each update was)")
    ap.add_argument("--calibrate", action="store_true",
                    help="for every finished cell: its SFT export's calibration only (accuracy per "
                    "problem type, groups of 8 all right or all wrong; no GRPO rerun)")
    args, extra = ap.parse_known_args(argv)
    sft_extra, _ = demo.split_overrides(extra)  # --sft.* / --grpo.* only; fails on anything else
    sft_from = Path(args.out_dir, args.sft_from) if args.sft_from else None
    if sft_from:
        theirs = {tuple(demo.split_overrides(c["overrides"])[0])
                  for c in json.loads((sft_from / "results.json").read_text())["cells"]}
        if theirs != {tuple(sft_extra)}:
            sys.exit(f"demo_seeds: --sft_from={args.sft_from} ran SFT with {sorted(theirs)}, not {sft_extra}")
    paths = args.paths.split(",")
    if unknown := [p for p in paths if p not in PATHS]:
        sys.exit(f"demo_seeds: unknown path {unknown} (of {list(PATHS)})")
    out = Path(args.out_dir, args.name)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    results = json.loads(res_path.read_text()) if res_path.exists() else {"cells": []}
    key = lambda c: (c["path"], c["seed"], tuple(c["overrides"]))  # noqa: E731
    done = {key(c) for c in results["cells"] if "error" not in c}
    todo = [(p, int(s)) for s in args.seeds.split(",") for p in paths if (p, int(s), tuple(extra)) not in done]
    print(f"demo_seeds: {len(todo)} cells to run, {len(done)} done in {res_path}", flush=True)

    def one(job):
        p, s = job
        cell_dir = out / f"{p}_s{s}"
        seconds, rc = run_cell(p, s, cell_dir, extra, 1 if args.jobs > 1 else 0, sft_from)
        return {**summarize(p, s, cell_dir, seconds, rc), "overrides": extra,
                **({"sft_from": args.sft_from} if sft_from else {})}

    with ThreadPoolExecutor(args.jobs) as pool:
        for cell in pool.map(one, todo):
            results["cells"] = [c for c in results["cells"] if key(c) != key(cell)] + [cell]
            results["cells"].sort(key=lambda c: (paths.index(c["path"]) if c["path"] in paths else 9, c["seed"]))
            res_path.with_suffix(".tmp").write_text(json.dumps(results, indent=1) + "\n")
            res_path.with_suffix(".tmp").replace(res_path)
            (out / "table.md").write_text(table(results["cells"]))
            print(f"{cell['path']} seed {cell['seed']}: " + (f"failed rc {cell['rc']}" if "error" in cell else
                  f"{cell['start_accuracy']:.3f} -> {cell['final_accuracy']:.3f} ({cell['gain']:+.3f}, "
                  f"dip {cell['worst_dip']:+.3f}) in {cell['seconds']:.0f} s"), flush=True)
    cells = [c for c in results["cells"] if tuple(c["overrides"]) == tuple(extra)]
    for c in cells if args.analyze or args.calibrate else ():
        cell_dir = out / f"{c['path']}_s{c['seed']}"
        # today's figures
        c.update(summarize(c["path"], c["seed"], cell_dir, c["seconds"], c["rc"]))
        c["sft_calibration"] = calibration(cell_dir / "demo" / "sft" / "hf", c["seed"])
        print(c["path"], c["seed"], c["sft_calibration"], flush=True)
        if args.analyze:
            c["probe"] = probe(c["path"], cell_dir, args.analyze)
            print(c["path"], c["seed"], {k: v[:4] for k, v in c["probe"].items()}, flush=True)
        res_path.write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + table(cells))
    return cells


if __name__ == "__main__":
    main()
