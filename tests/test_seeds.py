"""seeds.py: every random stream is named, and no two streams coincide.

The sampling seeds are composed the way the trainer composes them (rollout.sample_seed per step and
DAPO round, episodes.turn_seed per turn, generator.request_seed per vLLM request); the hand-mixed
seeds they replace gave request k of step s and request k - 1 of step s + 1 the same random
numbers."""
import os
import subprocess
import sys

import episodes
import generator
import rollout
import seeds
import train_grpo
from conftest import ROOT


def test_no_request_seed_repeats_over_steps_rounds_turns_and_requests(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = train_grpo.parse_config(["configs/tiny.py"])
    # 64 = prompts_per_step x group_size of a small batch
    steps, rounds, turns, requests = 100, 3, 4, 64
    seen = set()
    for s in range(steps):
        for r in range(rounds):
            batch = rollout.sample_seed(cfg.train.seed, s, r)
            for t in range(turns):
                call = episodes.turn_seed(batch, t)
                seen.update(generator.request_seed(call, k) for k in range(requests))
        seen.add(seeds.seed(cfg.train.seed, "eval", s))
        seen.add(seeds.seed(cfg.train.seed, "pass_k", s))
    assert len(seen) == steps * rounds * turns * requests + 2 * steps
    # fits torch.Generator, random.Random and vLLM's seed
    assert all(0 <= x < 2 ** 63 for x in seen)


def test_a_seed_is_the_same_in_every_process_and_differs_by_any_key():
    here = seeds.seed(3, "sample", 7, 0)
    code = "import seeds; print(seeds.seed(3, 'sample', 7, 0))"
    for hashseed in ("0", "12345"):  # str hashing is salted per process; the seed must not be
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": hashseed}, check=True).stdout
        assert int(out) == here
    others = [seeds.seed(4, "sample", 7, 0), seeds.seed(3, "sample", 8, 0),
              seeds.seed(3, "sample", 7, 1), seeds.seed(3, "order", 7, 0),
              seeds.seed(3, "sample", 7), seeds.seed("3", "sample", 7, 0)]
    assert here not in others and len(set(others)) == len(others)
