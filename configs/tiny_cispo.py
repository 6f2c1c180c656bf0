# CISPO (MiniMax-M1, arXiv 2506.13585) on the tiny task, at its best on-policy learning rate in the loss grid
# (scripts/compare.py, 3 seeds x lrs 3e-05, 0.0001, 0.0003 x staleness 0/1; docs/losses.md).
#   python train_grpo.py configs/tiny_cispo.py      reproduces the grid cell below (seed 0)
# cell: cispo lr=3e-05 staleness=0 seed=0 steps=22
# Grid, mean ± std over seeds, held-out gain after 22 steps: on-policy +0.056 ± 0.015;
# stale by one batch at this lr +0.053 ± 0.022; at its best stale lr (0.0001) +0.061 ± 0.037.

include("tiny_grid.py")  # the tiny base, as the grid runs it
loss.name = "cispo"
loss.kwargs = {}
optim.lr = 3e-05
log.run = "tiny_cispo"
