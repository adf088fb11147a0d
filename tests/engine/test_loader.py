"""Model resolution and the GGUF conversion cache: valid entries are reused, corrupt or
partial ones are detected and rebuilt."""

from __future__ import annotations

import json

import pytest

from vlite.engine.worker import loader


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("VLITE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls = []

    def fake_convert(src, out):
        calls.append(src)
        (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        (out / "model.safetensors").write_bytes(b"\0" * 1000)

    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    return gguf, calls


def test_conversion_is_cached(fake_gguf):
    gguf, calls = fake_gguf
    first = loader.convert_gguf_cached(gguf)
    second = loader.convert_gguf_cached(gguf)
    assert first == second and len(calls) == 1
    assert loader.cache_entry_is_valid(first)
    assert loader.resolve_model(str(gguf)).path == first


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_manifest", "delete_file"])
def test_corrupt_cache_entry_is_rebuilt(fake_gguf, damage):
    gguf, calls = fake_gguf
    entry = loader.convert_gguf_cached(gguf)
    weights = entry / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(b"\0" * 10)
    elif damage == "flip":
        weights.write_bytes(b"\1" + b"\0" * 999)  # same size, different content
    elif damage == "delete_manifest":
        (entry / loader.MANIFEST).unlink()
    else:
        weights.unlink()
    assert not loader.cache_entry_is_valid(entry)
    rebuilt = loader.convert_gguf_cached(gguf)
    assert len(calls) == 2 and loader.cache_entry_is_valid(rebuilt)
    assert (rebuilt / "model.safetensors").read_bytes() == b"\0" * 1000


def test_failed_conversion_leaves_no_entry(fake_gguf, monkeypatch):
    gguf, _ = fake_gguf

    def broken(src, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(loader, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        loader.convert_gguf_cached(gguf)
    entry = loader.gguf_cache_entry(gguf)
    assert not entry.exists() and list(entry.parent.iterdir()) == []


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(loader.ModelNotFoundError, match="config.json"):
        loader.resolve_model(str(tmp_path))


def test_default_model_resolves_to_a_valid_cache_entry():
    resolved = loader.resolve_model("SmolLM2-135M-Instruct")
    assert resolved.name == "SmolLM2-135M-Instruct"
    assert loader.cache_entry_is_valid(resolved.path)
    assert (resolved.path / "tokenizer.json").is_file()


def test_cache_key_follows_content_not_path(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    copy = tmp_path / "elsewhere" / gguf.name
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    assert loader.convert_gguf_cached(gguf) == loader.convert_gguf_cached(copy) and len(calls) == 1
    copy.write_bytes(b"GGUF other")
    assert loader.gguf_cache_entry(copy) != loader.gguf_cache_entry(gguf)


def test_truncated_gguf_is_a_value_error_and_caches_nothing(tmp_path, monkeypatch):
    """The real converter on a file with a GGUF magic and nothing after it."""
    monkeypatch.setenv("VLITE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "trunc.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="truncated or not a GGUF"):
        loader.convert_gguf_cached(gguf)
    entry = loader.gguf_cache_entry(gguf)
    assert not entry.exists() and list(entry.parent.iterdir()) == []


def test_invalid_config_json_is_a_value_error(tmp_path):
    (tmp_path / "config.json").write_text("{bad")
    with pytest.raises(ValueError, match="cannot read config.json"):
        loader.load_checkpoint(str(tmp_path))
