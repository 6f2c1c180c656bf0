# Dr.GRPO, "GRPO Done Right" (arXiv 2503.20783), on the 8-GPU GSM8K setup of configs/gsm8k.py.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k_dr_grpo.py
# Settings and sources: docs/losses-spec.md section 5.

include("gsm8k.py")  # the 8-GPU base
loss.name = "dr_grpo"
loss.kwargs = {"clip_low": 0.2, "clip_high": 0.2}   # PPO clip 0.2 (paper Table 6); no KL ("beta = 0 throughout")
# The constant normaliser C is rollout.max_tokens (checks.loss_kwargs passes it): loss = sum m*l / (B*C),
# the authors' oat code and TRL "dr_grpo" (the paper used C = 3000 with a 3000-token budget).
loss.adv = "dr_grpo"                                 # A = R - mean_g R: no division by the
#                                                    # group std
log.run = "gsm8k_dr_grpo"
