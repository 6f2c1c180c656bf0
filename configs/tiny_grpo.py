# GRPO (DeepSeekMath, arXiv 2402.03300) on the tiny task, at its best on-policy learning rate in the loss grid
# (scripts/compare.py, 3 seeds x lrs 3e-05, 0.0001, 0.0003 x staleness 0/1; docs/losses.md).
#   python train_grpo.py configs/tiny_grpo.py      reproduces the grid cell below (seed 0)
# cell: grpo lr=3e-05 staleness=0 seed=0 steps=22
# Grid, mean ± std over seeds, held-out gain after 22 steps: on-policy +0.056 ± 0.015;
# stale by one batch at this lr +0.063 ± 0.017; at its best stale lr (0.0001) +0.076 ± 0.041.

include("tiny_grid.py")  # the tiny base, as the grid runs it
loss.name = "grpo"
loss.kwargs = {"beta": 0.0, "agg": "token_mean"}
optim.lr = 3e-05
log.run = "tiny_grpo"
