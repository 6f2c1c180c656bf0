# torchforge's SimpleGRPO on the tiny task, at its best on-policy learning rate in the loss grid
# (scripts/compare.py, 3 seeds x lrs 3e-05, 0.0001, 0.0003 x staleness 0/1; docs/losses.md).
#   python train_grpo.py configs/tiny_simple_grpo.py      reproduces the grid cell below (seed 0)
# cell: simple_grpo lr=0.0001 staleness=0 seed=0 steps=22
# Grid, mean ± std over seeds, held-out gain after 22 steps: on-policy +0.069 ± 0.033;
# stale by one batch at this lr +0.007 ± 0.031; at its best stale lr (3e-05) +0.049 ± 0.026.

include("tiny_grid.py")  # the tiny base, as the grid runs it
loss.name = "simple_grpo"
loss.kwargs = {"beta": 0.0}
optim.lr = 0.0001
log.run = "tiny_simple_grpo"
