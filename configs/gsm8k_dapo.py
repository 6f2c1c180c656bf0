# DAPO (arXiv 2503.14476), on the 8-GPU GSM8K setup of configs/gsm8k.py.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k_dapo.py
# Settings and sources: docs/losses-spec.md section 6 (loss), section 1 (dynamic sampling,
# overlong).

include("gsm8k.py")  # the 8-GPU base
loss.name = "dapo"
loss.kwargs = {"clip_low": 0.2, "clip_high": 0.28}  # Clip-Higher (paper sec. 4.1); token-mean (eq. 12); no KL
loss.adv = "grpo"                                   # group z-score
rollout.filter_zero_std = True                      # dynamic sampling: drop all-right / all-wrong groups and
rollout.refill_rounds = 4                           # refill: up to 4 more rounds of B prompts until B groups count
rollout.max_tokens = 1024                           # L_max; the paper's is 20480 = 16384 + a 4096 cache ...
rollout.overlong_cache = 256                        # ... soft overlong punishment over the last 1/4 of the budget
# (the paper's window is 1/5 of L_max; with GSM8K's short answers only runaway responses reach it).
log.run = "gsm8k_dapo"
