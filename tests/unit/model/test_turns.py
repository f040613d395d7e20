"""Prefill-like work in turns (`rekv_core.model.turns`): whatever the allowances, the K, V and
logits equal one unchunked run's, bit for bit on the CPU; the pieces it cuts; and the context each
turn asks with (the keys its rows attend to on average, which the engine sizes the turn by)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from rekv_core.model import KVCache, prefill, run_layers
from rekv_core.model.blocks import EXEC_BLOCK
from rekv_core.model.executor import embed
from rekv_core.model.layer import final_logits
from rekv_core.model.turns import Turn, piece, prefill_in_turns, run_layers_in_turns
from tests.support.engine_fakes import tiny_model


class RandomTurns:
    """Grants turns of random allowances (some below the smallest piece), counting them."""

    def __init__(self, seed: int):
        self.rng, self.count, self.contexts = random.Random(seed), 0, []

    @contextlib.contextmanager
    def turn(self, context: int = 0):
        self.count += 1
        self.contexts.append(context)
        yield Turn(allowance=self.rng.choice([0, 1, 100, 300, 700, 2000, 10**6]))


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=4)


def _cache(model, capacity):
    s = model.shape
    return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity, model.dtype)


@pytest.mark.parametrize("seq_len, seed", [(40, 0), (600, 1), (1100, 2)])
def test_a_prefill_in_turns_is_bit_identical_to_the_whole(model, seq_len, seed):
    ids = [random.Random(seed).randrange(model.shape.vocab_size) for _ in range(seq_len)]
    whole = prefill(model, ids, boundaries=())
    turns = RandomTurns(seed)
    cache = _cache(model, seq_len + 4)
    logits = prefill_in_turns(model, ids, cache, turns)
    assert torch.equal(logits, whole.logits) and cache.length == seq_len
    for layer in range(model.shape.num_layers):
        k, v = cache.layer(layer)
        assert torch.equal(k, whole.keys[layer]) and torch.equal(v, whole.values[layer])
    assert turns.count >= 1 and all(c >= 0 for c in turns.contexts)


def test_a_suffix_in_turns_equals_run_layers_from_the_boundary(model):
    ids = [i % model.shape.vocab_size for i in range(600)]
    cut = 2
    h_c = prefill(model, ids, boundaries=(cut,)).hidden[cut]
    whole = run_layers(model, h_c, cut)
    cache = _cache(model, 610)
    h = run_layers_in_turns(model, h_c, cut, model.shape.num_layers, 0, cache, RandomTurns(5))
    for index, layer in enumerate(range(cut, model.shape.num_layers)):
        assert torch.equal(cache.layer(layer, 600)[0], whole.keys[index])
    assert torch.equal(final_logits(model, h[-1]), whole.logits)


def test_prefill_in_turns_up_to_a_cut_writes_only_those_layers(model):
    ids = [i % model.shape.vocab_size for i in range(5, 305)]
    cache = _cache(model, 300)
    h = prefill_in_turns(model, ids, cache, RandomTurns(3), stop=2)
    whole = prefill(model, ids, boundaries=(2,))
    assert torch.equal(h, whole.hidden[2])
    assert torch.equal(cache.layer(1, 300)[0], whole.keys[1])
    assert not cache.keys[2].any() and cache.length == 0


class FixedTurns:
    """Grants every turn the same allowance, recording (context, spent) of each."""

    def __init__(self, allowance: int):
        self.allowance, self.granted = allowance, []

    @contextlib.contextmanager
    def turn(self, context: int = 0):
        turn = Turn(allowance=self.allowance)
        yield turn
        self.granted.append((context, turn.spent))


def test_each_turn_asks_with_the_keys_its_rows_attend_to_on_average(model):
    """A suffix of 2 blocks + 88 rows after a block of cached positions, one block through one
    layer a turn: each turn's context is the position of its first row plus half its rows, the
    rows before `pos` counted; the first turn of a run of rows, which has not chosen its rows yet,
    counts all that are left. The tail then takes 3 layers in one turn, its last layer in
    another."""
    prefix, tail, block, L = EXEC_BLOCK, 88, EXEC_BLOCK, model.shape.num_layers
    n = 2 * block + tail
    ids = [i % model.shape.vocab_size for i in range(prefix + n)]
    cache = _cache(model, prefix + n)
    prefill_in_turns(model, ids[:prefix], cache)
    turns = FixedTurns(allowance=block + tail // 2)  # one block, or the tail through 3 layers
    h = embed(model, ids[prefix:])
    run_layers_in_turns(model, h, 0, L, prefix, cache, turns)
    tail_layers = (block + tail // 2) // tail
    assert L == 4 and tail_layers == 3
    assert turns.granted == [
        (prefix + n // 2, block), *[(prefix + block // 2, block)] * (L - 1),
        (prefix + block + (n - block) // 2, block),
        *[(prefix + block + block // 2, block)] * (L - 1),
        (prefix + 2 * block + tail // 2, tail * tail_layers),
        (prefix + 2 * block + tail // 2, tail * (L - tail_layers))]


def test_pieces_take_whole_blocks_of_rows_or_all_and_at_least_one_layer():
    assert piece(100, 30, 0) == (100, 1)  # below a block: all its rows, one layer
    assert piece(100, 30, 1000) == (100, 10)
    assert piece(1000, 30, 5000) == (1000, 5)
    assert piece(1000, 30, 600) == (2 * EXEC_BLOCK, 1)  # whole blocks through one layer
    assert piece(1000, 30, 10) == (EXEC_BLOCK, 1)  # the smallest piece runs regardless
    assert piece(300, 3, 10**6) == (300, 3)
    with pytest.raises(ValueError, match="nothing left"):
        piece(0, 3, 10)
