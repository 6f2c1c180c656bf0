"""The distillation demo: a GRPO-trained SmolLM2-135M-Instruct teaches the base model
on-policy, beside GRPO from the same start.

    make demo-distill        (= python scripts/demo_distill.py after the install step; not in CI)
    python scripts/demo_distill.py --seed=1 --teacher=out/demo_distill/teacher/hf

Phases, each the real trainer in its own process, on the real-model demo's task (1-digit
arithmetic word problems, configs/smollm2_cpu.py, 8 prompts x 8 samples a step, fp32):
1. the teacher: the real-model demo's GRPO run from the base checkpoint (scripts/demo_real.py: 40
   steps, evals every 10). Its curve is also the GRPO side of the comparison: same start, seed and
   batch. With --teacher=<export> this phase is skipped: the teacher is evaluated on this seed's
   held-out problems (the step-0 eval of a one-step run), and a GRPO run of --grpo_steps steps
   with this seed is the comparison.
2. the student: the same config from the same base checkpoint with --distill.teacher=<teacher>:
   each sampled token's advantage is log pi_teacher - log pi_student (docs/distill.md); the
   task reward is unused.
Phase 2 runs 15 steps. Held-out greedy accuracy on 200 problems, every 5 steps but in phase 1. The
summary gives, for each side, the first eval that reaches 90% of the teacher's accuracy, in steps
and in seconds of training (the sum of perf/step_s less the evals' perf/eval_s). The demo takes
about 30 minutes on 2 cores (docs/distill.md); docs/distill.md's 3-seed study ran
`--teacher.eval.every=5 --distill.train.steps=20`.

Outputs, under <out>/demo_distill/: summary.json, demo_distill.png (accuracy against steps and
against seconds), and the runs in teacher/ (or grpo/) and distill/. Overrides:
`--teacher.<section>.<field>=v`, `--grpo.…` and `--distill.…` go to that phase's train_grpo.py
(`--distill.distill.coef=2`).
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from demo import read_metrics, run_phase  # noqa: E402  (scripts/demo.py: a trainer in a subprocess)

SHARED = ["--model.dtype=float32", "--eval.num_problems=200"]
EVERY = ["--eval.every=5"]  # phases 2 and 3; phase 1 keeps demo-real's 10 (configs/smollm2_cpu.py)
DISTILL_STEPS = 15
SHARE = 0.9  # the bar: the student reaches 90% of its teacher's accuracy


def curve(rows):
    """[(step, training seconds, held-out accuracy)]: seconds sum perf/step_s less the evals'
    perf/eval_s up to that step."""
    out, t = [], 0.0
    for r in rows:
        t += r.get("perf/step_s", 0.0) - r.get("perf/eval_s", 0.0)
        if "eval/pass@1" in r:
            out.append((r["step"], round(t, 1), r["eval/pass@1"]))
    return out


def first_reaching(points, target):
    """The first (step, seconds, accuracy) at or above target; None if the run never got there."""
    return next((p for p in points if p[2] >= target), None)


def summarize(teacher_acc, sides, seed):
    """The figures: each side's curve, its gain, and where it first reached SHARE of the teacher."""
    target = SHARE * teacher_acc
    s = {"seed": seed, "teacher_accuracy": teacher_acc, "target": target}
    for name, points in sides.items():
        hit = first_reaching(points, target)
        s[name] = {"curve": points, "start": points[0][2], "end": points[-1][2],
                   "gain": points[-1][2] - points[0][2],
                   "reached_step": hit and hit[0], "reached_seconds": hit and hit[1]}
    return s


def plot(s, out):
    import matplotlib
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("distill", "grpo"):
        step, sec, acc = zip(*s[name]["curve"])
        label = "on-policy distillation" if name == "distill" else "GRPO (task reward)"
        axes[0].plot(step, acc, marker="o", label=label)
        axes[1].plot([x / 60 for x in sec], acc, marker="o", label=label)
    for ax, xlabel in zip(axes, ("step", "training minutes (evals excluded)")):
        ax.axhline(s["teacher_accuracy"], color="gray", linestyle=":", label="teacher")
        ax.axhline(s["target"], color="gray", linestyle="--", label=f"{SHARE:.0%} of the teacher")
        ax.set(xlabel=xlabel, ylim=(0, 1), ylabel="held-out greedy accuracy")
        ax.legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, 1-digit arithmetic, seed {s['seed']}")
    fig.tight_layout()
    fig.savefig(Path(out, "demo_distill.png"), dpi=80)
    plt.close(fig)


def print_table(s, out):
    print(f"\nheld-out greedy accuracy, 200 problems, seed {s['seed']}; teacher "
          f"{s['teacher_accuracy']:.3f}, {SHARE:.0%} of it {s['target']:.3f}")
    for name in ("distill", "grpo"):
        r = s[name]
        hit = (f"step {r['reached_step']} ({r['reached_seconds']:.0f} s of training)"
               if r["reached_step"] is not None else "not reached")
        print(f"  {name:<8} {r['start']:.3f} -> {r['end']:.3f} ({r['gain']:+.3f}); "
              f"{SHARE:.0%} of the teacher: {hit}")
    print(f"figures: {out}/summary.json   plot: {out}/demo_distill.png")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out", help="outputs go to <out_dir>/demo_distill/")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--teacher", default="", help="a trained teacher's export: skips phase 1")
    ap.add_argument("--reuse_teacher", action="store_true",
                    help="phase 1 already ran in <out_dir>/demo_distill/teacher: skip it")
    ap.add_argument("--grpo_steps", type=int, default=40,
                    help="with --teacher: the GRPO run's length")
    args, extra = ap.parse_known_args(argv)
    phases = ("teacher", "grpo", "distill")
    bad = [a for a in extra if not (a.startswith(tuple(f"--{p}." for p in phases)) and "=" in a)]
    if bad:
        sys.exit(f"demo_distill: unknown argument {bad[0]!r} (expected "
                 "--teacher.<section>.<field>=v, --grpo.… or --distill.…)")
    own = {p: ["--" + a.split(".", 1)[1] for a in extra if a.startswith(f"--{p}.")] for p in phases}
    if args.teacher and not Path(args.teacher, "config.json").exists():
        sys.exit(f"demo_distill: --teacher={args.teacher} holds no config.json "
                 "(a Hugging Face export)")
    out = Path(args.out_dir, "demo_distill")
    done = args.reuse_teacher and (out / "teacher" / "hf" / "config.json").exists()
    if args.reuse_teacher and not done:
        sys.exit(f"demo_distill: --reuse_teacher, but {out}/teacher holds no finished run")
    out.mkdir(parents=True, exist_ok=True)
    import fetch_model
    print(f"checkpoint: {fetch_model.fetch_smollm2()}", flush=True)  # converted once

    def trainer(run, more):
        cmd = [sys.executable, "train_grpo.py", "configs/smollm2_cpu.py",
               f"--log.out_dir={args.out_dir}", f"--log.run=demo_distill/{run}",
               f"--train.seed={args.seed}", *SHARED, *more]
        run_phase(run, cmd, out / f"{run}.log")
        return curve(read_metrics(out / run))

    if args.teacher:  # its accuracy on this seed's held-out problems: a one-step run's first eval
        teacher = args.teacher
        teacher_acc = trainer("teacher_eval", [f"--model.path={teacher}", "--train.steps=1"])[0][2]
    else:
        grpo = curve(read_metrics(out / "teacher")) if done else trainer("teacher", own["teacher"])
        teacher, teacher_acc = str(out / "teacher" / "hf"), grpo[-1][2]
    distill = trainer("distill", [f"--distill.teacher={teacher}", *EVERY,
                                  f"--train.steps={DISTILL_STEPS}", *own["distill"]])
    if args.teacher:  # the comparison: GRPO from the same start with this seed
        grpo = trainer("grpo", [*EVERY, f"--train.steps={args.grpo_steps}", *own["grpo"]])
    s = summarize(teacher_acc, {"distill": distill, "grpo": grpo}, args.seed)
    s["teacher"] = teacher
    Path(out, "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    plot(s, out)
    print_table(s, out)
    return s


if __name__ == "__main__":
    main()
