# REINFORCE (torchforge's ReinforceLoss) on the tiny task, at its best on-policy learning rate in the loss grid
# (scripts/compare.py, 3 seeds x lrs 3e-05, 0.0001, 0.0003 x staleness 0/1; docs/losses.md).
#   python train_grpo.py configs/tiny_reinforce.py      reproduces the grid cell below (seed 0)
# cell: reinforce lr=3e-05 staleness=0 seed=0 steps=22
# Grid, mean ± std over seeds, held-out gain after 22 steps: on-policy +0.056 ± 0.015;
# stale by one batch at this lr +0.053 ± 0.022; at its best stale lr (0.0001) +0.057 ± 0.037.

include("tiny.py")  # the tiny base
loss.name = "reinforce"
loss.kwargs = {}
optim.lr = 3e-05
optim.warmup_steps = 0             # the grid's constant lr from step 1 (compare.FIXED), not tiny.py's warm-up:
optim.schedule = "constant"        # on the AVX2 path 1e-4 from step 1 dips first (docs/losses.md); to train
rollout.overlong_cache = 0         # longer than the grid, drop these three lines and keep tiny.py's schedule
rollout.max_staleness = 0          # on-policy; the grid's stale column is --rollout.max_staleness=1
train.steps = 22
train.seed = 0
eval.every = 10
log.run = "tiny_reinforce"
