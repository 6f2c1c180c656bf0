# 1 GPU, colocated, LoRA: a 7B model on GSM8K where full fine-tuning would not fit one 80 GB GPU.
#   python train_grpo.py configs/gsm8k_lora_1gpu.py
# Not run yet: no GPU has been lent since it was written (the check to run first:
# `bash bench/gpu.sh --parts grpo grpo_lora`; memory estimate in docs/gpu.md). What it holds and why
# (docs/lora.md):
# - the trainer: the frozen base stored in bf16 (run.load_model: 7.6B x 2 B = 15 GB) and rank-32
#   adapters on every Linear of every block (~80M parameters: fp32 weights + grads + AdamW, 16 B
#   each = 1.3 GB); full fine-tuning would need 16 B x 7.6B = 122 GB before activations. The
#   reference for beta > 0 is the base with its adapters off: no second copy.
# - vLLM colocated, sleeping during the update: 0.45 x 80 GB = 36 GB for its bf16 weights (15 GB),
#   the KV cache and CUDA graphs. Each sync sends the adapters (~320 MB in fp32) and the merge
#   (lora.Merger) rebuilds the weights from the base checkpoint on disk, a tensor at a time on the
#   GPU.
# - the learning rate: ~10x full fine-tuning's (configs/gsm8k_1gpu.py: 1e-6), as "LoRA Without
#   Regret" (Thinking Machines Lab, 2025) found for RL; on the CPU demo 30x did better than 10x
#   (docs/lora.md#does-it-learn), so sweep 1e-5 to 3e-5 before a long run.
include("gsm8k_1gpu.py")  # the 1-GPU base: data, batch, loss, schedule
model.path = "Qwen/Qwen2.5-7B-Instruct"
model.lora_rank = 32
model.lora_alpha = 64.0                     # scale alpha / r = 2, as on the CPU demo
optim.lr = 2e-5
rollout.gpu_memory_utilization = 0.45
train.micro_batch = 4                       # 128 sequences / 4 = 32 accumulation steps
dist.activation_checkpointing = True        # a block's activations recomputed in backward
log.run = "gsm8k_lora_1gpu"
