# SAPO (arXiv 2511.20347) on the tiny task, at its best on-policy learning rate in the loss grid
# (scripts/compare.py, 3 seeds x lrs 3e-05, 0.0001, 0.0003 x staleness 0/1; docs/losses.md).
#   python train_grpo.py configs/tiny_sapo.py      reproduces the grid cell below (seed 0)
# cell: sapo lr=0.0001 staleness=0 seed=0 steps=22
# Grid, mean ± std over seeds, held-out gain after 22 steps: on-policy +0.069 ± 0.031;
# stale by one batch at this lr +0.030 ± 0.021; at its best stale lr (3e-05) +0.051 ± 0.024.

include("tiny_grid.py")  # the tiny base, as the grid runs it
loss.name = "sapo"
loss.kwargs = {"tau_pos": 1.0, "tau_neg": 1.05}
optim.lr = 0.0001
log.run = "tiny_sapo"
