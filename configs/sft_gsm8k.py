# 8 GPUs: SFT Qwen2.5-1.5B (base) on GSM8K's reference solutions, FSDP2 over 8 ranks, bf16 compute.
#   torchrun --nproc_per_node=8 train_sft.py configs/sft_gsm8k.py
#   python train_sft.py configs/sft_gsm8k.py          (1 GPU: 64 examples -> ~7 packed rows, one per micro-batch)
# The target is the dataset's worked solution verbatim ("... <<48/2=24>> ... #### 72"); rewards.MathReward
# reads its "#### N" answer line, so eval/pass@1 needs no answer-format instruction.
model.path = "Qwen/Qwen2.5-1.5B"            # or a local directory with the same files
model.dtype = "bfloat16"
data.name = "gsm8k"
data.source = "openai/gsm8k"                # or data/gsm8k/train.jsonl
data.eval_source = ""                       # "" = the hub's test split (or data/gsm8k/test.jsonl)
data.pack_len = 2048                        # ~10 GSM8K examples (~200 tokens each) per row
data.max_seq_tokens = 1024
optim.lr = 1e-5
optim.betas = (0.9, 0.95)
optim.weight_decay = 0.0
optim.warmup_steps = 20
optim.schedule = "cosine"
train.steps = 350                           # ~3 epochs of 7473 examples at 64 per step
train.batch_size = 64                       # 8 per rank, packed into ~1 row of 2048 tokens
train.micro_batch = 1
eval.every = 50
eval.num_problems = 256
eval.max_tokens = 320
log.run = "sft_gsm8k"
ckpt.every = 100
