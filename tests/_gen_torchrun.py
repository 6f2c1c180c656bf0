"""Run by test_generator.py under `torchrun --nproc_per_node=2`: rank 1 is a dedicated vLLM generator rank,
rank 0 a trainer that broadcasts perturbed weights to it over the world group and checks what comes back.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/_gen_torchrun.py CKPT OUT.json
"""
import json
import os
import sys

import torch
import torch.distributed as dist

GEN_RANK = 1


def main():
    ckpt, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    gen = None
    if rank == GEN_RANK:  # start order: engine first, then drop its private group, then join the world
        from generator import VLLMGenerator
        gen = VLLMGenerator(ckpt, max_model_len=128, kv_cache_memory_bytes=32 << 20, max_num_seqs=16)
        gen.release_default_group()
    dist.init_process_group("gloo")

    # weight sync: names and shapes first, then one broadcast per tensor (dist.py does this bucketed)
    if rank == 0:
        from model import Transformer
        model = Transformer.from_pretrained(ckpt).eval()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.mul_(1.01).add_(0.05 * torch.randn(p.shape, generator=g))
        named = list(model.named_parameters())
        meta = [[(k, tuple(v.shape)) for k, v in named]]
    else:
        meta = [None]
    dist.broadcast_object_list(meta, src=0)
    tensors = [named[i][1].detach() if rank == 0 else torch.empty(shape) for i, (_, shape) in enumerate(meta[0])]
    for t in tensors:
        dist.broadcast(t, src=0)

    prompts = [[5, 17, 33, 2, 9], [100, 3], [42] * 11]
    result = [None]
    if rank == GEN_RANK:
        gen.update_weights(zip([k for k, _ in meta[0]], tensors), version=1)
        greedy = gen.generate(prompts, temperature=0, max_tokens=10, stop_token_ids=[])
        sampled = gen.generate(prompts, n=2, temperature=1.0, max_tokens=10, stop_token_ids=[], seed=0)
        result = [[(c.prompt_ids, c.token_ids, c.logprobs, c.generator_version) for grp in greedy + sampled
                   for c in grp]]
    dist.broadcast_object_list(result, src=GEN_RANK)

    if rank == 0:
        from generator import TorchGenerator
        old = Transformer.from_pretrained(ckpt).eval()

        def gap(m, rows):
            with torch.no_grad():
                diffs = []
                for p, toks, logp, _ in rows:
                    seq = torch.tensor([p + toks])
                    ref = m(seq[:, :-1], targets=seq[:, 1:])[0, len(p) - 1:]
                    diffs.append((torch.tensor(logp) - ref).abs().max().item())
                return max(diffs)
        mine = TorchGenerator(model).generate(prompts, temperature=0, max_tokens=10, stop_token_ids=[])
        rows = result[0]
        with open(out, "w") as f:
            json.dump(dict(gap_new=gap(model, rows), gap_old=gap(old, rows), world_size=dist.get_world_size(),
                           versions=sorted({r[3] for r in rows}),
                           greedy_equal_torch=[g[0].token_ids for g in mine] == [r[1] for r in rows[:3]]), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
