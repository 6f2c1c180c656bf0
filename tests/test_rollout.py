"""The schedule that a dedicated generator rank and the trainers must agree on
(train_grpo.schedule), and collecting a step's rollouts (rollout.collect). The backend "auto" picks:
test_engine.py; the data order, a function of seed and step alone, is data.step_batch:
test_data.py."""
import json
import subprocess
import sys
from types import SimpleNamespace

import train_grpo
from conftest import ROOT


def test_one_schedule_for_both_loops_and_every_eval_sees_fresh_weights():
    """train_grpo.schedule: what main() and generator_loop() both do at step s (their collectives
    must match)."""
    cfg = SimpleNamespace(dist=SimpleNamespace(sync_interval=3), eval=SimpleNamespace(every=5),
                          train=SimpleNamespace(steps=12), rollout=SimpleNamespace(max_staleness=0),
                          ckpt=SimpleNamespace(every=4))
    plans = [train_grpo.schedule(s, cfg) for s in range(12)]
    # every 5 steps and after the last
    assert [s for s, p in enumerate(plans) if p.eval] == [4, 9, 11]
    # every 3 steps, and before each eval
    assert [s for s, p in enumerate(plans) if p.sync] == [2, 4, 5, 8, 9, 11]
    assert [s for s, p in enumerate(plans) if p.ckpt] == [3, 7, 11]  # after steps 4, 8, 12
    assert not any(p.ahead for p in plans)
    cfg.rollout.max_staleness = 1  # one batch ahead, except after the last step
    assert ([p.ahead for p in (train_grpo.schedule(s, cfg) for s in range(12))]
            == [(s + 1,) for s in range(11)] + [()])
    cfg.rollout.max_staleness = 3  # the first step fills the pipeline; none past the last step
    for start in (0, 5):
        ahead = [train_grpo.schedule(s, cfg, start).ahead for s in range(start, 12)]
        assert ahead[0] == (start + 1, start + 2, start + 3)
        assert ahead[1:] == [(s + 3,) for s in range(start + 1, 9)] + [()] * 3
        made = [j for a in ahead for j in a]  # each later batch generated exactly once
        assert made == list(range(start + 1, 12))
    cfg.eval.every = 0
    # the final eval always runs
    assert [s for s in range(12) if train_grpo.schedule(s, cfg).eval] == [11]


COLLECT = """
import json, os, sys, time, torch, torch.distributed as tdist
import rollout
torch.set_num_threads(2)
tdist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.ones(1 << 20).add_(1)  # the main thread's OpenMP team
names = lambda: sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
before = names()
share = {"idx": [0, 1, 2, 3], "gen_s": 1.0,  # 4 prompts x 8 x 128 logprobs: a ~40 KB pickle
         "completions": [[[float(i * j + k) for k in range(128)] for j in range(8)] for i in range(4)]}
groups, gen_s = rollout.collect(share, 4)
time.sleep(0.2)
print(json.dumps({"before": before, "after": names(), "same": groups == share["completions"] and gen_s == 1.0}))
"""


def test_collect_in_one_process_starts_no_openmp_team_in_gloos_threads(tmp_path):
    """A step's rollouts gathered through gloo ran torch's copy of the (~40 KB) pickle in a gloo thread, which then
    started an OpenMP team of its own: from then on libgomp manages more threads than the process has cores and every
    parallel region's threads sleep instead of spinning between regions. Generation after step 0 ran ~30% slower (box
    D: 12.1 against 9.2 s; docs/performance.md). One process has nothing to gather from: its share is the step.
    The thread names tell: an OpenMP worker takes its creator's name, here gloo's pt_gloo_runloop."""
    p = subprocess.run([sys.executable, "-c", COLLECT, str(tmp_path / "pg")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.splitlines()[-1])
    assert r["same"] and r["after"] == r["before"], r


def test_groups_without_signal_are_split_into_all_right_and_all_wrong():
    """metrics.rollout_stats: the zero-std share, and on which side each such group fell."""
    import torch
    import metrics
    correct = torch.tensor([[1., 1., 1.], [0., 0., 0.], [1., 0., 1.], [0., 0., 0.]])
    r = correct + 0.0
    groups = [[SimpleNamespace(finish_reason="stop")] * 3] * 4
    st = SimpleNamespace(r=r, correct=correct, lengths=torch.full((4, 3), 5.0), groups=groups,
                         batch={"version": torch.zeros(12)})
    row = metrics.rollout_stats(st, 0, None)
    assert row["rollout/zero_std_frac"] == 0.75
    assert (row["rollout/all_right_frac"], row["rollout/all_wrong_frac"]) == (0.25, 0.5)
