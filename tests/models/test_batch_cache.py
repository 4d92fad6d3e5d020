"""The batch KV cache: rows at their own lengths behind one write pointer, holes masked out.

Reference: the single-sequence PreallocatedCache driven by the same model. A row of the batch
must give the same logits as that sequence alone, whatever rejections and row moves happened
around it."""

from __future__ import annotations

import pytest
import torch

from specdec.models import LoadedModel, ModelRunner
from specdec.models.batch_cache import BatchCache

ATOL = 1e-4


def _prefilled(tiny_model: LoadedModel, prompt: list[int]):
    runner = ModelRunner(tiny_model)
    cache = runner.new_cache(64)
    runner.forward(cache, prompt)
    return runner, cache


def _batch_forward(loaded: LoadedModel, cache: BatchCache, tokens: list[list[int]]) -> torch.Tensor:
    new = len(tokens[0])
    positions, mask = cache.step_inputs(new)
    return loaded.backend.forward(cache, torch.tensor(tokens), positions, mask).logits  # [rows, new, vocab]


def test_rows_match_single_sequences(tiny_any: LoadedModel) -> None:
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    cache = BatchCache.for_backend(tiny_any.backend, max_rows=4, capacity=64)
    singles = []
    for prompt in prompts:
        runner, single = _prefilled(tiny_any, prompt)
        cache.insert_row(single)
        singles.append((runner, single))
    assert cache.lengths[:2].tolist() == [5, 3] and cache.longest == 5
    # Step 1: row 0 keeps 1 of 3 new slots, row 1 keeps all 3; the single caches do the same.
    with torch.inference_mode():
        _batch_forward(tiny_any, cache, [[20, 21, 22], [30, 31, 32]])
        cache.commit(3, torch.tensor([1, 3]))
        singles[0][0].forward(singles[0][1], [20])
        singles[1][0].forward(singles[1][1], [30, 31, 32])
        assert cache.lengths[:2].tolist() == [6, 6]
        # Each row holds its sequence's keys in order, as the single cache does: no holes.
        for row, (_, single) in enumerate(singles):
            torch.testing.assert_close(cache.layers[0].key_buf[row, :, :6], single.layers[0].keys[0], atol=ATOL, rtol=0)
        # Step 2: both rows continue; logits must match each sequence run alone.
        batch_logits = _batch_forward(tiny_any, cache, [[40, 41], [50, 51]])
        alone = [singles[0][0].forward(singles[0][1], [40, 41]).logits, singles[1][0].forward(singles[1][1], [50, 51]).logits]
    for row in range(2):
        torch.testing.assert_close(batch_logits[row], alone[row], atol=ATOL, rtol=0)


def test_native_rows_are_bitwise_single_sequences(default_model: LoadedModel) -> None:
    # On the native backend a row's logits are bitwise its sequence's alone (per-query attention
    # over the row's own prefix; row-invariant int4/int8 kernels): greedy batching is lossless.
    prompts = [default_model.tokenizer(t)["input_ids"] for t in ("The capital of France is", "One, two, three, four")]
    cache = BatchCache.for_backend(default_model.backend, max_rows=2, capacity=64)
    singles = []
    for prompt in prompts:
        runner, single = _prefilled(default_model, prompt)
        cache.insert_row(single)
        singles.append((runner, single))
    with torch.inference_mode():
        _batch_forward(default_model, cache, [[11, 12, 13], [14, 15, 16]])
        cache.commit(3, torch.tensor([2, 0]))
        singles[0][0].forward(singles[0][1], [11, 12])
        batch_logits = _batch_forward(default_model, cache, [[21, 22], [23, 24]])
        alone = [singles[0][0].forward(singles[0][1], [21, 22]).logits, singles[1][0].forward(singles[1][1], [23, 24]).logits]
    for row in range(2):
        assert torch.equal(batch_logits[row], alone[row])


def test_remove_moves_the_last_row_and_what_it_attends_to(tiny_any: LoadedModel) -> None:
    cache = BatchCache.for_backend(tiny_any.backend, max_rows=3, capacity=64)
    for prompt in ([1, 2, 3, 4], [5, 6], [7, 8, 9]):
        cache.insert_row(_prefilled(tiny_any, prompt)[1])
    with torch.inference_mode():
        _batch_forward(tiny_any, cache, [[11, 12], [13, 14], [15, 16]])
        cache.commit(2, torch.tensor([1, 2, 0]))
        probe = [[21], [22], [23]]
        before = _batch_forward(tiny_any, cache, probe)
        cache.commit(1, torch.tensor([0, 0, 0]))  # forget the probe
        assert cache.lengths[:3].tolist() == [5, 4, 3]
        # Removing row 0 moves row 2 into its place; row 2's logits follow it.
        assert cache.remove_row(0) == 2
        assert cache.rows == 2 and cache.lengths[:3].tolist() == [3, 4, 0]
        moved = _batch_forward(tiny_any, cache, [[23], [22]])
    torch.testing.assert_close(moved[0], before[2], atol=ATOL, rtol=0)
    torch.testing.assert_close(moved[1], before[1], atol=ATOL, rtol=0)


def test_commit_and_insert_check_their_arguments(tiny_any: LoadedModel) -> None:
    cache = BatchCache.for_backend(tiny_any.backend, max_rows=1, capacity=8)
    cache.insert_row(_prefilled(tiny_any, [1, 2])[1])
    with pytest.raises(ValueError, match="batch cache is full"):
        cache.insert_row(_prefilled(tiny_any, [3])[1])
    with pytest.raises(ValueError, match="keep must be"):
        cache.commit(2, torch.tensor([3]))
    for bad in ([3], [-1], [1, 1], [1.0]):
        with pytest.raises(ValueError, match="keep must be"):
            cache.commit(2, bad)
    with pytest.raises(ValueError, match="no active row"):
        cache.remove_row(1)


def test_prefix_counts_are_what_the_steps_mask_shows(tiny_native: LoadedModel) -> None:
    from specdec.models.native import visible_slots

    cache = BatchCache.for_backend(tiny_native.backend, max_rows=2, capacity=16)
    cache.insert_row(_prefilled(tiny_native, [1, 2, 3])[1])
    cache.insert_row(_prefilled(tiny_native, [4, 5])[1])
    positions, mask = cache.step_inputs(3)
    counts = cache.prefix_counts(mask)
    assert counts is not None and torch.equal(counts, visible_slots(mask, 0, 3, long_blocks=True).counts)
    assert cache.prefix_counts(mask.clone()) is None  # only the mask it made
    # A tree changes the mask: its nodes see their ancestors only, no longer a prefix.
    cache.tree_inputs(positions, mask, 0, [1, 1], torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))
    assert cache.prefix_counts(mask) is None
    _, mask = cache.step_inputs(1)
    cache.commit(1, [1, 1])
    assert cache.prefix_counts(mask) is None  # a step's mask, not the next one's


def test_bytes_per_token_counts_keys_and_values_of_every_layer(tiny_any: LoadedModel) -> None:
    config = tiny_any.config
    head_dim = config.hidden_size // config.num_attention_heads
    expected = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert tiny_any.backend.kv_bytes_per_token() == expected
    assert tiny_any.backend.kv_bytes_per_token([0]) == expected // config.num_hidden_layers
