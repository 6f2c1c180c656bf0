# GSPO (arXiv 2507.18071) on the tiny task, at its best on-policy learning rate in the loss grid
# (scripts/compare.py, 3 seeds x lrs 3e-05, 0.0001, 0.0003 x staleness 0/1; docs/losses.md).
#   python train_grpo.py configs/tiny_gspo.py      reproduces the grid cell below (seed 0)
# cell: gspo lr=0.0001 staleness=0 seed=0 steps=22
# Grid, mean ± std over seeds, held-out gain after 22 steps: on-policy +0.071 ± 0.028;
# stale by one batch at this lr +0.064 ± 0.016; at its best stale lr (0.0001) +0.064 ± 0.016.

include("tiny_grid.py")  # the tiny base, as the grid runs it
loss.name = "gspo"
loss.kwargs = {}
optim.lr = 0.0001
log.run = "tiny_gspo"
