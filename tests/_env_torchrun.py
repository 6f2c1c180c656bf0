"""Run by test_dist.py under `torchrun --nproc_per_node=3`: rank 0 trains, ranks 1 and 2 are generator ranks. Each
rank records the CUDA/NCCL environment at the moment `vllm` is first imported (an import hook; trainers never import
it) and as it enters init_process_group, in train_grpo's start order: dist.get_roles, then vLLM, then the world.

    python -m torch.distributed.run --standalone --nproc_per_node=3 tests/_env_torchrun.py OUT.json
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dist  # noqa: E402

KEYS = ("CUDA_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK")
seen = {"at_vllm_import": None}


def snapshot():
    return {k: v for k, v in os.environ.items() if k in KEYS or k.startswith("NCCL_")}


class RecordVllmImport:  # a meta-path finder that only looks: the real import goes on as usual
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" and seen["at_vllm_import"] is None:
            seen["at_vllm_import"] = snapshot()
        return None


def main():
    sys.meta_path.insert(0, RecordVllmImport())
    roles = dist.get_roles(generator_ranks=2)
    if roles.is_generator:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM  # noqa: F401  the real import: vllm/env_override.py runs here
    seen["at_init"] = snapshot()
    seen["cuda_initialized"] = torch.cuda.is_initialized()
    dist.init_distributed(roles, timeout_s=60)
    ranks = [None] * tdist.get_world_size()
    tdist.all_gather_object(ranks, seen)
    if roles.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(ranks))
    dist.shutdown()


if __name__ == "__main__":
    main()
