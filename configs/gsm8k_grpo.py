# GRPO as in DeepSeekMath (arXiv 2402.03300), on the 8-GPU GSM8K setup of configs/gsm8k.py.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k_grpo.py
# Settings and sources: docs/losses-spec.md section 4 (GRPO) and section 1 (advantages).

include("gsm8k.py")  # the 8-GPU base
loss.name = "grpo"
loss.kwargs = {"clip_low": 0.2, "clip_high": 0.2,   # symmetric PPO clip; the paper gives no value, 0.2 is PPO's
               "beta": 0.04, "kl": "k3",            # KL in the loss: 0.04 and k3 (DeepSeekMath sec. 4.2, eq. 4)
               "agg": "seq_mean_token_mean"}        # the paper's 1/G sum_i 1/|o_i| sum_t (verl defaults to token-mean)
loss.adv = "grpo"                                   # group z-score, std with ddof=1 ...
loss.adv_eps = 1e-6                                 # ... and verl's eps (the paper has none; spec sec. 1)
log.run = "gsm8k_grpo"
