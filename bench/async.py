"""Does generating ahead hide generation behind training? The same run at max_staleness 0, 1, 2.

With `rollout.max_staleness = k` the generator rank produces batch s+k while the trainer updates
on batch s, so a step should cost max(generation, training) instead of their sum. This runs
bench/step.py's workload (the tiny config, 1 trainer + 1 vLLM rank, random checkpoint) once per k,
one run after the other, and reports the median step time against max(gen, train) of the same
run, and each side's idle share of the step:

    gen    perf/gen_s     the generator's time inside generate()
    train  perf/train_s   the policy update (forward + backward + optimizer) on the trainer
    ratio  step / max(gen, train); target <= 1.15 with staleness >= 1 (at 0: ~(gen + train) / max)
    idle   trainer: perf/wait_s (waiting for the batch) / step; generator: perf/gen_idle_s (at the
           batch collective and in the weight sync: waiting for the trainer, then the transfer
           and reload) / step

With a weight sync after every step the pipeline cannot run more than one batch ahead in steady
state: at k = 2 the generator still waits for each update before its next batch, so k > 1 buys
slack for uneven steps, not speed. In the stale runs the trainer's perf/sync_s includes waiting
for the generator to finish batch s+k (the broadcast starts when both sides arrive), so only the
step time and the two busy times are compared.

`--inflight=off,on` runs each k >= 1 twice, the second time with `rollout.inflight_updates`: the
sync lands at the generator's next token boundary instead of after its batch, so the trainer leaves
the broadcast as soon as its update is done, and the batch's later tokens come from the newer
weights (token staleness, the share of rows updated mid-sequence).

    .venv/bin/python bench/async.py                    # bench/results/async.json
    .venv/bin/python bench/async.py --staleness 0,1 --steps 2 --warmup 1 \
        -- --rollout.prompts_per_step=4                # smoke run
    .venv/bin/python bench/async.py --inflight=off,on --out=bench/results/async_inflight.json
"""
import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import machine  # noqa: E402
_spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "step.py")
step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "async.json"))
    p.add_argument("--staleness", default="0,1,2", help="rollout.max_staleness values, a,b,...")
    p.add_argument("--inflight", default="off", help="off, on or off,on: rollout.inflight_updates "
                   "(each k >= 1 once per value)")
    p.add_argument("overrides", nargs="*", help="train_grpo.py overrides, after --")
    args = p.parse_args()
    roof = machine.roofline()  # first: the figures this run's speeds are read against

    runs, ks = {}, [int(k) for k in args.staleness.split(",")]
    cells = [(k, on) for k in ks for on in args.inflight.split(",") if k or on == "off"]
    for k, on in cells:
        with tempfile.TemporaryDirectory() as tmp:
            rows, rss, wall = step.run_grpo([*args.overrides, f"--rollout.max_staleness={k}",
                                             f"--rollout.inflight_updates={on == 'on'}"],
                                            args.warmup + args.steps + 1, tmp)
        rows = rows[args.warmup:args.warmup + args.steps]
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        share = lambda key: statistics.median(r[key] / r["perf/step_s"] for r in rows)  # noqa
        s, g, t = med("perf/step_s"), med("perf/gen_s"), med("perf/train_s")
        busy = statistics.median(r["perf/step_s"] - r["perf/wait_s"] - r["perf/sync_s"]
                                 for r in rows)
        name = f"staleness{k}" + ("_inflight" if on == "on" else "")
        run = runs[name] = dict(
            step_s=s, gen_s=g, train_s=t, max_gen_train_s=max(g, t), sum_gen_train_s=g + t,
            ratio_step_over_max=s / max(g, t), wait_s=med("perf/wait_s"),
            sync_s=med("perf/sync_s"), trainer_busy_s=busy, staleness_mean=med("rollout/staleness"),
            trainer_idle_share=share("perf/wait_s"), generator_idle_share=share("perf/gen_idle_s"),
            token_staleness_mean=med("rollout/token_staleness") if k else 0.0,
            inflight_frac=med("rollout/inflight_frac") if k else 0.0,
            peak_rss_mb=rss, wall_s=wall,
            per_step=[{key: r[key] for key in r if key.startswith("perf/")} for r in rows])
        print(f"{name}: step {s:.3f} s, gen {g:.3f} s, train {t:.3f} s, "
              f"step / max(gen, train) = {s / max(g, t):.2f}, step / (gen + train) = "
              f"{s / (g + t):.2f}, idle: trainer {run['trainer_idle_share']:.0%}, generator "
              f"{run['generator_idle_share']:.0%}, token staleness "
              f"{run['token_staleness_mean']:.2f}, rows updated mid-sequence "
              f"{run['inflight_frac']:.0%}",
              flush=True)
    result = dict(workload="configs/tiny.py, random tiny checkpoint, 1 trainer + 1 vLLM rank",
                  overrides=args.overrides, warmup=args.warmup, steps=args.steps, target_ratio=1.15,
                  machine=roof, **runs)
    if "staleness0" in runs and "staleness1" in runs:
        result["speedup_1_over_0"] = speedup = (runs["staleness0"]["step_s"]
                                                / runs["staleness1"]["step_s"])
        result["target_met"] = runs["staleness1"]["ratio_step_over_max"] <= 1.15
        print(f"staleness 1 vs 0: {speedup:.2f}x faster per step (target: step <= 1.15 x "
              f"max(gen, train) -> {'met' if result['target_met'] else 'NOT met'})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
