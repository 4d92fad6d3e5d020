"""PreallocatedCache through ModelRunner: rollback moves a length and reallocates nothing, and
every cached forward equals the plain transformers forward over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from specdec.models import LoadedModel, ModelRunner, PreallocatedCache
from specdec.models.cache import ContextOverflowError

TOKENS = [17, 905, 331, 42, 42, 7, 120, 1023, 256, 9, 88, 496, 31, 5, 600]


def reference_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: the model without any cache, over the whole sequence at once."""
    if loaded.model is None:  # native: one pass into a fresh cache
        return ModelRunner(loaded).forward(PreallocatedCache(loaded.num_layers, len(tokens)), tokens).logits
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


def buffer_pointers(cache: PreallocatedCache) -> list[tuple[int, int]]:
    return [(layer._key_buf.data_ptr(), layer._value_buf.data_ptr()) for layer in cache.layers]


def test_new_cache_is_empty_and_sized(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    cache = runner.new_cache(40)
    assert cache.length == 0
    assert len(cache.layers) == tiny_model.num_layers
    runner.forward(cache, TOKENS[:5])
    assert cache.length == 5
    assert cache.get_seq_length() == 5
    for layer in cache.layers:
        assert layer._key_buf.shape[2] == 40 and layer._value_buf.shape[2] == 40


def test_rollback_moves_the_length_without_reallocating(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    cache = runner.new_cache(32)
    runner.forward(cache, TOKENS[:10])
    pointers = buffer_pointers(cache)
    runner.forward(cache, TOKENS[10:14])
    assert cache.length == 14
    cache.rollback(11)
    assert cache.length == 11
    assert [layer.length for layer in cache.layers] == [11] * len(cache.layers)
    runner.forward(cache, [1, 2, 3])
    assert cache.length == 14
    assert buffer_pointers(cache) == pointers
    cache.rollback(0)
    assert cache.length == 0
    runner.forward(cache, TOKENS[:2])
    assert buffer_pointers(cache) == pointers


@pytest.mark.parametrize("target", [-1, 7])
def test_rollback_outside_the_cached_range_raises(tiny_model: LoadedModel, target: int) -> None:
    runner = ModelRunner(tiny_model)
    cache = runner.new_cache(16)
    runner.forward(cache, TOKENS[:6])
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(target)
    assert cache.length == 6


def test_rollback_then_refeed_equals_a_fresh_run(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    cache = runner.new_cache(32)
    runner.forward(cache, TOKENS[:8])
    runner.forward(cache, [100, 200, 300, 400])  # a draft that gets rejected after 1 token
    cache.rollback(9)
    refeed = [555, 666, 777]
    logits = runner.forward(cache, refeed).logits  # [3, vocab]
    sequence = TOKENS[:8] + [100] + refeed
    fresh_cache = runner.new_cache(32)
    fresh = runner.forward(fresh_cache, sequence).logits[-3:]
    torch.testing.assert_close(logits, fresh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, reference_logits(tiny_model, sequence)[-3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [2, 5, 15])
def test_block_forward_equals_single_token_forwards(tiny_model: LoadedModel, block: int) -> None:
    runner = ModelRunner(tiny_model)
    tokens = TOKENS[:block]
    together = runner.forward(runner.new_cache(32), tokens).logits
    cache = runner.new_cache(32)
    one_by_one = torch.cat([runner.forward(cache, [t]).logits for t in tokens])
    assert together.shape == one_by_one.shape == (block, tiny_model.vocab_size)
    torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together, reference_logits(tiny_model, tokens), atol=1e-5, rtol=1e-5)


def test_repeated_rollbacks_match_reference_on_the_real_model(default_model: LoadedModel) -> None:
    runner = ModelRunner(default_model)
    cache = runner.new_cache(24)
    prompt = default_model.tokenizer("The capital of France is")["input_ids"]
    runner.forward(cache, prompt)
    committed = list(prompt)
    for draft, keep in (([11, 12, 13], 1), ([14, 15], 0), ([16, 17, 18], 3)):
        runner.forward(cache, draft)
        cache.rollback(len(committed) + keep)
        committed += draft[:keep]
    logits = runner.forward(cache, [19]).logits
    torch.testing.assert_close(logits[0], reference_logits(default_model, committed + [19])[-1], atol=1e-4, rtol=1e-4)


def test_writing_past_the_end_raises(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    cache = runner.new_cache(6)
    runner.forward(cache, TOKENS[:4])
    with pytest.raises(ContextOverflowError, match="exceeds"):
        runner.forward(cache, TOKENS[4:7])


def test_crop_follows_the_transformers_convention(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    cache = runner.new_cache(16)
    runner.forward(cache, TOKENS[:8])
    cache.crop(-3)  # negative: remove that many from the end
    assert cache.length == 5
    cache.crop(2)  # non-negative: keep that many
    assert cache.length == 2
