"""KVPR's token split on the embedded model (float32): the decode side's cache, assembled from the
boundary rows of [0, l), the suffix layers' KV of [l, S) and the prefix layers' KV, equals the
prefill's bit for bit where it was recomputed from a lossless boundary and equals the codec's own
round trip where it was sent; the bytes equal the formula and what the codec encodes; a split off
the block grid or a cut at L is refused naming the field."""

import pytest
import torch

from rekv_core.codecs import get_codec
from rekv_core.handoff.token_split import assemble_split_cache, split_wire_bytes
from rekv_core.model import prefill
from rekv_core.model.executor import embed

SEQ_LEN, CUT = 600, 12


@pytest.fixture(scope="module")
def reference(smollm_fp32):
    ids = torch.randint(1000, 40000, (SEQ_LEN,), generator=torch.Generator().manual_seed(3))
    return ids, prefill(smollm_fp32, ids, boundaries=(0, CUT))


def _sent(codec, out, layers, start):
    """Each layer's K, V for tokens [start, S) after the codec's round trip (None: as they are,
    what a lossless transfer in the working dtype delivers)."""
    rows = [(out.keys[i][:, start:].contiguous(), out.values[i][:, start:].contiguous())
            for i in layers]
    return rows if codec is None else [codec.decode(codec.encode(k, v)) for k, v in rows]


@pytest.mark.parametrize("cut", [0, CUT])
@pytest.mark.parametrize("split", [0, 256, 512, SEQ_LEN])
def test_a_lossless_split_rebuilds_the_prefills_cache_bit_for_bit(smollm_fp32, reference, cut,
                                                                   split):
    model = smollm_fp32
    ids, out = reference
    codec = None
    boundary = embed(model, ids[:split]) if cut == 0 and split else out.hidden[cut][:split]
    cache = assemble_split_cache(model, cut, boundary, _sent(codec, out, range(cut), 0),
                                 _sent(codec, out, range(cut, model.shape.num_layers), split),
                                 SEQ_LEN, SEQ_LEN + 4)
    assert cache.length == SEQ_LEN
    for layer in range(model.shape.num_layers):
        k, v = cache.layer(layer)
        assert torch.equal(k, out.keys[layer]) and torch.equal(v, out.values[layer]), layer


def test_with_int8_the_sent_rows_are_the_codecs_and_the_recomputed_rows_exact(smollm_fp32,
                                                                             reference):
    model = smollm_fp32
    _, out = reference
    codec, split = get_codec("int8"), 256
    prefix = _sent(codec, out, range(CUT), 0)
    suffix = _sent(codec, out, range(CUT, model.shape.num_layers), split)
    cache = assemble_split_cache(model, CUT, out.hidden[CUT][:split], prefix, suffix, SEQ_LEN,
                                 SEQ_LEN)
    for layer in range(CUT):
        assert torch.equal(cache.layer(layer)[0], prefix[layer][0].to(model.dtype))
    for layer in range(CUT, model.shape.num_layers):
        k, v = cache.layer(layer)
        assert torch.equal(k[:, :split], out.keys[layer][:, :split])  # recomputed: exact
        assert torch.equal(v[:, split:], suffix[layer - CUT][1].to(model.dtype))
        assert not torch.equal(k[:, split:], out.keys[layer][:, split:])  # INT8 is lossy


@pytest.mark.parametrize("codec_name", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("cut,split", [(0, 256), (CUT, 0), (CUT, 512), (CUT, SEQ_LEN)])
def test_the_bytes_are_the_formula_and_what_the_codec_encodes(smollm_fp32, reference,
                                                              codec_name, cut, split):
    shape = smollm_fp32.shape
    _, out = reference
    codec = get_codec(codec_name)
    sent = split_wire_bytes(shape, SEQ_LEN, cut, split, codec)
    layer_kv = shape.num_kv_heads * shape.head_dim
    rows = [(i, 0 if i < cut else split) for i in range(shape.num_layers)]
    encoded = sum(sum(codec.encode(out.keys[i][:, start:].contiguous(),
                                   out.values[i][:, start:].contiguous()).layer_bytes())
                  for i, start in rows if start < SEQ_LEN)
    assert sent.prefix + sent.scales == encoded
    assert sent.boundary == (split * shape.hidden_size * 2 if cut else 0)
    assert sent.tokens == (split * 4 if cut == 0 else 0)
    assert sent.head == (shape.hidden_size * 2 if split < SEQ_LEN else 0)
    if codec_name == "bf16":  # the seed-spec's l·d·e + (S − l)·(L − c)·2·n_kv·d_h·e, and the prefix
        rows = (SEQ_LEN - split) * (shape.num_layers - cut) + SEQ_LEN * cut
        assert sent.prefix == rows * 2 * layer_kv * 2


def test_a_split_off_the_grid_or_a_cut_at_l_is_refused(smollm_fp32, reference):
    model = smollm_fp32
    _, out = reference
    L = model.shape.num_layers
    with pytest.raises(ValueError, match="split"):
        split_wire_bytes(model.shape, SEQ_LEN, CUT, 300, get_codec("bf16"))
    with pytest.raises(ValueError, match="cut"):
        split_wire_bytes(model.shape, SEQ_LEN, L, 256, get_codec("bf16"))
    with pytest.raises(ValueError, match="prefix/suffix_rows"):
        assemble_split_cache(model, CUT, out.hidden[CUT][:256], [], [], SEQ_LEN, SEQ_LEN)
