# CISPO (MiniMax-M1, arXiv 2506.13585), on the 8-GPU GSM8K setup of configs/gsm8k.py.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k_cispo.py
# Settings and sources: docs/losses-spec.md section 7.

include("gsm8k.py")  # the 8-GPU base
loss.name = "cispo"
loss.kwargs = {"clip_high": 4.0,    # IS weight capped at 1 + 4.0 = 5.0: ScaleRL (2510.13786) / TRL's value;
               "clip_low": None}    # MiniMax do not disclose theirs. No lower bound, as the paper sets it.
# No KL; token-mean aggregation (fixed inside CISPOLoss).
loss.adv = "grpo"                   # group z-score
log.run = "gsm8k_cispo"
