"""Sandbox throughput: programs per second through sandbox.run_many on this machine, for a trivial program and for
one that runs into its time limit, at 1 and 2 workers; and one code-reward call (rewards.CodeReward on a reference
solution of the embedded code task), to set beside a GRPO step's time.

    .venv/bin/python bench/sandbox.py [--n=32] [--out=bench/results/sandbox.json]
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import machine  # noqa: E402
import rewards  # noqa: E402
import sandbox  # noqa: E402
import tasks  # noqa: E402


def rate(code, n, workers, timeout_s):
    t0 = time.perf_counter()
    rs = sandbox.run_many([(code, "")] * n, workers=workers, timeout_s=timeout_s, memory_mb=256)
    wall = time.perf_counter() - t0
    return {"programs_per_s": n / wall, "wall_s": wall, "statuses": sorted({r.status for r in rs})}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--out", default="bench/results/sandbox.json")
    a = ap.parse_args()
    out = {"machine": machine.roofline(), "isolation": sandbox.isolation(), "n": a.n}
    for workers in (1, 2):
        out[f"trivial_w{workers}"] = rate("print(1)", a.n, workers, 2.0)
        out[f"timeout_1s_w{workers}"] = rate("while True: pass", max(4, a.n // 8), workers, 1.0)
    problems, reward = tasks.make_code(a.n, seed=0), rewards.CodeReward()
    t0 = time.perf_counter()
    scores = [reward("", p["solution"], p["target"]) for p in problems]
    out["code_reward_s"] = (time.perf_counter() - t0) / a.n
    assert scores == [1.0] * a.n, scores
    print(json.dumps(out, indent=1))
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
