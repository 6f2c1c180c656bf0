# The loss grid's cell on the tiny task (scripts/compare.py; docs/losses.md): what every
# configs/tiny_<loss>.py shares. Each of those names its loss, the loss's knobs and its best
# on-policy learning rate, then includes this.
#   python train_grpo.py configs/tiny_grid.py      a cell with tiny.py's loss and learning rate

include("tiny.py")  # the tiny base
# the grid's constant lr from step 1 (compare.FIXED), not tiny.py's warm-up: on the AVX2 path 1e-4
# from step 1 dips first (docs/losses.md); to train longer than the grid, drop these three lines
# and keep tiny.py's schedule
optim.warmup_steps = 0
optim.schedule = "constant"
rollout.overlong_cache = 0
rollout.max_staleness = 0          # on-policy; the grid's stale column is --rollout.max_staleness=1
train.steps = 22
train.seed = 0
eval.every = 10
