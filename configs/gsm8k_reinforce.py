# torchforge's REINFORCE (clamped, detached IS weight), on the 8-GPU GSM8K setup of configs/gsm8k.py.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k_reinforce.py
# Settings and sources: docs/losses-spec.md section 3 (loss) and section 1 (RLOO advantages).

include("gsm8k.py")  # the 8-GPU base
loss.name = "reinforce"
loss.kwargs = {"is_min": 0.1, "is_max": 10.0}   # torchforge's clamp of sg(pi/pi_old); token-mean; no KL
loss.adv = "rloo"           # leave-one-out baseline (arXiv 2402.14740): unbiased, no std division.
# torchforge itself pairs this loss with the group z-score: loss.adv = "grpo", loss.adv_eps = 1e-4.
log.run = "gsm8k_reinforce"
