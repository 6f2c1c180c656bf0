# DAPO (arXiv 2503.14476) on the tiny task, at its best on-policy learning rate in the loss grid
# (scripts/compare.py, 3 seeds x lrs 3e-05, 0.0001, 0.0003 x staleness 0/1; docs/losses.md).
#   python train_grpo.py configs/tiny_dapo.py      reproduces the grid cell below (seed 0)
# cell: dapo lr=0.0001 staleness=0 seed=0 steps=22
# Grid, mean ± std over seeds, held-out gain after 22 steps: on-policy +0.089 ± 0.006;
# stale by one batch at this lr +0.085 ± 0.031; at its best stale lr (0.0001) +0.085 ± 0.031.

include("tiny_grid.py")  # the tiny base, as the grid runs it
loss.name = "dapo"
loss.kwargs = {}
rollout.filter_zero_std = True   # dynamic sampling, refilled (rollout.refill_rounds)
optim.lr = 0.0001
log.run = "tiny_dapo"
