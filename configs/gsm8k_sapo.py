# SAPO (Qwen, arXiv 2511.20347), on the 8-GPU GSM8K setup of configs/gsm8k.py.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k_sapo.py
# Settings and sources: docs/losses-spec.md section 9.

include("gsm8k.py")  # the 8-GPU base
loss.name = "sapo"
loss.kwargs = {"tau_pos": 1.0,      # soft gate temperatures (paper experiments; verl and TRL defaults):
               "tau_neg": 1.05}     # tau_neg > tau_pos, the most stable setting of the paper's ablation
# No KL; seq-mean-token-mean aggregation (fixed inside SAPOLoss).
loss.adv = "grpo"                   # group z-score
log.run = "gsm8k_sapo"
