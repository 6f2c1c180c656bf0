"""Where a GRPO step's time goes: the real trainer under torchrun, split into its phases.

Runs `train_grpo.py` (default: configs/tiny.py as 1 trainer + 1 vLLM generator rank; --nproc 1: one process) for warm-up + N measured steps
and reads the perf/* figures the trainer logs to metrics.jsonl. Each row is one step as the trainer rank sees it:

    step = generation + reward + reference + old-logprob + train + sync + other

    generation   perf/gen_s: the generator's own time inside generate() (dedicated rank) ...
    collect      perf/wait_s - perf/gen_s: ... plus moving the completions to the trainer (all_gather_object of
                 pickled Completions); counted as framework overhead, inside "other"
    other        everything the phases do not cover: collect, batching, metric all-reduce, logging

"other" is framework overhead, the figure to drive down (target <= 5% of the step). Medians over the measured
steps; the last step is run but dropped (it carries the final eval). Peak RSS is each rank's ru_maxrss (the
vLLM engine runs in-process on the generator rank, so its memory is included). The checkpoint is the random
tiny model (data.make_tiny_checkpoint): it answers nothing right, so responses run to max_tokens and rewards are 0;
that makes every step the same length, which is what a timing benchmark wants.

    .venv/bin/python bench/step.py                     # bench/results/step.json
    .venv/bin/python bench/step.py --profile           # + cProfile of the trainer
    .venv/bin/python bench/step.py --steps 2 --warmup 1 -- --rollout.prompts_per_step=4   # smoke run

Arguments after `--` go to train_grpo.py as overrides (e.g. `-- --rollout.backend=torch`).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = [("generation", "perf/gen_s"), ("reward", "perf/reward_s"), ("reference", "perf/ref_s"),
          ("old_logprob", "perf/old_s"), ("train", "perf/train_s"), ("sync", "perf/sync_s")]


def worker(argv):
    """One torchrun rank: train_grpo.main, then this rank's peak RSS (and optionally a profile) next to metrics."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    out = Path(os.environ["NF_BENCH_OUT"])
    rank = int(os.environ.get("RANK", 0))
    import train_grpo
    prof = None
    if os.environ.get("NF_BENCH_PROFILE") and rank == 0:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    try:
        train_grpo.main(argv)
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(out / "trainer.prof")
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        (out / f"rss_rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_rss_mb": rss_mb}))


def run_grpo(overrides, steps, out_dir, nproc=2, config="configs/tiny.py", timeout=900, profile=False, ckpt=None):
    """Launch the trainer once; returns (metric rows with perf/step_s, {rank: peak RSS MB}, wall seconds).
    ckpt None: the random tiny checkpoint, made in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = f"tiny:{out_dir / 'ckpt'}" if ckpt is None else ckpt
    # several ranks: the last one runs vLLM (configs/tiny.py's own default is one process, the torch generator)
    layout = ["--dist.generator_ranks=1", "--rollout.backend=vllm"] if nproc > 1 else []
    args = [config, f"--model.path={ckpt}", f"--train.steps={steps}",
            "--eval.every=0", "--eval.num_problems=8", "--log.run=run", f"--log.out_dir={out_dir}",
            "--log.plot_every_s=1e9", *layout, *overrides]
    env = {**os.environ, "NF_BENCH_OUT": str(out_dir), "TQDM_DISABLE": "1"}
    if profile:
        env["NF_BENCH_PROFILE"] = "1"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    t0 = time.perf_counter()
    res = subprocess.run([*launcher, __file__, "--worker", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"train_grpo failed (rc={res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    rows = [json.loads(line) for line in open(out_dir / "run" / "metrics.jsonl")]
    rows = [r for r in rows if "perf/step_s" in r]
    rss = {}
    for f in out_dir.glob("rss_rank*.json"):
        d = json.loads(f.read_text())
        rss[d["rank"]] = d["peak_rss_mb"]
    return rows, rss, wall


def breakdown(rows, num_seqs):
    """Median per phase over `rows` (seconds), "other" = step - phases, and throughput."""
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    step = med("perf/step_s")
    # per-step "other" first, then its median: the phases' medians need not add up to the step's median
    other = statistics.median(r["perf/step_s"] - sum(r[k] for _, k in PHASES) for r in rows)
    collect = statistics.median(max(r["perf/wait_s"] - r["perf/gen_s"], 0.0) for r in rows)
    parts = {name: med(k) for name, k in PHASES}
    parts["other"] = other
    gen_tokens = statistics.median(r["rollout/response_len"] for r in rows) * num_seqs
    return dict(step_s=step, parts_s=parts, parts_frac={k: v / step for k, v in parts.items()},
                collect_s=collect, wait_s=med("perf/wait_s"), num_steps=len(rows),
                gen_tokens_per_step=gen_tokens,
                gen_tokens_per_s=gen_tokens / parts["generation"],          # generator throughput while generating
                trained_tokens_per_s=gen_tokens / parts["train"],           # response tokens / train phase
                end_to_end_tokens_per_s=gen_tokens / step,
                sync_gbps=med("sync/gbps") if "sync/gbps" in rows[0] else None)


def print_table(title, b, rss):
    print(f"\n{title}: median step {b['step_s']:.3f} s over {b['num_steps']} steps")
    print(f"  {'phase':12s} {'seconds':>8s} {'share':>7s}")
    for k, v in b["parts_s"].items():
        print(f"  {k:12s} {v:8.3f} {b['parts_frac'][k]:7.1%}")
    print(f"  (collect = wait - gen, inside other: {b['collect_s']:.3f} s)")
    print(f"  generated {b['gen_tokens_per_step']:.0f} tok/step: {b['gen_tokens_per_s']:.0f} tok/s while generating, "
          f"{b['trained_tokens_per_s']:.0f} tok/s while training, {b['end_to_end_tokens_per_s']:.0f} tok/s end to end")
    print("  peak RSS: " + ", ".join(f"rank {r} {mb:.0f} MB" for r, mb in sorted(rss.items())))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps run first and not counted")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", default="configs/tiny.py")
    p.add_argument("--profile", action="store_true", help="cProfile the trainer rank; top entries into the json")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "step.json"))
    p.add_argument("overrides", nargs="*", help="train_grpo.py overrides, after --")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import machine
    roof = machine.roofline()  # first: the figures this run's speeds are read against

    with tempfile.TemporaryDirectory() as tmp:
        rows, rss, wall = run_grpo(args.overrides, args.warmup + args.steps + 1, tmp, args.nproc, args.config,
                                   profile=args.profile)
        cfg = json.loads((Path(tmp) / "run" / "config.json").read_text())
        num_seqs = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"]
        b = breakdown(rows[args.warmup:args.warmup + args.steps], num_seqs)
        top = None
        if args.profile:
            import pstats
            st = pstats.Stats(str(Path(tmp) / "trainer.prof"))
            top = sorted(((v[3], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in st.stats.items()), reverse=True)[:40]
            top = [dict(cum_s=round(c, 3), fn=f) for c, f in top]
    print_table(f"{args.config} {' '.join(args.overrides)}".strip(), b, rss)
    result = dict(config=args.config, overrides=args.overrides, warmup=args.warmup,
                  workload=dict(prompts_per_step=cfg["rollout"]["prompts_per_step"],
                                group_size=cfg["rollout"]["group_size"], max_tokens=cfg["rollout"]["max_tokens"],
                                backend=cfg["rollout"]["backend"], max_staleness=cfg["rollout"]["max_staleness"],
                                model="make_tiny_checkpoint (random)"),
                  **b, other_target_frac=0.05, other_ok=b["parts_frac"]["other"] <= 0.05,
                  peak_rss_mb={f"rank{r}": mb for r, mb in sorted(rss.items())}, wall_s=wall,
                  per_step=[{k: r[k] for k in r if k.startswith(("perf/", "sync/"))} for r in rows],
                  machine=roof)
    if top:
        result["profile_top_cumulative"] = top
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
