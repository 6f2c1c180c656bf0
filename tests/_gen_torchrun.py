"""Run by test_generator.py under `torchrun --nproc_per_node=2`: rank 1 is a dedicated vLLM generator rank,
rank 0 a trainer that syncs perturbed weights to it through weight_sync.broadcast_weights and checks what comes back.

Tiny buckets (0.05 MB, smaller than one decoder block and than the biggest tensors) and a low direct-send threshold
make the sync use many buckets, both buffers several times, packed and directly sent tensors; two rounds, the second
with the cached plan. vLLM's layerwise reload buffers views until a whole layer arrived, so a bucket buffer reused
too early shows up here as wrong logprobs.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/_gen_torchrun.py CKPT OUT.json
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dist  # noqa: E402
import weight_sync  # noqa: E402

BUCKET_MB, ROUNDS = 0.05, 2


def main():
    ckpt, out = sys.argv[1], sys.argv[2]
    roles = dist.get_roles(generator_ranks=1)
    gen = None
    if roles.is_generator:  # start order: engine first, then drop its private group, then join the world
        from generator import VLLMGenerator
        gen = VLLMGenerator(ckpt, max_model_len=128, kv_cache_memory_bytes=32 << 20, max_num_seqs=16)
        gen.release_default_group()
    dist.init_distributed(roles, timeout_s=120)
    group = weight_sync.sync_group(roles)
    weight_sync._DIRECT_BYTES = 100_000  # NOTE: private knob; 64 KiB attention matrices packed, 196 KB MLP/embedding direct

    prompts = [[5, 17, 33, 2, 9], [100, 3], [42] * 11]
    model, snapshots, rows = None, [], []
    if roles.is_trainer:
        from model import Transformer
        model = Transformer.from_pretrained(ckpt).eval()
        g = torch.Generator().manual_seed(0)
    for version in range(1, ROUNDS + 1):
        if roles.is_trainer:
            with torch.no_grad():
                for _, p in model.named_parameters():
                    p.mul_(1.01).add_(0.05 * torch.randn(p.shape, generator=g))
            snapshots.append({k: v.detach().clone() for k, v in model.named_parameters()})
        receive = (lambda named: gen.update_weights(named, version)) if gen else None
        stats = weight_sync.broadcast_weights(model, group, roles, BUCKET_MB, receive=receive)
        result = [None]
        if gen:
            greedy = gen.generate(prompts, temperature=0, max_tokens=10, stop_token_ids=[])
            sampled = gen.generate(prompts, n=2, temperature=1.0, max_tokens=10, stop_token_ids=[], seed=0)
            result = [[(c.prompt_ids, c.token_ids, c.logprobs, c.generator_version) for grp in greedy + sampled
                       for c in grp]]
        tdist.broadcast_object_list(result, src=roles.generator_ranks[0], group=group)
        rows.append(result[0])

    if roles.is_trainer:
        from generator import TorchGenerator
        from model import Transformer
        old = Transformer.from_pretrained(ckpt).eval()

        def gap(m, rows):
            with torch.no_grad():
                diffs = []
                for p, toks, logp, _ in rows:
                    seq = torch.tensor([p + toks])
                    ref = m(seq[:, :-1], targets=seq[:, 1:])[0, len(p) - 1:]
                    diffs.append((torch.tensor(logp) - ref).abs().max().item())
                return max(diffs)
        gaps_new = []
        for snap, r in zip(snapshots, rows):  # each round against the weights that were sent in it
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(snap[k])
            gaps_new.append(gap(model, r))
        mine = TorchGenerator(model).generate(prompts, temperature=0, max_tokens=10, stop_token_ids=[])
        plan = weight_sync._SYNC_PLANS[group]
        with open(out, "w") as f:
            json.dump(dict(gaps_new=gaps_new, gap_old=gap(old, rows[-1]), world_size=tdist.get_world_size(),
                           versions=[sorted({r[3] for r in rs}) for rs in rows],
                           greedy_equal_torch=[g[0].token_ids for g in mine] == [r[1] for r in rows[-1][:3]],
                           num_buckets=len(plan), direct=sum(off >= b[1] for b in plan for *_, off in b[2]),
                           packed=sum(off < b[1] for b in plan for *_, off in b[2]), sync_bytes=stats["sync/bytes"]),
                      f)
    dist.shutdown()


if __name__ == "__main__":
    main()
