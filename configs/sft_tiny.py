# CPU: SFT a tiny model from scratch on the synthetic arithmetic task
# (docs/demo.md#how-the-task-was-calibrated).
#   python train_sft.py configs/sft_tiny.py                        (the demo adds --log.run=demo/sft)
# The calibrated recipe: 64 fresh 1-2 digit problems per step, loss on the completion + end-of-turn only,
# AdamW (0.9, 0.98), lr 2e-3, 30 warmup steps, cosine to 10% over 1500 steps, clip 1.0. Accuracy on 2-digit
# held-out problems jumps at a seed-dependent step, so the run stops on a dev accuracy target instead of a
# step count: GRPO (configs/tiny.py) needs a start between ~0.2 and ~0.7 to have room to improve.
model.path = "tiny:out/tiny/init"  # random init + the task's tokenizer, made there on first use
model.dtype = "float32"             # not "auto": the calibrated recipe was measured in fp32 on both boxes
data.name = "arith"
data.min_digits = 1                 # SFT on 1-2 digit operands ...
data.max_digits = 2
data.eval_min_digits = 2            # ... eval (and GRPO) on 2-digit operands
data.eval_max_digits = 2
data.pack_len = 256                 # ~8 examples of <= 35 tokens per row
data.max_seq_tokens = 64
optim.lr = 2e-3
optim.betas = (0.9, 0.98)
optim.weight_decay = 0.01
optim.warmup_steps = 30
optim.schedule = "cosine"
optim.min_lr_ratio = 0.1
optim.grad_clip = 1.0
train.steps = 1500                  # the cosine horizon; the accuracy target usually ends the run near 800
train.batch_size = 64
train.micro_batch = 64              # one forward/backward per step
eval.every = 25
eval.num_problems = 200
eval.max_tokens = 24                # completions are <= 18 tokens
eval.stop_at_accuracy = 0.4
eval.min_step = 200
log.run = "sft_tiny"
