"""Golden runs: a refactoring must not change what the trainers compute.

Runs a handful of short trainings from one random tiny checkpoint (single- and multi-turn, the torch
and the vLLM generator, colocated and with a vLLM rank under torchrun, staleness with DAPO's refill
and minibatches, SFT) and keeps every metric except wall-clock ones. Save before a change, check
after it:

    python scripts/golden.py --save out/golden/before.json
    python scripts/golden.py --check out/golden/before.json
        # exit 1 and the first differences if any moved

The numbers depend on this machine's CPU kernels, so a golden file is compared on the box that wrote
it, never committed. A change that is meant to alter sampling (a new seed function) says so and
saves a new file.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--rollout.prompts_per_step=8", "--rollout.group_size=4", "--rollout.max_tokens=24",
         "--eval.every=2", "--eval.num_problems=16", "--train.steps=3", "--log.plot_every_s=-1",
         "--optim.lr=3e-3", "--optim.warmup_steps=0",
         "--rollout.kv_cache_mb=32", "--dist.timeout_s=180"]
RUNS = {  # name -> (launcher processes (0: plain python), trainer, arguments)
    "torch": (0, "train_grpo.py", ["--rollout.backend=torch"]),
    "vllm": (0, "train_grpo.py", ["--rollout.backend=vllm"]),
    "turns": (0, "train_grpo.py", ["--rollout.backend=torch", "--rollout.env=calculator",
                                   "--rollout.overlong_cache=0",
                                   "--rollout.max_episode_tokens=64"]),
    "stale_refill": (0, "train_grpo.py", ["--rollout.backend=torch", "--rollout.max_staleness=1",
                                          "--rollout.filter_zero_std=True",
                                          "--rollout.refill_rounds=1", "--train.minibatches=2",
                                          "--loss.correction=tis", "--log.drift=True"]),
    "vllm_rank": (2, "train_grpo.py", ["--rollout.backend=vllm", "--dist.generator_ranks=1"]),
    "sft": (0, "train_sft.py", ["--train.steps=4", "--eval.every=2", "--eval.num_problems=16",
                                "--log.plot_every_s=-1"]),
}
# A random tiny model never answers right, so the math reward alone is 0 and the update does
# nothing: a reward with signal in every group (the share of digits in a reply) makes each run's
# update, KL and drift move.
REWARD = ('def digits(prompt, response, target):\n'
          '    return sum(c.isdigit() for c in response) / max(len(response), 1)\n')
WALL = ("perf/", "time/")  # wall-clock metrics: they move between any two runs
WALL_KEYS = {"sync/seconds", "sync/gbps", "ckpt/save_s"}


def run_one(name, init, out):
    nproc, script, args = RUNS[name]
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
                if nproc else [sys.executable])
    reward = f"--rollout.rewards={{'math': 1.0, '{out.parent / 'reward.py'}:digits': 1.0}}"
    config = (["configs/sft_tiny.py"] if script == "train_sft.py"
              else ["configs/tiny.py", *SMALL, reward])
    cmd = [*launcher, script, *config, f"--model.path={init}", f"--log.out_dir={out}",
           f"--log.run={name}", *args]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise SystemExit(f"{name} failed:\n{' '.join(cmd)}\n"
                         f"{res.stdout[-2000:]}{res.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith(WALL) and k not in WALL_KEYS}
            for r in rows]


# stale_refill differs from run to run by <= 1e-6 relative with the same code, on the commit before
# the golden harness too (fp32 sums in another order somewhere in its stale, refilled, two-minibatch
# update): it is compared to NOISY relative; every other run must match to the last bit.
NOISY = {"stale_refill": 1e-5}


def same(a, b, name):
    if a == b:
        return True
    tol = NOISY.get(name, 0.0)
    return isinstance(a, float) and isinstance(b, float) and abs(a - b) <= tol * max(abs(a), abs(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", help="write the metrics here")
    ap.add_argument("--check", help="compare against this file")
    ap.add_argument("--only", nargs="*", default=list(RUNS), choices=list(RUNS))
    args = ap.parse_args()
    out = ROOT / "out" / "golden" / "runs"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)  # a fresh clone has no out/
    sys.path.insert(0, str(ROOT))
    import data
    (out.parent / "reward.py").write_text(REWARD)
    init = out.parent / "init"
    if not (init / "config.json").exists():
        data.make_tiny_checkpoint(str(init), seed=0)
    got = {}
    for name in args.only:
        got[name] = run_one(name, init, out)
        print(f"{name}: {len(got[name])} rows", flush=True)
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(got, indent=1, sort_keys=True))
    if args.check:
        want, bad = json.loads(Path(args.check).read_text()), 0
        for name in args.only:
            for i, (a, b) in enumerate(zip(want[name], got[name])):
                moved = sorted(k for k in set(a) | set(b) if not same(a.get(k), b.get(k), name))
                for k in moved[:5]:
                    print(f"{name} row {i} {k}: {a.get(k)} -> {b.get(k)}")
                bad += len(moved)
            if len(want[name]) != len(got[name]):
                print(f"{name}: {len(want[name])} rows -> {len(got[name])}")
                bad += 1
        print("golden: identical" if not bad else f"golden: {bad} values moved")
        return int(bool(bad))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
