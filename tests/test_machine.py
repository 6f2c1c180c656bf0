"""machine.py: the dtype rule as a pure function of the probe's figures, the probe's cost, the thread budget as a
pure function of the cores, and what a process applies (in a subprocess: torch's thread count is per process).
The 2-rank check of the budget, under torchrun with a vLLM rank, is in tests/test_train_grpo.py."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import checks
import config
import machine
import train_grpo
from conftest import ROOT


def test_dtype_rule_from_the_probe_figures():
    assert machine.choose_dtype("cuda")[0] == "bfloat16"
    # an AVX-512 BF16 CPU, then an AVX2-only one (docs/machines.md#the-boxes)
    assert machine.choose_dtype("cpu", 170.0, 370.0)[0] == "bfloat16"
    dtype, why = machine.choose_dtype("cpu", 131.0, 0.30)
    assert dtype == "float32" and "0.3 vs fp32 131.0" in why
    assert machine.choose_dtype("cpu", 100.0, 100.0 * machine.BF16_MIN_SPEEDUP)[0] == "bfloat16"  # the edge: bf16
    assert machine.choose_dtype("cpu", 100.0, 120.0)[0] == "float32"  # faster, but not enough to pay the mismatch
    assert machine.choose_dtype("cpu", 0.0, 0.0)[0] == "float32"


def test_probe_is_cheap_and_resolve_only_touches_auto(capsys):
    t0 = time.perf_counter()
    p = machine.probe_dtype()
    assert time.perf_counter() - t0 < 0.5 and p["float32"] > 0 and p["bfloat16"] > 0, p
    threads = torch.get_num_threads()
    cfg = train_grpo.parse_config(["--model.dtype=auto"])
    machine.resolve_dtype(cfg)
    assert cfg.model.dtype in ("float32", "bfloat16") and torch.get_num_threads() == threads
    assert f"model.dtype=auto -> {cfg.model.dtype}: " in capsys.readouterr().out  # says what and why
    cfg = train_grpo.parse_config(["--model.dtype=auto"])
    machine.resolve_dtype(cfg, say=False)  # a rank other than 0: it measures and chooses, silently
    assert cfg.model.dtype in ("float32", "bfloat16") and capsys.readouterr().out == ""
    cfg = SimpleNamespace(model=SimpleNamespace(dtype="float32"))
    machine.resolve_dtype(cfg)
    assert cfg.model.dtype == "float32" and capsys.readouterr().out == ""


def test_dtype_values_are_checked():
    with pytest.raises(config.ConfigError, match="model.dtype='fp16' must be float32, bfloat16 or auto"):
        checks.grpo(train_grpo.parse_config(["--model.dtype=fp16"]), 1)


def test_thread_budget_never_exceeds_the_cores():
    for cores in (1, 2, 3, 8, 64, [2, 3, 5, 7]):
        ids = set(range(cores)) if isinstance(cores, int) else set(cores)
        for procs in (1, 2, 3, 8, 9):
            shares = [machine.thread_budget(cores, procs, r) for r in range(procs)]
            assert all(shares) and all(set(s) <= ids for s in shares)
            if procs <= len(ids):  # disjoint, and together exactly the cores: nothing idle, nothing shared
                assert sorted(c for s in shares for c in s) == sorted(ids), (cores, procs, shares)
            else:  # one core each: the least a process can have
                assert all(len(s) == 1 for s in shares)
    assert [machine.thread_budget(8, 3, r) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_a_process_applies_its_share():
    code = ("import os, torch, machine\nfor r in range(2):\n    os.environ['LOCAL_RANK'] = str(r)\n"
            "    mine = machine.set_threads(rank=r)\n"
            "    print(mine, torch.get_num_threads(), os.environ['VLLM_CPU_OMP_THREADS_BIND'])")
    cores = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "THP_MEM_ALLOC_ENABLE")}
    for cap in ("", "1"):  # the budget alone; then capped, as torchrun's default or a side-by-side run sets it
        extra = {"OMP_NUM_THREADS": cap} if cap else {}
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra, "LOCAL_WORLD_SIZE": "2",
                             "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        for rank in range(2):
            mine = machine.thread_budget(cores, 2, rank)[:int(cap) if cap else None]
            assert lines[2 * rank] == f"threads: rank {rank} takes {len(mine)} of {len(cores)} cores (cpus {mine}; " \
                                      f"2 process(es) on this node{', OMP_NUM_THREADS=1' if cap else ''}); " \
                                      f"THP_MEM_ALLOC_ENABLE=1 (kernel THP: {machine.thp_mode()})"
            assert lines[2 * rank + 1] == f"{mine} {len(mine)} {','.join(map(str, mine))}"
    assert machine.omp_cap({"OMP_NUM_THREADS": "4,2"}) == 4 and machine.omp_cap({"OMP_NUM_THREADS": "x"}) == 0


def test_make_test_workers_split_the_cores():
    """make test's two pytest-xdist workers (tests/conftest.py) each keep their own half of the cores, so the ranks
    their tests start size their threads to that half. A child first widens its affinity to every core: under make
    test this test itself runs on one (the kernel keeps only the cores this machine lets it have)."""
    code = (f"import os; os.sched_setaffinity(0, range({os.cpu_count()})); print(sorted(os.sched_getaffinity(0)))\n"
            "import conftest; print(sorted(os.sched_getaffinity(0)))")
    seen = {}
    for worker in ("gw0", "gw1"):
        env = {**os.environ, "PYTEST_XDIST_WORKER_COUNT": "2", "PYTEST_XDIST_WORKER": worker}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", env=env, capture_output=True,
                             text=True, check=True).stdout
        cpus, seen[worker] = map(json.loads, out.splitlines()[-2:])
    if len(cpus) < 2:
        pytest.skip("one core: make test runs the suite in one process")
    half = len(cpus) // 2
    assert seen == {"gw0": cpus[:half], "gw1": cpus[half:]}, (cpus, seen)


def test_start_up_turns_on_huge_pages_and_they_cut_page_faults():
    """Importing machine (every trainer and bench/ script does, before its first tensor) sets THP_MEM_ALLOC_ENABLE,
    and set_threads logs it: 5 copies of a 200 MB tensor then fault in ~1/500 of the 4 KB pages they did without it
    (measured here: ~246k faults against ~3k). An explicit THP_MEM_ALLOC_ENABLE=0 is respected and says so."""
    if machine.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"this kernel's transparent huge pages are {machine.thp_mode()!r}: the hint cannot take effect")
    code = ("import resource, torch, machine\nx = torch.randn(1024, 49152)\n"  # importing machine is enough
            "f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\nfor _ in range(5):\n    x.clone()\n"
            "n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0\nmachine.set_threads()\nprint(n)")
    faults = {}
    for env in ({}, {"THP_MEM_ALLOC_ENABLE": "0"}):
        base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        log, n, value = *out.stdout.splitlines(), env.get("THP_MEM_ALLOC_ENABLE", "1")
        assert log.endswith(f"; THP_MEM_ALLOC_ENABLE={value} (kernel THP: {machine.thp_mode()})"), log
        faults[value] = int(n)
    assert faults["0"] > 5 * 200e6 / 4096 / 2 and faults["1"] < faults["0"] / 20, faults


def test_roofline_records_the_machine():
    r = machine.roofline([(16, 64, 128)])
    json.dumps(r)  # goes into bench/results/*.json as is
    assert r["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and r["cores"] >= 1
    assert r["read_gbps"] > 0 and r["fp32_gflops"] > 0 and r["fp32_gflops_16x64x128"] > 0
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "model name" in cpuinfo:  # the CPU by name, and whether it has AMX (both say "AVX512" to torch)
        assert r["cpu_model"] and r["cpu_model"] in cpuinfo
        assert ("amx_bf16" in r["cpu_flags"]) == (" amx_bf16" in cpuinfo)
    assert r["auto_dtype"] in ("float32", "bfloat16")
    # bf16 is timed only where the probe found a hardware path (else a 2048^3 matmul takes ~60 s)
    has_path = r["dtype_probe"]["bfloat16"] >= r["dtype_probe"]["float32"] / 4
    assert r["dtype_probe"]["bf16_path"] == has_path and ("bf16_gflops" in r) == has_path
