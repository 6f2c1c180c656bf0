"""The sandbox (sandbox.py) against hostile programs, the code reward against the task's own reference solutions,
the python tool env, and GRPO with both (colocated and with a vLLM rank).

Every hostile program is bounded by itself (a few dozen children, a few GB), so a sandbox that failed could not take
the machine down; network cases target only 127.0.0.1, on a port this test listens on. After each: the status it
was reported with, nothing it spawned still running, nothing it wrote outside its directory, no secret in its
output. Where the machine refuses the namespaces (sandbox.isolation()), the cases that need them say so and check
that the Result reports it, instead of passing vacuously."""
import json
import os
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import envs
import rewards
import sandbox
import tasks
from test_episodes import COLOCATED, check_episode_rows, rows_of
from test_train_grpo import run

ROOT = Path(__file__).resolve().parents[1]
LINGER = "31.7"  # children of hostile programs sleep this long: a process with it in its command line leaked
ISO = sandbox.isolation()


def leaked():
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if LINGER in ln and "ps -eo" not in ln]


def contained(code, status, timeout_s=None, **kw):
    # a run that must end otherwise than by its time limit gets a generous one: on a busy
    # machine a sandboxed interpreter's start alone has taken over 2 s
    timeout_s = timeout_s or (2.0 if status == "timeout" else 20.0)
    r = sandbox.run(code, timeout_s=timeout_s, memory_mb=256, **kw)
    assert r.status == status, (r.status, r.exit, r.stderr[-800:])
    assert r.wall_s < timeout_s + 3, r.wall_s  # killed at the limit, never waited on past it
    time.sleep(0.05)
    assert not leaked()
    return r


def test_limits_time_memory_output_and_exit_codes():
    assert contained("print('hi')", "ok").stdout == "hi\n"
    assert contained("while True: pass", "timeout", timeout_s=1.0).wall_s >= 1.0
    contained("import time; time.sleep(60)", "timeout", timeout_s=1.0)
    contained("x = bytearray(10 * 256 << 20)", "memory")  # 10x the cap
    r = contained("open('big', 'wb').write(b'0' * (200 << 20))", "output_limit")  # past the 16 MB file cap
    assert "File too large" in r.stderr
    r = contained("import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))", "output_limit")  # 100 MB
    assert r.truncated and len(r.stdout) == 64_000
    contained("import os; os.close(1); os.close(2); print('gone')", "error")
    assert contained("print(len(input()))", "ok", stdin="x" * 300_000 + "\n").stdout == "300000\n"
    contained("import time; time.sleep(60)", "timeout", timeout_s=1.0, stdin="y" * 10_000_000)  # never read
    assert contained("import ctypes; ctypes.string_at(0)", "killed").exit == -11  # a C-level crash
    contained("import os, signal; os.killpg(0, signal.SIGKILL)", "killed")
    for code, exit_ in (("raise SystemExit(3)", 3), ("import sys; sys.exit(-1)", 255), ("import sys; sys.exit(300)", 44),
                        ("import sys; sys.exit('bye')", 1)):
        assert contained(code, "error").exit == exit_


def test_processes_are_bounded_and_none_outlives_the_run():
    # a fork bomb bounded at 2**6 processes by itself; the sandbox allows 16 (per namespace)
    r = contained(f"import os, time\nfor _ in range(6):\n    try: os.fork()\n    except OSError: print('refused', flush=True)\n"
                  f"time.sleep({LINGER})", "timeout", timeout_s=1.5)
    assert "refused" in r.stdout or not ISO["pid"]
    # children in their own session, the parent gone: the PID namespace takes them with it
    code = (f"import subprocess\nfor _ in range(3):\n    subprocess.Popen(['sleep', '{LINGER}'], start_new_session=True)\n"
            "print('spawned')")
    if ISO["pid"]:
        assert contained(code, "ok").stdout == "spawned\n"
    else:
        pytest.skip("no PID namespace on this machine: a child in its own session outlives the run (README)")


def test_environment_filesystem_and_network_are_isolated(tmp_path, monkeypatch):
    secret = f"nf-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SECRET", secret)  # in this process's environment, and in the first one of a live process
    holder = subprocess.Popen(["sleep", "30"], env={**os.environ, "SECRET": secret})
    victims = [ROOT / "tests" / f"_victim_{uuid.uuid4().hex}", tmp_path / "victim"]
    for v in victims:
        v.write_text("keep")
    targets = [ROOT / "evil.txt", tmp_path / "evil.txt", Path(tempfile.gettempdir()) / "evil.txt",
               Path.home() / "evil.txt"]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    try:
        code = f"""
import glob, os, socket
print(sorted(os.listdir('.')))
print(sorted(os.environ.items()))
for f in glob.glob('/proc/*/environ') + ['/proc/{holder.pid}/environ', '/proc/{os.getpid()}/environ']:
    try: print(open(f, 'rb').read())
    except OSError as e: print(f, e)
for t in {[str(t) for t in targets]!r}:
    try: open(t, 'w').write('x'); print('wrote', t)
    except OSError as e: print(t, e)
for v in {[str(v) for v in victims]!r}:
    try: os.remove(v); print('removed', v)
    except OSError as e: print(v, e)
for _ in range(3):
    try: socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), 1); print('connected')
    except OSError as e: print('refused', e.errno)
"""
        r = contained(code, "ok")
        out = r.stdout + r.stderr
        assert secret not in out and "SECRET" not in out
        assert out.startswith("['main.py']")  # a fresh, empty working directory
        if ISO["fs"]:  # /tmp and $HOME are the run's own throwaway tmpfs: what it wrote there is gone with it
            assert f"wrote {targets[0]}" not in out and f"wrote {targets[1]}" not in out and "removed" not in out
            assert all(not t.exists() for t in targets) and all(v.read_text() == "keep" for v in victims)
        if ISO["net"]:
            assert out.count("refused 101") == 3 and "connected" not in out  # ENETUNREACH: not even loopback
            with pytest.raises(BlockingIOError):
                server.accept()
        else:
            assert r.isolation["net"] is False  # reported, not claimed
    finally:
        holder.kill()
        server.close()
        for p in [*victims, *targets]:
            p.unlink(missing_ok=True) if p.parent in (ROOT, ROOT / "tests", tmp_path) else None
    assert not list(Path(tempfile.gettempdir()).glob("nf_sandbox_*"))  # no temp directory left behind


def test_pool_runs_at_most_workers_at_a_time():
    t0 = time.monotonic()
    rs = sandbox.run_many([("import time; time.sleep(1); print(7)", "")] * 4, workers=2, timeout_s=5)
    wall = time.monotonic() - t0
    assert [r.stdout for r in rs] == ["7\n"] * 4
    assert 2.0 <= wall < 4.0, wall  # two at a time: two rounds of 1 s, not one, not four


# ---- the code reward and the embedded task ------------------------------------------------------------------------
def test_code_reward_scores_reference_solutions_and_never_shows_the_tests():
    problems = tasks.make_code(60, seed=3)  # the task's own properties: tests/test_tasks.py
    # a generous time limit: the reference solutions take milliseconds, but on a busy machine
    # starting a sandboxed interpreter alone has taken over the reward's default 1 s (0 on timeout)
    full, frac = rewards.CodeReward(mode="all", timeout_s=30.0), rewards.CodeReward(timeout_s=30.0)
    assert [full("", p["solution"], p["target"]) for p in problems] == [1.0] * 60  # the reference lambdas agree
    p = next(q for q in problems if "times x plus" in q["question"])
    wrong = "```python\ndef f(x):\n    return 0\n```"
    assert frac("", wrong, p["target"]) < 1 and full("", wrong, p["target"]) == 0.0
    assert frac("", "no code at all", p["target"]) == 0.0
    fake = f"```python\nprint('{sandbox.MARK}' + '[1, 2, 3, 4]')\nimport os; os._exit(0)\n```"
    assert frac("", fake, p["target"]) == 0.0  # a forged result line must still be right
    tests = json.loads(p["target"])["tests"]
    got, r = sandbox.call_tests("import os\ndef f(x):\n    return [sorted(os.listdir('.')), open('main.py').read()]",
                                "f", [args for args, _ in tests])
    assert got[0] == [["main.py", "solution.py"], sandbox.HARNESS]  # the harness holds no expected output


def test_python_env_runs_calls_in_the_sandbox():
    env = envs.Python({"question": "What is 6 * 7?", "target": "42"}, timeout_s=1.0)
    assert env.reset()[0]["role"] == "system"
    step = env.step("Let me compute. <python>print(6 * 7)</python>")
    assert not step.done and step.messages == [{"role": "user", "content": "<output>42\n</output>"}]
    step = env.step("<python>while True: pass</python>")
    assert step.messages[0]["content"].endswith("(timeout)") and step.info["sandbox"] == "timeout"
    step = env.step("<python>print('x' * 10000)</python>")
    assert len(step.messages[0]["content"]) < 450
    assert env.step("The answer is 42.").done


@pytest.mark.slow
def test_grpo_on_the_code_task_with_the_code_reward_and_the_python_tool(tmp_path, tiny_ckpt):
    """Two steps colocated and two with a vLLM rank: a random model's replies run as code (fenced=False, tag="") in
    the reward (B*G programs a step) and, where a reply ends before max_tokens, in the env."""
    code = ["--data.name=code", "--rollout.accuracy=code", "--rollout.rewards={'code': {'fenced': False}}",
            "--rollout.env={'name': 'python', 'tag': ''}", "--rollout.env_timeout_s=3", "--rollout.max_turns=2",
            "--train.steps=2"]
    run([f"--model.path={tiny_ckpt}", *COLOCATED[:-1], *code, "--log.run=colo"], tmp_path, nproc=0)
    run([f"--model.path={tiny_ckpt}", *COLOCATED[2:-1], *code, "--log.run=rank"], tmp_path)
    for name in ("colo", "rank"):
        rows = rows_of(tmp_path / name)
        check_episode_rows(rows)
        assert sum(r["episode/tool_calls"] for r in rows) > 0
        for r in rows:
            assert r["episode/error_frac"] == 0 and r["rewards/code_errors"] == 0 and r["rewards/code_timeouts"] == 0
            assert 0 <= r["rollout/accuracy"] <= 1
