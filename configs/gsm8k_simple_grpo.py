# torchforge's SimpleGRPO (on-policy GRPO, no clip), on the 8-GPU GSM8K setup of configs/gsm8k.py.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k_simple_grpo.py
# Settings and sources: docs/losses-spec.md section 2 (meta-pytorch/torchforge SimpleGRPOLoss).

include("gsm8k.py")  # the 8-GPU base
loss.name = "simple_grpo"
loss.kwargs = {"beta": 0.1}         # torchforge's default; the paper's is 0.04 (spec sec. 2 [DISAGREE]); k3 KL
loss.adv = "grpo"                   # torchforge ComputeAdvantages: group z-score ...
loss.adv_eps = 1e-4                 # ... with eps 1e-4
# SimpleGRPO ignores old logprobs (ratio == 1 by construction), so it is only right on-policy:
rollout.max_staleness = 0           # no one-batch-ahead generation
train.ppo_epochs = 1                # one pass ...
train.minibatches = 1               # ... and one optimizer step per rollout batch
log.run = "gsm8k_simple_grpo"
