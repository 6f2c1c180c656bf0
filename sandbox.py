"""The sandbox: run a Python program a policy wrote, contain it, and say what happened.

RL on code executes hundreds of programs a step, written by a policy under pressure to find whatever
the harness lets it do: read the tests, fork until the machine stops, read a token from the
environment. `run()` is the only place in nanoforge where model-written code executes (the `code`
reward, the `python` tool env), never in the trainer's process or with its environment.

    run(code, stdin="", timeout_s=2.0, memory_mb=512, files=None)
        -> Result(stdout, stderr, exit, status, wall_s, ...)
    status: ok | error (non-zero exit) | timeout | memory | output_limit | killed (a signal)

Each run, layer by layer (each layer is there because the one before it can fail):
1. Identity: as root, the program runs as `nobody` (setpriv) and owns none of the machine's files.
2. Namespaces (`unshare`, where the kernel allows unprivileged user namespaces): a new network
   namespace (only a loopback that is down: no socket reaches 127.0.0.1 or anything else), a new PID
   namespace (the program sees only its own processes, so no /proc/<trainer>/environ; when its first
   process exits the kernel kills every other), a new mount namespace where every mount is remounted
   read-only and /tmp, /var/tmp, /dev/shm and $HOME are empty tmpfs; the working directory is a
   fresh tmpfs of `disk_mb`, gone when the run ends.
3. A fresh interpreter in isolated mode (`python -I`: no PYTHON* variables, no user site, no script
   dir on sys.path) with a minimal environment (PATH, LANG; nothing inherited: no tokens, no proxy,
   no HOME secrets).
4. `resource` limits: CPU seconds, address space, file size, open files, processes (counted per
   namespace).
5. Its own session and process group, killed as a whole at `timeout_s`; stdout and stderr read with
   a cap each (the rest drained and dropped, `truncated` set).
`isolation()` reports which layers this machine gave; where the namespaces are refused, layer 2 is
missing and the Result says so (the network and the user's own files are then reachable). What a
program can still read: the world-readable files of the system, the Python install and the
repository's source (read-only).

Concurrency is the caller's: the reward pool (`rollout.reward_workers`) runs that many at a time;
`run_many` is a bounded thread pool for batch callers and the benchmark. Left out: seccomp filters,
cgroup memory accounting (the address-space limit is per process), GPU access control, a container
image.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--mount", "--fork",
           "--kill-child", "--mount-proc"]
# root of the user namespace may mount and unmount in it: its capabilities go before the program
# starts
DROP = [shutil.which("setpriv", path=ENV["PATH"]) or "setpriv", "--bounding-set=-all",
        "--inh-caps=-all", "--no-new-privs",
        "--securebits=+noroot,+noroot_locked,+no_setuid_fixup,+no_setuid_fixup_locked"]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@dataclass
class Result:
    stdout: str
    stderr: str
    exit: int | None                 # the exit code, -signal when killed by one, None when it never
    #                                  started
    status: str                      # one of STATUSES
    wall_s: float
    truncated: bool = False          # output past the cap was dropped
    isolation: dict = field(default_factory=dict)


# Runs first in the sandbox, as root of the new user namespace: mounts, limits, then exec of the
# program. It never sees the trainer's environment (ENV only) and gets its settings as one JSON
# argument.
LAUNCHER = r"""
import ctypes, json, os, resource, sys
a = json.loads(sys.argv[1])
if a["ns"]:
    libc = ctypes.CDLL(None, use_errno=True)
    def mount(src, dst, fs, flags, data=""):
        if libc.mount(src.encode(), dst.encode(), fs.encode(), flags, data.encode()) != 0:
            raise OSError(ctypes.get_errno(), f"mount {dst}")
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
    FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024,
             "nodiratime": 2048, "relatime": 1 << 21}
    for line in open("/proc/self/mountinfo").read().splitlines():
        f = line.split()
        # locked flags must be kept in a user namespace
        keep = sum(FLAGS.get(o, 0) for o in f[5].split(","))
        try:
            mount("none", f[4].replace("\\040", " "), "", MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError:
            # a mount under a hidden path, or one the kernel will not remount: the tmpfs below still
            # cover
            pass
    for d in a["hide"]:
        if os.path.isdir(d):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    mount("tmpfs", a["cwd"], "tmpfs", MS_NOSUID | MS_NODEV, f"size={a['disk_mb']}m,mode=1777")
os.chdir(a["cwd"])
for name, text in a["files"].items():
    with open(name, "w") as fh:
        fh.write(text)
for r, v in a["limits"].items():
    resource.setrlimit(getattr(resource, r), (v, v))
os.execve(a["argv"][0], a["argv"], a["env"])
"""


def _wrap(cmd, ns):
    return (NOBODY if os.geteuid() == 0 else []) + (UNSHARE if ns else []) + cmd


PROBE = ("import socket, sys\nprint(sys.prefix)\ntry:\n"
         " socket.create_connection(('127.0.0.1', 9), 1)\n"
         "except OSError as e:\n print(e.errno)")


@lru_cache(maxsize=1)
def isolation() -> dict:
    """What this machine gives, probed once through run() itself: the interpreter (the trainer's
    where the sandbox user can run it, else the system's), the identity, and whether the namespaces
    hold (a connect to loopback fails with ENETUNREACH: no route at all)."""
    uid = "nobody" if os.geteuid() == 0 else "same user"
    system = shutil.which("python3", path=ENV["PATH"])
    # the prefix shows it ran what we named
    for python, prefix in ((sys.executable, sys.prefix), (system, None)):
        got = python and run(PROBE, timeout_s=10,
                             iso={"python": python, "fs": False}).stdout.split()
        if got and prefix in (None, got[0]):
            break
    else:
        raise RuntimeError("sandbox: no Python interpreter that the sandbox user can run")
    ns = run(PROBE, timeout_s=10, iso={"python": python, "fs": True}).stdout.split()[-1:] == ["101"]
    return {"python": python, "uid": uid, "net": ns, "pid": ns, "fs": ns}


def _reader(pipe, cap, out):
    """Read up to `cap` bytes, then drain and drop the rest (a full pipe would stall the program,
    not end it)."""
    buf, n = bytearray(), 0
    while chunk := pipe.read(65536):
        n += len(chunk)
        if len(buf) < cap:
            buf += chunk[:cap - len(buf)]
    out.extend([bytes(buf), n > cap])


def _feed(pipe, data):
    try:
        pipe.write(data)
        pipe.close()
    except OSError:
        pass  # the program closed its stdin or is gone already


def run(code, stdin="", timeout_s=2.0, memory_mb=512, files=None, max_output=64_000, max_procs=16,
        max_file_mb=16, disk_mb=64, max_open=64, iso=None) -> Result:
    """Run `code` as main.py in a fresh sandbox (the module docstring); `files`: {name: text} beside
    it."""
    iso = iso or isolation()
    py = os.path.realpath(iso["python"])  # the directories above the interpreter stay visible
    hide = [d for d in ("/var/tmp", "/dev/shm", os.path.expanduser("~"))
            if not py.startswith(d.rstrip("/") + "/")]
    # no mount namespace: a real directory
    stage = None if iso["fs"] else tempfile.mkdtemp(prefix="nf_sandbox_")
    if stage and os.geteuid() == 0:
        os.chown(stage, 65534, 65534)
    argv = [iso["python"], "-I", "-X", "utf8", "main.py"]
    args = {"argv": (DROP if iso["fs"] else []) + argv, "ns": iso["fs"], "disk_mb": disk_mb,
            "hide": hide,
            # in the namespace the tmpfs over /tmp is the working directory
            "cwd": stage or "/tmp", "env": ENV,
            "files": {**(files or {}), "main.py": code},
            "limits": {"RLIMIT_CPU": int(timeout_s) + 1, "RLIMIT_AS": memory_mb << 20,
                       "RLIMIT_FSIZE": max_file_mb << 20, "RLIMIT_NOFILE": max_open,
                       "RLIMIT_NPROC": max_procs, "RLIMIT_CORE": 0}}
    t0, outs, errs = time.monotonic(), [], []
    try:
        p = subprocess.Popen(_wrap([iso["python"], "-I", "-c", LAUNCHER, json.dumps(args)],
                                   iso["fs"]),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=ENV, cwd="/", start_new_session=True)
    except OSError as e:
        if stage:
            shutil.rmtree(stage, ignore_errors=True)
        return Result("", f"sandbox: could not start: {e}", None, "error", 0.0, isolation=iso)
    readers = [threading.Thread(target=_reader, args=(s, max_output, o), daemon=True)
               for s, o in ((p.stdout, outs), (p.stderr, errs))]
    for t in [*readers,
              threading.Thread(target=_feed, args=(p.stdin, stdin.encode()), daemon=True)]:
        # in threads: a program that reads no stdin, or writes without end, cannot stall this one
        t.start()
    timed_out = False
    try:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
    finally:  # also on the reward guard's timeout: nothing outlives the call
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        for t in readers:
            t.join(timeout=5)
        if stage:
            shutil.rmtree(stage, ignore_errors=True)
    wall = time.monotonic() - t0
    (out, cut_o), (err, cut_e) = (outs or [b"", False]), (errs or [b"", False])
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    return Result(stdout, stderr, p.returncode,
                  _status(p.returncode, stderr, timed_out, cut_o or cut_e), wall,
                  cut_o or cut_e, iso)


def _status(rc, stderr, timed_out, truncated):
    if timed_out or rc == -signal.SIGXCPU:
        return "timeout"
    if "MemoryError" in stderr[-2000:]:
        return "memory"
    if truncated or rc == -signal.SIGXFSZ or "File too large" in stderr[-2000:]:
        return "output_limit"
    if rc is not None and rc < 0 or rc == 128 + signal.SIGKILL:
        return "killed"
    return "ok" if rc == 0 else "error"


def run_many(jobs, workers=2, **limits) -> list[Result]:
    """Run [(code, stdin)] `workers` at a time, never more; results in order."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        return list(ex.map(lambda job: run(job[0], job[1], **limits), jobs))


# The tests' side of a code reward: the program never sees the expected outputs, only the inputs it
# is called with (on stdin); the parent compares. A program that prints a fake result line would
# have to know the answers.
HARNESS = r"""
import json, sys
job = json.loads(sys.stdin.read())
ns = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
out = []
for args in job["inputs"]:
    try:
        out.append(json.loads(json.dumps(ns[job["fn"]](*args))))
    except BaseException as e:
        out.append({"raised": type(e).__name__})
print("\n" + job["mark"] + json.dumps(out))
"""
MARK = "@@nanoforge-results@@"


def call_tests(code, fn, inputs, **limits) -> tuple[list | None, Result]:
    """Define `code` in the sandbox and call fn(*args) for each args of `inputs`: (outputs or None,
    Result)."""
    r = run(HARNESS, json.dumps({"fn": fn, "inputs": inputs, "mark": MARK}),
            files={"solution.py": code}, **limits)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(MARK)]
    try:
        got = json.loads(lines[-1][len(MARK):]) if lines else None
    except ValueError:
        got = None
    return (got if isinstance(got, list) and len(got) == len(inputs) else None), r
