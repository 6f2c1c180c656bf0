"""rollout.py's pure parts: the data order (a function of seed and step alone) and the sync/eval schedule that a
dedicated generator rank and the trainers must agree on; the backend that "auto" picks."""
from types import SimpleNamespace

import pytest
import torch

import rollout
from generator import TorchGenerator


def test_step_prompts_is_a_permutation_per_epoch_and_a_function_of_seed_and_step():
    train = list(range(10))
    B = 3  # 3 steps per epoch, the last item of each epoch's permutation unused
    epoch0 = [p for s in range(3) for p in rollout.step_prompts(train, s, B, seed=1)]
    assert len(epoch0) == len(set(epoch0)) == 9  # no repeats within an epoch
    assert rollout.step_prompts(train, 4, B, seed=1) == rollout.step_prompts(list(train), 4, B, seed=1)  # resume
    assert epoch0 != [p for s in range(3, 6) for p in rollout.step_prompts(train, s, B, seed=1)]  # new epoch order
    assert epoch0 != [p for s in range(3) for p in rollout.step_prompts(train, s, B, seed=2)]  # seed matters


def test_every_eval_sees_fresh_weights():
    cfg = SimpleNamespace(dist=SimpleNamespace(sync_interval=3), eval=SimpleNamespace(every=5),
                          train=SimpleNamespace(steps=12))
    syncs = [s for s in range(12) if rollout.sync_due(s, cfg)]
    evals = [s for s in range(12) if rollout.eval_due(s, cfg)]
    assert evals == [4, 9, 11]  # every 5 steps and after the last
    assert syncs == [2, 4, 5, 8, 9, 11]  # every 3 steps, and before each eval
    cfg.eval.every = 0
    assert [s for s in range(12) if rollout.eval_due(s, cfg)] == [11]  # the final eval always runs


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU 'auto' is vLLM")
def test_auto_backend_is_the_torch_generator_on_cpu(tiny_ckpt):
    for generator_ranks in (0, 1):  # colocated, and a dedicated rank with a small model and short generations
        cfg = SimpleNamespace(train=SimpleNamespace(seed=0), rollout=SimpleNamespace(backend="auto", max_tokens=40),
                              dist=SimpleNamespace(generator_ranks=generator_ranks))
        gen = rollout.build_generator(cfg, tiny_ckpt, max_model_len=64)
        assert isinstance(gen, TorchGenerator)
