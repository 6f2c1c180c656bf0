# 1 GPU, colocated: the trainer and a vLLM engine share the device (vLLM sleeps during the update).
#   python train_grpo.py configs/gsm8k_1gpu.py
# Sized for one 80 GB GPU: policy + reference (bf16) + AdamW state ~ 15 GB, vLLM KV cache 8 GB.
model.path = "Qwen/Qwen2.5-1.5B-Instruct"
model.dtype = "bfloat16"
data.name = "gsm8k"
data.source = "openai/gsm8k"
data.instruction = "\nPlease reason step by step, and put your final answer within \\boxed{}."
rollout.prompts_per_step = 16               # B
rollout.group_size = 8                      # G: 128 completions per step
rollout.max_tokens = 512
rollout.kv_cache_mb = 8192
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
