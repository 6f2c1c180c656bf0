#!/bin/bash
# Multi-node GRPO under Slurm: 2 nodes x 8 GPUs = 16 ranks in one torchrun job.
#   sbatch scripts/slurm_grpo.sh configs/gsm8k.py --dist.generator_ranks=4
# Everything after the script name goes to train_grpo.py (config files, then --section.field=value).
# srun starts one torchrun agent per node; the agents meet at a c10d rendezvous on the first node of the
# allocation and hand out global ranks (node 0 gets ranks 0-7). train_grpo puts the LAST
# dist.generator_ranks ranks on vLLM, so with 2 nodes they all sit on the second node. Check that
# rollout.prompts_per_step is divisible by the trainer ranks (validate() says so before loading anything).
# The same run without Slurm: README "Multi-node".
#SBATCH --job-name=nanoforge-grpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1            # one torchrun agent per node; it forks the 8 ranks
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=12:00:00
#SBATCH --output=slurm-%j.out
set -euo pipefail

# Rendezvous: the first hostname of the allocation hosts the c10d store (any free port works).
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}

# NCCL over InfiniBand / RoCE. Print these in the log; most clusters need only the interface names.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}              # INFO once to see which transport and NICs NCCL picked
export NCCL_IB_DISABLE=0                           # use the InfiniBand verbs transport (RDMA), not TCP sockets
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}            # which HCAs to use (prefix match); list them with `ibv_devices`
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}  # NIC for NCCL's bootstrap TCP traffic: not loopback
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}  # same for gloo (CPU-side groups)
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}  # GPUDirect RDMA (NIC reads GPU memory) when GPU and NIC
                                                     # share a PCIe host bridge; avoids a copy through host RAM
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}      # IB retransmit timeout exponent (4.096 us * 2^22 ~ 17 s):
                                                   # rides out short fabric hiccups instead of failing the job
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1           # a failed or timed-out collective tears the process down instead
                                                   # of hanging forever (dist.timeout_s bounds each collective)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}       # torchrun's default of 1 starves tokenization and rewards

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PY=${PY:-.venv/bin/python}

srun --kill-on-bad-exit=1 "$PY" -m torch.distributed.run \
    --nnodes="$SLURM_JOB_NUM_NODES" \
    --nproc_per_node=8 \
    --rdzv_backend=c10d \
    --rdzv_endpoint="$HEAD_NODE:$RDZV_PORT" \
    --rdzv_id="$SLURM_JOB_ID" \
    train_grpo.py "$@"
