"""dist.py under real torchrun + gloo on CPU. Each test launches tests/_dist_worker.py once (several checks per
launch; a launch costs seconds of imports on 2 cores) and asserts on what the ranks wrote. Oracles: the same model
unsharded on one rank, the trainer's full tensors (bit for bit), a run that never stopped."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import checks
import model as M

WORKER = Path(__file__).resolve().parent / "_dist_worker.py"


def launch(scenario, out, nproc=2, timeout=150, torchrun=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           str(WORKER), scenario, str(out)] if torchrun else [sys.executable, str(WORKER), scenario, str(out)]
    start = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.time() - start


def results(out, scenario, rank):
    return json.loads((Path(out) / f"{scenario}_rank{rank}.json").read_text())


def assert_ok(rc, log):
    # exit codes matter: an unordered teardown shows up as SIGABRT (-6) on one rank after all checks passed
    assert rc == 0, log[-4000:]


@pytest.mark.slow
def test_fsdp_tp_match_one_rank_colocated_sync_and_resume(tmp_path):
    rc, log, _ = launch("trainers2", tmp_path)
    assert_ok(rc, log)
    for rank in (0, 1):
        res = results(tmp_path, "trainers2", rank)
        for name in ("fsdp", "tp", "fsdp_ac"):  # vs one unsharded rank on the whole batch, fp32
            r = res[name]
            assert r["loss"] <= 1e-5 and r["grad_norm"] <= 1e-5, (name, r)
            assert r["grad"] <= 1e-5 and r["param_after_step"] <= 1e-5, (name, r)
            assert r["prefix_loss"] <= 1e-5 and r["prefix_grad"] <= 1e-5, (name, r)  # shared-prompt forward
            assert r["packed_loss"] <= 1e-5 and r["packed_grad"] <= 1e-5, (name, r)  # packed responses
            assert r["tied"] and r["names"], (name, r)  # tie survives sharding; HF names unchanged
        col = res["colocated"]
        assert col["equal"] and "model.embed_tokens.weight" in col["names"]
        assert "lm_head.weight" not in col["names"]  # tied: sent once, as embed_tokens
        assert col["stats"]["sync/bytes"] > 0
        ck = res["ckpt"]
        assert ck["path"] == "step_1" and ck["extra_step"] == 1 and ck["extra_rank"] == rank
        assert ck["rng_equal"]
        assert ck["resume_diff"] == 0.0  # same mesh: bit-exact resume
        assert ck["reshard_tp_diff"] <= 1e-5  # resumed on a TP=2 mesh: DCP resharded params + Adam state
        assert ck["leftovers"] == ["step_1"]  # truncated step_5 (no COMPLETE) and step_7.tmp removed


@pytest.mark.slow
def test_compiled_blocks_match_one_eager_rank(tmp_path):
    """dist.compile: torch.compile'd blocks under FSDP2 and FSDP2 + activation checkpointing
    give the plain, shared-prompt and packed losses and gradients of one eager unsharded rank, keep the HF
    names and the tie; no-grad logprobs agree too, and KV-cache decode (eager) still matches a full forward."""
    rc, log, _ = launch("compiled2", tmp_path, timeout=400)
    assert_ok(rc, log)
    for rank in (0, 1):
        res = results(tmp_path, "compiled2", rank)
        for name in ("fsdp_compiled", "fsdp_ac_compiled"):
            r = res[name]
            assert max(v for k, v in r.items() if k not in ("tied", "names")) <= 1e-5, (name, r)
            assert r["tied"] and r["names"], (name, r)
        assert res["no_grad_packed_False"] <= 1e-5 and res["no_grad_packed_True"] <= 1e-5, res
        assert res["decode"] <= 1e-5 and res["graphs"] >= 2, res  # grad and no-grad graphs at least
        assert res["generate_graphs"] == 0 and res["generate_logp"] <= 1e-5, res


@pytest.mark.slow
@pytest.mark.parametrize("nproc,dp_shard", [(2, 1), (3, 2)])
def test_broadcast_weights_bit_exact(tmp_path, nproc, dp_shard):
    scenario = f"sync{nproc}"
    rc, log, _ = launch(scenario, tmp_path, nproc=nproc)
    assert_ok(rc, log)
    gen = results(tmp_path, scenario, nproc - 1)
    for i in range(2):  # first sync sends metadata, second (after a training step) reuses the cached plan
        want = torch.load(tmp_path / f"sync{dp_shard}_want{i}.pt")
        got = torch.load(tmp_path / f"sync{dp_shard}_got{i}.pt")
        assert got.keys() == want.keys() and "lm_head.weight" in want  # untied: lm_head is sent
        for n in want:
            assert torch.equal(got[n], want[n]), n
        blocks = [n for n in want if n.startswith("model.layers.")]  # then embedding, final norm, lm_head
        assert gen[f"sync{i}"]["names"] == blocks + [n for n in want if n not in blocks]
        sent = sum(t.numel() * t.element_size() for t in want.values())
        stats = results(tmp_path, scenario, 0)[f"sync{i}"]["stats"]
        assert sent <= stats["sync/bytes"] < sent + 64 * len(want)  # only alignment padding on top
        assert gen[f"sync{i}"]["stats"]["sync/bytes"] == stats["sync/bytes"]
    before, after = (torch.load(tmp_path / f"sync{dp_shard}_want{i}.pt") for i in (0, 1))
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the second sync carried new values
    for rank in range(nproc - 1):  # trainers (a subset of the world) vs one unsharded rank
        r = results(tmp_path, scenario, rank)["parity"]
        assert r["loss"] <= 1e-5 and r["grad_norm"] <= 1e-5, r
    if dp_shard == 2:  # trainer subset of a 3-rank world: checkpoint resume and HF export
        for rank in (0, 1):
            ck = results(tmp_path, scenario, rank)["ckpt"]
            assert ck["extra_step"] == 3 and ck["resume_diff"] == 0.0
        exported = M.Transformer.from_pretrained(tmp_path / "hf3")
        want = torch.load(tmp_path / "hf3_want.pt")
        for n, p in exported.named_parameters():
            assert torch.equal(p, want[n]), n


@pytest.mark.parametrize("bucket_bytes", [80_000, 5_000])  # two blocks per bucket; a block (and a tensor) > bucket
def test_bucket_plan_keeps_units_whole(bucket_bytes):
    import weight_sync as W
    cfg = M.ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                        rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                        attention_bias=False, qk_norm=True)
    model, direct_bytes = M.Transformer(cfg), 4096
    params = dict(model.named_parameters())
    plan = W._bucket_plan(model, bucket_bytes, direct_bytes)
    names = [e[0] for _, _, entries in plan for e in entries]
    assert names == [n for n, _ in W._sync_order(model)] and sorted(names) == sorted(params)
    unit = lambda n: n[:n.index(".", 13) + 1] if n.startswith("model.layers.") else "rest"  # noqa: E731
    where = {}
    for i, (size, packed, entries) in enumerate(plan):
        spans = []
        for name, shape, dtype, off in entries:
            n = params[name].numel() * params[name].element_size()
            assert shape == tuple(params[name].shape) and dtype == params[name].dtype
            assert off % 64 == 0 and off + n <= size and (off < packed) == (n < direct_bytes), name
            spans.append((off, off + n))
            where.setdefault(unit(name), set()).add(i)
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
        assert size <= bucket_bytes or len({unit(e[0]) for e in entries}) == 1  # oversize: one unit alone
    assert all(len(b) == 1 for b in where.values()), where  # no unit split across buckets
    assert where["rest"] == {len(plan) - 1}  # embedding, final norm, lm_head: the last bucket
    assert any(off >= packed for _, packed, entries in plan for *_, off in entries)  # some sent directly
    if bucket_bytes == 80_000:
        assert len(plan) == 2 and len(where) == 4  # several units share a bucket
    else:
        assert len(plan) == 4 and params["lm_head.weight"].numel() * 4 > bucket_bytes


@pytest.mark.slow
def test_an_inflight_announcement_is_seen_without_waiting(tmp_path):
    """weight_sync.announce / Announced across two ranks: False before, True after, without a wait
    (a posted gloo receive would have stayed False: its is_completed() needs wait() first), and only
    for the version announced."""
    rc, log, _ = launch("announce2", tmp_path)
    assert_ok(rc, log)
    gen = results(tmp_path, "announce2", 1)
    assert gen == {"before": False, "seen": True, "other_version": False}, gen


@pytest.mark.slow
def test_plain_python_is_a_world_of_one(tmp_path):
    rc, log, _ = launch("world1", tmp_path, torchrun=False, timeout=90)
    assert_ok(rc, log)
    res = results(tmp_path, "world1", 0)
    assert res["roles"] == [0, 1, True, True] and res["equal"] and res["exported_equal"]
    exported = M.Transformer.from_pretrained(tmp_path / "hf1")
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    from safetensors import safe_open
    with safe_open(tmp_path / "hf1" / "model.safetensors", "pt") as f:  # tied: the head is not written twice
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()


@pytest.mark.slow
def test_dead_rank_fails_fast_and_names_it(tmp_path):
    # rank 1 calls os._exit(1) while rank 0 is in an all_reduce: torchrun's agent must stop the survivor and
    # exit non-zero naming rank 1, well within the 10 s process-group timeout (no hang)
    rc, log, wall = launch("die", tmp_path, timeout=60)
    assert rc != 0
    assert "rank      : 1 (local_rank: 1)" in log and "exitcode  : 1" in log, log[-3000:]
    assert wall < 40, wall


@pytest.mark.slow
def test_silent_rank_times_out(tmp_path):
    # rank 1 is alive but never joins the collective: rank 0 gives up after the 5 s group timeout, no hang
    rc, log, wall = launch("hang", tmp_path, timeout=60)
    assert rc != 0
    assert "rank 0: collective gave up after" in log, log[-3000:]
    waited = float(log.split("collective gave up after ")[1].split("s")[0])
    assert 4.0 <= waited < 15, waited


def test_rank_env_pins_engine_ranks_and_sets_nccl_alike_mock_cuda():
    """dist.rank_env, the pure part of get_roles, with made-up environments (the CUDA effect needs a GPU)."""
    import dist as D
    launch = {"NCCL_ASYNC_ERROR_HANDLING": "1"}  # vLLM's Worker.init_device pops it, on its own ranks only
    engine, trainer = D.rank_env(True, 6, launch), D.rank_env(False, 2, launch)
    assert engine["CUDA_VISIBLE_DEVICES"] == "6" and "CUDA_VISIBLE_DEVICES" not in trainer  # trainer: cuda:LOCAL_RANK
    assert D.rank_env(True, 1, {"CUDA_VISIBLE_DEVICES": "4, 5,7"})["CUDA_VISIBLE_DEVICES"] == "5"  # Slurm, a subset
    nccl = lambda env: {k: v for k, v in env.items() if k.startswith("NCCL_")}  # noqa: E731
    assert nccl(engine) == nccl(trainer) == {"NCCL_CUMEM_ENABLE": "0", "NCCL_ASYNC_ERROR_HANDLING": None}
    chosen = {"NCCL_CUMEM_ENABLE": "1"}  # a value set for the whole job is kept, on every rank alike
    assert D.rank_env(True, 0, chosen)["NCCL_CUMEM_ENABLE"] == D.rank_env(False, 0, chosen)["NCCL_CUMEM_ENABLE"] == "1"
    assert engine["PYTORCH_NVML_BASED_CUDA_CHECK"] == trainer["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but CUDA_VISIBLE_DEVICES='0,1' lists 2 GPU"):
        D.rank_env(True, 2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_validate_rejects_more_ranks_than_gpus_mock_cuda(monkeypatch):
    """8 ranks on a node with 4 GPUs would put an engine and a trainer on one GPU. torch.cuda.device_count is faked
    (no GPU here); on CPU (0 GPUs) the check passes."""
    import config
    import dist as D
    import train_grpo
    D.check_gpu_layout(8, 8)
    D.check_gpu_layout(8, 0)
    cfg = train_grpo.parse_config([str(Path(__file__).resolve().parents[1] / "configs" / "gsm8k.py")])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(config.ConfigError, match="dist.generator_ranks=2, world size 8: 8 ranks per node but 4 "
                                                 "visible GPU"):
        checks.grpo(cfg, 8)


@pytest.mark.slow
def test_engine_ranks_env_before_vllm_import_cpu_shows_env_not_cuda_placement(tmp_path):
    """torchrun, 1 trainer + 2 generator ranks, through dist.get_roles and a real `import vllm`. Shows: each
    generator rank's environment at the moment vLLM was imported pins its own GPU (the LOCAL_RANK-th of the job's
    CUDA_VISIBLE_DEVICES), and every rank enters init_process_group with the same NCCL variables. Cannot show (no
    GPU): that CUDA and vLLM then place the engine on that GPU, or how NCCL behaves."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,5,7", "NCCL_ASYNC_ERROR_HANDLING": "1"}
    env.pop("NCCL_CUMEM_ENABLE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--standalone",
           str(WORKER.parent / "_env_torchrun.py"), str(tmp_path / "env.json")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert_ok(p.returncode, p.stdout + p.stderr)
    ranks = json.loads((tmp_path / "env.json").read_text())
    trainer, *gens = ranks
    assert trainer["at_vllm_import"] is None and trainer["at_init"]["CUDA_VISIBLE_DEVICES"] == "3,5,7"
    assert [g["at_vllm_import"]["CUDA_VISIBLE_DEVICES"] for g in gens] == ["5", "7"]
    assert all(g["at_vllm_import"] == g["at_init"] for g in gens)  # importing vLLM changed none of them
    nccl = [{k: v for k, v in r["at_init"].items() if k.startswith("NCCL_")} for r in ranks]
    assert nccl == [{"NCCL_CUMEM_ENABLE": "0"}] * 3  # NCCL_ASYNC_ERROR_HANDLING gone everywhere, not only on vLLM's
    assert not any(r["cuda_initialized"] for r in ranks)
