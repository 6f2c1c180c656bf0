# GSPO (Qwen, arXiv 2507.18071v2), on the 8-GPU GSM8K setup of configs/gsm8k.py.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k_gspo.py
# Settings and sources: docs/losses-spec.md section 8.

include("gsm8k.py")  # the 8-GPU base
loss.name = "gspo"
loss.kwargs = {"clip_low": 3e-4, "clip_high": 4e-4,  # paper sec. 5.1 (a sequence ratio stays near 1)
               "level": "sequence"}                  # eq. 5-7; "token" (eq. 13-14) is the same for per-sequence A
loss.adv = "grpo"                                    # group z-score (eq. 6); no KL
train.minibatches = 4                                # the paper splits each rollout batch into 4 minibatches:
train.micro_batch = 16                               # without off-policy updates the sequence clip never acts
log.run = "gsm8k_gspo"
