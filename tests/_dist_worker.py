"""Worker for tests/test_dist.py: `torchrun --nproc_per_node=N tests/_dist_worker.py <scenario> <out_dir>`.
One launch runs several checks (a launch costs seconds of imports on 2 cores) and every rank writes its numbers to
<out_dir>/<scenario>_rank<r>.json (tensors to .pt files) for the test to assert on. The single-rank oracle is the
same tiny model, unsharded, on the whole batch, computed inside each rank."""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint as C  # noqa: E402
import dist as D  # noqa: E402
import kvcache  # noqa: E402
import weight_sync as W  # noqa: E402
import model as M  # noqa: E402
import packing  # noqa: E402


def tiny_cfg(model_type="qwen2", tie=True):
    return M.ModelConfig(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                         tie_word_embeddings=tie, attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")


def make_model(cfg, seed):
    torch.manual_seed(seed)
    return M.Transformer(cfg)


def batch(seed, B=4, T=13):
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(seed))


def nll(m, ids):  # ids (B, T): mean next-token NLL over the rows this rank holds
    return -m(ids[:, :-1], targets=ids[:, 1:]).mean()


def shared_prompts(ids, P):  # rows 2i and 2i+1 share their first P tokens: a GRPO group of 2
    ids = ids.clone()
    ids[1::2, :P] = ids[0::2, :P]
    return ids


def prefix_nll(m, ids, P):  # mean NLL of the tokens after the prompt, each prompt run once (model.SharedPrefix)
    attn, first = torch.ones_like(ids), torch.arange(0, len(ids), 2)
    logp = m(ids[:, P - 1:-1], attention_mask=attn[:, :-1], targets=ids[:, P:],
             prefix=(ids[first, :P - 1], attn[first, :P - 1], torch.arange(len(ids)) // 2))
    return -logp.mean()


def packed_batch(seed, P=6):
    """8 rows in groups of 2 (shared prompts), responses of lengths that pack across prompts on every mesh."""
    ids = batch(seed, B=8, T=13)
    ids[1::2, :P] = ids[0::2, :P]
    attn = torch.ones_like(ids)
    for i, n in enumerate([7, 3, 4, 2, 5, 1, 6, 2]):
        attn[i, P + n:] = 0
    return dict(ids=ids, attn=attn, P=P, prompt=torch.arange(8) // 2)


def packed_nll(m, b, rows, packed, scale):  # -sum of the rows' response logprobs * scale (packing.response_logp)
    return -packing.response_logp(m, b, rows, 1.0, packed=packed).sum() * scale


def full(t):  # a copy: on a 1-rank mesh full_tensor() returns the live local tensor
    return (t.full_tensor() if isinstance(t, D.DTensor) else t).clone()


def full_params(m):
    return {n: full(p.detach()) for n, p in m.named_parameters()}


def max_diff(a: dict, b: dict):
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train_step(m, opt, ids, mesh):
    """One AdamW step on this rank's slice of the batch (dp ranks split the rows, TP ranks share them)."""
    dp = mesh["dp_shard"]
    rows = ids.chunk(dp.size())[dp.get_local_rank()]
    loss = nll(m, rows)
    loss.backward()
    norm = D.clip_grad_norm_(m, 1.0)
    opt.step()
    opt.zero_grad()
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=dp.get_group())  # mean of equal-sized slices = loss of the whole batch
    return loss.item() / dp.size(), norm.item()


def against_one_rank(roles, cfg, variants):
    """Each (name, dp, tp, activation checkpointing, compile) mesh against one unsharded rank on the whole batch: the
    plain, shared-prompt and packed forwards, their gradients, one SGD step. -> ({name: diffs}, the last model)."""
    res = {}
    ids = batch(1)
    ref = make_model(cfg, 0)
    ref_loss = nll(ref, ids)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()  # SGD: Adam's g/|g| amplifies 1e-8 noise in ~0 grads
    ref_after = full_params(ref)
    # the shared-prompt forward under each mesh, against the plain forward of one unsharded rank
    P, pids, pref = 6, shared_prompts(ids, 6), make_model(cfg, 0)
    ref_prefix_loss = -pref(pids[:, :-1], targets=pids[:, 1:])[:, P - 1:].mean()
    ref_prefix_loss.backward()
    ref_prefix_grads = {n: p.grad.clone() for n, p in pref.named_parameters()}
    # the packed update (packing.py) under each mesh, against the padded rows on one unsharded rank
    pb, pk = packed_batch(2), make_model(cfg, 0)
    n_real = int(pb["attn"][:, pb["P"]:].sum())
    ref_packed_loss = packed_nll(pk, pb, slice(0, 8), False, 1 / n_real)
    ref_packed_loss.backward()
    ref_packed_grads = {n: p.grad.clone() for n, p in pk.named_parameters()}
    for name, dp, tp, ac, compiled in variants:
        mesh = D.trainer_mesh(roles, dp, tp)
        m = D.shard_model(make_model(cfg, 0), mesh, activation_checkpointing=ac, compile=compiled)
        rows = ids.chunk(dp)[mesh["dp_shard"].get_local_rank()]
        loss = nll(m, rows)
        loss.backward()
        grads = {n: full(p.grad) for n, p in m.named_parameters()}
        norm = D.clip_grad_norm_(m, 1.0).item()
        torch.optim.SGD(m.parameters(), lr=0.5).step()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=mesh["dp_shard"].get_group())
        pm = D.shard_model(make_model(cfg, 0), mesh, activation_checkpointing=ac, compile=compiled)
        prefix_loss = prefix_nll(pm, pids.chunk(dp)[mesh["dp_shard"].get_local_rank()], P)  # pairs stay whole
        prefix_loss.backward()
        prefix_loss = prefix_loss.detach().clone()
        dist.all_reduce(prefix_loss, group=mesh["dp_shard"].get_group())
        km = D.shard_model(make_model(cfg, 0), mesh, activation_checkpointing=ac, compile=compiled)
        r = mesh["dp_shard"].get_local_rank()
        # FSDP averages grads over dp ranks: each rank's share of the sum, times dp
        packed_loss = packed_nll(km, pb, slice(r * 8 // dp, (r + 1) * 8 // dp), True, dp / n_real)
        packed_loss.backward()
        packed_loss = packed_loss.detach().clone()
        dist.all_reduce(packed_loss, group=mesh["dp_shard"].get_group())
        res[name] = {"loss": abs(loss.item() / dp - ref_loss.item()), "grad_norm": abs(norm - ref_norm),
                     "grad": max_diff(grads, ref_grads), "param_after_step": max_diff(full_params(m), ref_after),
                     "prefix_loss": abs(prefix_loss.item() / dp - ref_prefix_loss.item()),
                     "prefix_grad": max_diff({n: full(p.grad) for n, p in pm.named_parameters()}, ref_prefix_grads),
                     "packed_loss": abs(packed_loss.item() / dp - ref_packed_loss.item()),
                     "packed_grad": max_diff({n: full(p.grad) for n, p in km.named_parameters()}, ref_packed_grads),
                     "tied": m.lm_head.weight is m.model.embed_tokens.weight,
                     "names": sorted(n for n, _ in m.named_parameters()) == sorted(ref_after)}
    return res, m


def trainers2(roles, out):
    """World 2, two trainer ranks: FSDP, TP, FSDP + activation checkpointing vs one rank; colocated sync; resume."""
    cfg = tiny_cfg("qwen2", tie=True)
    res, m = against_one_rank(roles, cfg, [("fsdp", 2, 1, False, False), ("tp", 1, 2, False, False),
                                           ("fsdp_ac", 2, 1, True, False)])

    # colocated sync: no generator ranks, each trainer hands full tensors to its own in-process receiver
    recv_model, got = make_model(cfg, 7), []
    recv = dict(recv_model.named_parameters())

    @torch.no_grad()
    def receive(named):
        for n, t in named:
            got.append(n)
            recv[n].copy_(t)
    stats = W.broadcast_weights(m, None, roles, receive=receive)
    res["colocated"] = {"equal": all(torch.equal(recv[n], t) for n, t in full_params(m).items()),
                        "names": got, "stats": stats}

    # checkpoint: save at step 1, run step 2; then resume into a fresh model + optimizer and redo step 2
    ckpt = Path(out) / "ckpt2"
    mesh = D.trainer_mesh(roles, 2, 1)
    m = D.shard_model(make_model(cfg, 0), mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train_step(m, opt, batch(1), mesh)
    torch.manual_seed(1000 + roles.rank)
    C.save_checkpoint(ckpt, 1, m, opt, {"step": 1, "rank": roles.rank, "rng": torch.get_rng_state()})
    draw = torch.rand(3)
    train_step(m, opt, batch(2), mesh)
    want = full_params(m)
    if roles.rank == 0:  # a newer save that crashed mid-write (no COMPLETE), and a stray temp dir
        (ckpt / "step_5").mkdir()
        (ckpt / "step_5" / ".metadata").write_text("truncated")
        (ckpt / "step_7.tmp").mkdir()
    dist.barrier()
    path = C.latest_checkpoint(ckpt)
    m2 = D.shard_model(make_model(cfg, 123), mesh)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    extra = C.load_checkpoint(path, m2, opt2)
    train_step(m2, opt2, batch(2), mesh)
    dist.barrier()
    res["ckpt"] = {"path": path.name, "extra_step": extra["step"], "extra_rank": extra["rank"],
                   "rng_equal": torch.equal(draw, _draw_after(extra)),
                   "resume_diff": max_diff(full_params(m2), want),
                   "leftovers": sorted(p.name for p in ckpt.iterdir())}
    # resume the same checkpoint on another mesh (TP=2): DCP reshards model and optimizer state
    mesh_tp = D.trainer_mesh(roles, 1, 2)
    m3 = D.shard_model(make_model(cfg, 321), mesh_tp)
    opt3 = torch.optim.AdamW(m3.parameters(), lr=1e-2)
    C.load_checkpoint(path, m3, opt3)
    train_step(m3, opt3, batch(2), mesh_tp)
    res["ckpt"]["reshard_tp_diff"] = max_diff(full_params(m3), want)
    return res


def compiled2(roles, out):
    """World 2: dist.compile's blocks (torch.compile) against one eager unsharded rank, as trainers2
    checks the eager meshes, plus no-grad logprobs (the reference model's and the old policy's pass) and a KV-cache
    decode, which stays eager."""
    cfg = tiny_cfg("qwen2", tie=True)
    res, _ = against_one_rank(roles, cfg, [("fsdp_compiled", 2, 1, False, True),
                                           ("fsdp_ac_compiled", 2, 1, True, True)])
    pb, ref = packed_batch(3), make_model(cfg, 0)
    m = D.shard_model(make_model(cfg, 0), D.trainer_mesh(roles, 2, 1), compile=True)
    with torch.no_grad():
        for packed in (False, True):
            want = packing.response_logp(ref, pb, slice(0, 8), 1.0, packed=packed)
            got = packing.response_logp(m, pb, slice(0, 8), 1.0, packed=packed)
            res[f"no_grad_packed_{packed}"] = (got - want).abs().max().item()
        cache, ids = kvcache.KVCache(cfg, 2, 16, torch.float32, "cpu"), batch(4, B=2, T=6)
        with torch.compiler.set_stance("force_eager"):  # as the torch generator decodes
            m(ids[:, :5], kv_cache=cache)
            step = m(ids[:, 5:], kv_cache=cache, cache_pos=5)[:, -1]
        res["decode"] = (step - ref(ids)[:, -1]).abs().max().item()
    res["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # compiling happened
    import generator  # the torch generator on the compiled blocks: eager, the trainer's logprobs
    out = generator.TorchGenerator(m, max_model_len=32).generate(
        ids[:, :4].tolist(), n=2, max_tokens=6, stop_token_ids=[], seed=0)
    res["generate_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - res["graphs"]
    gaps = []
    with torch.no_grad():  # model.py's logp of each sampled token, as tests/test_generator.py's
        for c in (c for g in out for c in g):
            s = torch.tensor([c.prompt_ids + c.token_ids])
            want = ref(s[:, :-1], targets=s[:, 1:])[0, len(c.prompt_ids) - 1:]
            gaps.append((torch.tensor(c.logprobs) - want).abs().max().item())
    res["generate_logp"] = max(gaps)
    return res


def _draw_after(extra):
    torch.set_rng_state(extra["rng"])
    return torch.rand(3)


def sync(roles, out, dp_shard):
    """1 trainer + 1 generator (world 2) or 2 FSDP trainers + 1 generator (world 3): bit-exact broadcast,
    twice (the second with cached metadata, after a training step); world 3 also checkpoints and exports."""
    res, cfg = {}, tiny_cfg("qwen3", tie=False)
    W._DIRECT_BYTES = 4096  # NOTE: private knob; the 4 KiB+ matrices go straight from (full) parameters, k/v packed
    mesh = D.trainer_mesh(roles, dp_shard, 1)
    group = W.sync_group(roles)
    if roles.is_trainer:
        ref = make_model(cfg, 0)  # oracle for the first step: one unsharded rank on the whole batch
        ref_loss = nll(ref, batch(0))
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
        m = D.shard_model(make_model(cfg, 0), mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    else:
        m, recv_model = None, make_model(cfg, 99)
        recv = dict(recv_model.named_parameters())
    for i in range(2):
        got = []

        @torch.no_grad()
        def receive(named):
            for n, t in named:
                got.append(n)
                recv[n].copy_(t)
        stats = W.broadcast_weights(m, group, roles, bucket_mb=0.02, receive=receive)  # several buckets
        res[f"sync{i}"] = {"stats": stats, "names": got}
        if roles.is_trainer:
            want = full_params(m)  # collective on trainers
            if roles.rank == 0:
                torch.save(want, Path(out) / f"sync{dp_shard}_want{i}.pt")
            loss, norm = train_step(m, opt, batch(i), mesh)
            if i == 0:
                res["parity"] = {"loss": abs(loss - ref_loss.item()), "grad_norm": abs(norm - ref_norm)}
        else:
            torch.save({n: t.clone() for n, t in recv.items()}, Path(out) / f"sync{dp_shard}_got{i}.pt")
    if roles.is_trainer and dp_shard == 2:  # trainer subset of a world with a generator: checkpoint + export
        ckpt = Path(out) / "ckpt3"
        C.save_checkpoint(ckpt, 3, m, opt, {"step": 3})
        train_step(m, opt, batch(5), mesh)
        want = full_params(m)
        m2 = D.shard_model(make_model(cfg, 5), mesh)
        opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        extra = C.load_checkpoint(C.latest_checkpoint(ckpt), m2, opt2)
        train_step(m2, opt2, batch(5), mesh)
        res["ckpt"] = {"extra_step": extra["step"], "resume_diff": max_diff(full_params(m2), want)}
        C.export_hf(m2, Path(out) / "hf3")
        exported = full_params(m2)  # collective on trainers
        if roles.rank == 0:
            torch.save(exported, Path(out) / "hf3_want.pt")
    return res


def die(roles, out):
    """Rank 1 dies after a first collective; rank 0 is in an all_reduce when it happens."""
    t = torch.ones(1)
    dist.all_reduce(t)
    if roles.rank == 1:
        time.sleep(0.5)
        os._exit(1)
    start = time.time()
    try:
        for _ in range(1000):
            dist.all_reduce(t)
            time.sleep(0.01)
    finally:
        print(f"rank 0: survivor stopped after {time.time() - start:.1f}s", flush=True)
    return {}


def hang(roles, out):
    """Rank 1 stays alive but never joins the next collective: rank 0 must time out (no hang)."""
    if roles.rank == 1:
        time.sleep(60)
        return {}
    start = time.time()
    try:
        dist.all_reduce(torch.ones(1))
    finally:
        print(f"rank 0: collective gave up after {time.time() - start:.1f}s", flush=True)
    return {}


def announce2(roles, out):
    """1 trainer + 1 generator rank: the generator's non-blocking check sees an in-flight update's
    announcement only once the trainer has made it, and without waiting for it."""
    flag = W.Announced(3, timeout_s=10)
    dist.barrier()
    before = flag.arrived() if roles.is_generator else None
    dist.barrier()
    if roles.is_trainer:
        W.announce(roles, 3)
    dist.barrier()
    seen, start = False, time.time()
    while roles.is_generator and not seen and time.time() - start < 5:
        seen = flag.arrived()
    return {"before": before, "seen": seen, "other_version": W.Announced(4, timeout_s=10).arrived()}


def world1(roles, out):
    """Plain `python` (no torchrun): a world of one, colocated, through the same calls."""
    cfg = tiny_cfg("llama", tie=True)
    mesh = D.trainer_mesh(roles, 1, 1)
    m = D.shard_model(make_model(cfg, 0), mesh)
    recv_model = make_model(cfg, 1)
    recv = dict(recv_model.named_parameters())

    @torch.no_grad()
    def receive(named):
        for n, t in named:
            recv[n].copy_(t)
    stats = W.broadcast_weights(m, W.sync_group(roles), roles, receive=receive)
    C.export_hf(m, Path(out) / "hf1")
    want = full_params(m)
    exported = dict(M.Transformer.from_pretrained(Path(out) / "hf1").named_parameters())
    return {"equal": all(torch.equal(recv[n], t) for n, t in want.items()), "stats": stats,
            "exported_equal": exported.keys() == want.keys() and all(torch.equal(exported[n], want[n]) for n in want),
            "roles": [roles.rank, roles.world_size, roles.colocated, roles.is_trainer]}


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    generator_ranks = {"sync2": 1, "sync3": 1, "announce2": 1}.get(scenario, 0)
    timeout_s = {"die": 10, "hang": 5}.get(scenario, 120)
    roles = D.get_roles(generator_ranks)
    D.init_distributed(roles, timeout_s=timeout_s)
    fn = {"trainers2": trainers2, "compiled2": compiled2, "sync2": lambda r, o: sync(r, o, 1), "sync3": lambda r, o: sync(r, o, 2),
          "die": die, "hang": hang, "world1": world1, "announce2": announce2}[scenario]
    res = fn(roles, out)
    with open(Path(out) / f"{scenario}_rank{roles.rank}.json", "w") as f:
        json.dump(res, f, indent=1)
    D.shutdown()


if __name__ == "__main__":
    main()
