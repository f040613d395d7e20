"""The model fingerprint (`rekv_core.handoff.fingerprint`) and the weights' digest under it: it
changes with one weight, the dtype, the RoPE theta, the tokenizer, the wire format and a codec's
version, is the same across loads, and a file's digest is read back from the model cache, not
computed again, until the file changes. Two builds agree on a fingerprint only if they write
its parts alike: the SHA-256 of their JSON with sorted keys and no spaces."""

import hashlib
from dataclasses import replace

import pytest
import torch

from rekv_core.codecs import BF16Codec
from rekv_core.handoff import fingerprint
from rekv_core.handoff.fingerprint import (fingerprint_of, fingerprint_parts, is_fingerprint,
                                           model_fingerprint)
from rekv_core.model import digest, get_preset, load_weights
from rekv_core.model.conversion_cache import CACHE_ENV
from rekv_core.model.weights import load_hf_checkpoint, synthetic_weights
from rekv_core.model.weights_layout import expected_layer_shapes
from tests.support.checkpoints import save_hf_checkpoint

SHAPE = replace(get_preset("smollm2-135m").with_layers(2), vocab_size=512)


def _weights(seed=0, dtype=torch.float32):
    return synthetic_weights(SHAPE, dtype, seed=seed)


def test_the_same_weights_give_the_same_fingerprint_and_each_part_changes_it(tokenizer,
                                                                             monkeypatch):
    base = model_fingerprint(_weights())
    assert is_fingerprint(base.hex) and len(base.binding) == 32
    assert model_fingerprint(_weights()) == base  # another load of the same weights

    one_weight = _weights()
    one_weight.layers[1].w_down[3, 7] += 1e-3
    rope = _weights()
    rope.shape = replace(SHAPE, rope_theta=SHAPE.rope_theta * 2)
    changed = {
        "one weight": model_fingerprint(one_weight),
        "another seed": model_fingerprint(_weights(seed=1)),
        "dtype": model_fingerprint(_weights(dtype=torch.bfloat16)),
        "rope theta": model_fingerprint(rope),
        "tokenizer": model_fingerprint(_weights(), tokenizer),
    }
    monkeypatch.setattr(fingerprint, "WIRE_FORMAT", fingerprint.WIRE_FORMAT + 1)
    changed["wire format"] = model_fingerprint(_weights())
    monkeypatch.undo()
    monkeypatch.setattr(BF16Codec, "version", BF16Codec.version + 1)
    changed["codec version"] = model_fingerprint(_weights())
    monkeypatch.undo()
    prints = [base.hex, *(f.hex for f in changed.values())]
    assert len(set(prints)) == len(prints), changed
    assert model_fingerprint(_weights()) == base  # the patches are gone


def test_the_digest_covers_every_tensor_and_reads_a_shared_one_once(monkeypatch):
    shared = synthetic_weights(SHAPE, seed=0, shared_layer=True)
    hashed = []
    real = digest._bytes_digest
    monkeypatch.setattr(digest, "_bytes_digest", lambda t: hashed.append(t) or real(t))
    first = digest.weights_digest(shared)
    assert len(hashed) == 2 + len(expected_layer_shapes(SHAPE))
    shared.layers[1] = replace(shared.layers[1], wo=shared.layers[1].wo.clone())
    shared.layers[1].wo[0, 0] += 1.0  # the second layer's copy only
    assert digest.weights_digest(shared) != first


def _no_hashing(*_):
    raise AssertionError("the weights were hashed again")


def test_a_checkpoints_digest_is_read_back_until_the_checkpoint_changes(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    directory = tmp_path / "tiny"
    save_hf_checkpoint(directory, _weights())
    first = load_hf_checkpoint(directory)
    assert first.digest == digest.weights_digest(first)
    with monkeypatch.context() as patch:
        patch.setattr(digest, "weights_digest", _no_hashing)
        assert load_hf_checkpoint(directory).digest == first.digest
    save_hf_checkpoint(directory, _weights(seed=1))  # new weights under the same name
    assert load_hf_checkpoint(directory).digest != first.digest


def test_the_embedded_models_digest_is_kept_in_its_cache_entry(smollm_fp32, monkeypatch):
    """The session's cache holds the embedded model's float32 entry (the `smollm_fp32`
    fixture): loading it again reads the digest from the entry."""
    expected = digest.weights_digest(smollm_fp32.weights)
    monkeypatch.setattr(digest, "weights_digest", _no_hashing)
    assert load_weights("smollm2-135m", torch.float32).digest == expected


def test_the_fingerprint_is_the_sha256_of_its_parts_as_canonical_json():
    assert fingerprint_of({"b": [1, 2], "a": "x"}).hex == hashlib.sha256(
        b'{"a":"x","b":[1,2]}').hexdigest()
    parts = fingerprint_parts(SHAPE, "bfloat16", "0" * 64, "")
    assert set(parts) == {"format", "weights", "shape", "dtype", "tokenizer", "wire",
                          "layer_header", "codecs"}
    assert parts["format"] == "rekv-model-fingerprint-1"


@pytest.mark.parametrize("dtype, name", [(torch.float32, "float32"),
                                         (torch.bfloat16, "bfloat16")])
def test_a_models_fingerprint_names_its_dtype_without_the_module(dtype, name):
    weights = _weights(dtype=dtype)
    assert model_fingerprint(weights).parts == fingerprint_parts(
        SHAPE, name, digest.digest_of(weights), "")


@pytest.mark.parametrize("text, ok", [("ab" * 32, True), ("AB" * 32, False), ("ab" * 31, False),
                                      ("", False), ("zz" * 32, False), ("X" * 64, False)])
def test_the_fingerprints_form(text, ok):
    assert is_fingerprint(text) == ok
