"""The model cache (`rekv_core.model.conversion_cache`): a GGUF file's weights and tokenizer are
converted once and read back bit-identical, without the file's parser; an entry follows its source
(a changed file gets a new one), an unreadable entry is made again, and a directory that cannot be
written costs only the cache."""

import logging
import os

import gguf
import pytest
import torch

from rekv_core.model import embedded_gguf_path
from rekv_core.model.conversion_cache import CACHE_ENV, cached, entry_path
from rekv_core.model.tokenizer import GGUFTokenizer
from rekv_core.model.weights import load_gguf


def _tensors(weights):
    named = {"embed": weights.embed, "final_norm": weights.final_norm, "lm_head": weights.lm_head}
    for index, layer in enumerate(weights.layers):
        for key in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"):
            named[f"{index}.{key}"] = getattr(layer, key)
    return named


def test_the_embedded_gguf_is_read_back_from_its_entry_bit_identical(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    path = embedded_gguf_path()
    text = "Passkey 30017 <|im_start|>user\nZürich, 東京 🎉 done.<|im_end|>"
    converted_tokenizer = GGUFTokenizer.from_gguf(path)  # converts and writes the entry
    reference = load_gguf(path, torch.bfloat16)  # the same: `convert_gguf`'s result
    names = sorted(p.name for p in tmp_path.iterdir())  # the two entries, no temporary file
    assert len(names) == 2 and names[0].endswith(".json") and names[1].endswith(".safetensors")
    assert names[0].startswith(f"{path.stem}-tokenizer-")
    assert names[1].startswith(f"{path.stem}-weights-bfloat16-")

    def no_parsing(*_):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)
    weights = load_gguf(path, torch.bfloat16)
    tokenizer = GGUFTokenizer.from_gguf(path)
    monkeypatch.undo()

    assert weights.shape == reference.shape and weights.lm_head is weights.embed
    mine, theirs = _tensors(weights), _tensors(reference)
    for name, tensor in theirs.items():
        assert mine[name].dtype == torch.bfloat16 and mine[name].shape == tensor.shape, name
        assert torch.equal(mine[name].view(torch.int16), tensor.view(torch.int16)), name
    assert tokenizer.encode(text) == converted_tokenizer.encode(text)
    assert len(tokenizer.encode(text)) > 10 and tokenizer.decode(tokenizer.encode(text)) == text
    for field in ("eos_token_id", "bos_token_id", "chat_template", "vocab_size"):
        assert getattr(tokenizer, field) == getattr(converted_tokenizer, field), field


class _Conversion:
    """A conversion of a small text file that counts how often it runs."""

    def __init__(self, source):
        self.source, self.runs = source, 0

    def __call__(self):
        self.runs += 1
        return self.source.read_text().upper()

    def get(self):
        return cached(self.source, "upper", ".txt", self, lambda value, entry:
                      entry.write_text(value), self.read)

    @staticmethod
    def read(entry):
        text = entry.read_text()
        if not text.isupper():
            raise ValueError("not an entry of this conversion")
        return text


def test_an_entry_follows_its_source_and_an_unreadable_one_is_made_again(tmp_path, monkeypatch,
                                                                         caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "model.txt"
    source.write_text("first")
    conversion = _Conversion(source)
    assert (conversion.get(), conversion.get(), conversion.runs) == ("FIRST", "FIRST", 1)

    first_entry = entry_path(source, "upper", ".txt")
    source.write_text("second")
    os.utime(source, ns=(0, source.stat().st_mtime_ns + 1_000_000))
    assert entry_path(source, "upper", ".txt") != first_entry
    assert (conversion.get(), conversion.runs) == ("SECOND", 2)  # not the old entry

    assert entry_path(source, "upper", ".txt", made_by="v2") != entry_path(source, "upper", ".txt")
    entry_path(source, "upper", ".txt").write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="rekv.model.conversion_cache"):
        assert (conversion.get(), conversion.runs) == ("SECOND", 3)
    assert "cannot be read" in caplog.text
    assert (conversion.get(), conversion.runs) == ("SECOND", 3)  # the remade entry is read


def test_a_cache_directory_that_cannot_be_written_costs_only_the_cache(tmp_path, monkeypatch,
                                                                      caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    source = tmp_path / "model.txt"
    source.write_text("text")
    conversion = _Conversion(source)
    with caplog.at_level(logging.WARNING, logger="rekv.model.conversion_cache"):
        assert (conversion.get(), conversion.get(), conversion.runs) == ("TEXT", "TEXT", 2)
    assert "converted at every start" in caplog.text


def test_a_write_that_fails_midway_leaves_no_partial_entry(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "model.txt"
    source.write_text("text")

    def half_written(value, entry):
        entry.write_text(value[:2])
        raise RuntimeError("disk full")  # not an OSError, as safetensors' own errors are not

    with caplog.at_level(logging.WARNING, logger="rekv.model.conversion_cache"):
        assert cached(source, "upper", ".txt", lambda: "TEXT", half_written, _Conversion.read
                      ) == "TEXT"
    assert "disk full" in caplog.text
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_missing_source_is_named():
    with pytest.raises(FileNotFoundError, match="GGUF file not found: .*missing.gguf"):
        load_gguf("/nonexistent/missing.gguf")
