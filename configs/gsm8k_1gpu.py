# 1 GPU, colocated: the trainer and a vLLM engine share the device (vLLM sleeps during the update).
#   python train_grpo.py configs/gsm8k_1gpu.py
# Sized for one 80 GB GPU. vLLM is built with sleep mode and may use gpu_memory_utilization x 80 GB
# = 24 GB: weights 3 GB + KV 8 GB + CUDA graphs and activations. The trainer keeps the other 56 GB:
# fp32 policy weights + grads + AdamW (16 B/param = 25 GB) and the reference, stored in bf16 as it
# computes (3 GB, run.load_model), plus activations. During the update vLLM sleeps (level 2 when new
# weights follow: weights and KV freed), so the update can use nearly the whole GPU. Without vLLM
# the torch generator runs instead (rollout.backend = "auto"), in bf16, and needs no budget of its
# own.
model.path = "Qwen/Qwen2.5-1.5B-Instruct"
model.dtype = "bfloat16"
data.name = "gsm8k"
data.source = "openai/gsm8k"
data.instruction = "\nPlease reason step by step, and put your final answer within \\boxed{}."
rollout.prompts_per_step = 16               # B
rollout.group_size = 8                      # G: 128 completions per step
rollout.max_tokens = 512
rollout.kv_cache_mb = 8192                  # 128 completions x ~650 tokens x 28 KB = 2.3 GB, with room for eval
rollout.gpu_memory_utilization = 0.3        # vLLM's share beside the trainer (TRL's colocate default too)
loss.name = "grpo"
loss.kwargs = {"beta": 0.04}
optim.lr = 1e-6
optim.warmup_steps = 10
train.steps = 500
train.micro_batch = 8                       # 128 sequences / 8 = 16 accumulation steps
dist.generator_ranks = 0                    # colocated
eval.every = 50
eval.num_problems = 500
log.run = "gsm8k_1gpu"
ckpt.every = 50
