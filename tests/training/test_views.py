"""The target's views that heads train on: made from a start row or whole, kept on disk (and
read back bitwise after a kill), and the same distribution with or without specdec's kernels."""

from __future__ import annotations

import pytest
import torch

from specdec import kernels
from specdec.drafters.eagle import EagleHead
from specdec.errors import ConfigError
from specdec.models import LoadedModel
from specdec.training.heads import TargetView, TrainConfig, ViewStore, draft_distribution, new_head


def random_head(target: LoadedModel, draft_vocab: int, seed: int = 0) -> EagleHead:
    """An untrained EAGLE head over the target's first `draft_vocab` tokens."""
    return new_head(target, torch.arange(draft_vocab), TrainConfig(draft_vocab_size=draft_vocab, seed=seed)).eval()


def test_view_store_reads_back_what_it_made_and_survives_a_kill(tiny_native: LoadedModel, tmp_path) -> None:
    head = random_head(tiny_native, 512)
    layers = head.config.target_layers
    meta = TargetView.meta(tiny_native, layers, head.draft_ids, 16)
    view = TargetView(tiny_native, layers, head.draft_ids, 16, ViewStore(tmp_path, meta))
    first, second = list(range(40, 70)), list(range(80, 95))
    made = view(first)
    assert made.index.shape == (29, 16) and made.features.dtype == torch.bfloat16
    view(second)
    # The rows of a third sequence cut by a kill: in the data files, not yet in the log.
    with (tmp_path / "features.bin").open("ab") as handle:
        handle.write(b"\0" * 1000)
    with (tmp_path / "rows.jsonl").open("a") as handle:
        handle.write('{"key": "cut", "sta')
    reopened = TargetView(tiny_native, layers, head.draft_ids, 16, ViewStore(tmp_path, meta))
    reopened.runner.forward = None  # a stored sequence must not run the target again
    again = reopened(first)
    for name in ("features", "index", "values", "top"):
        assert torch.equal(getattr(again, name), getattr(made, name)), name
    assert torch.equal(reopened(second).top, view(second).top)
    assert (tmp_path / "features.bin").stat().st_size == (29 + 14) * meta["feature_size"] * 2
    # The kept probabilities are the target's: the top tokens' of its softmax over the draft ids.
    probs = torch.softmax(view.runner.score(first)[1:].float(), dim=-1)[:, head.draft_ids]
    torch.testing.assert_close(again.values.float(), probs.topk(16, dim=-1).values, rtol=1e-2, atol=1e-3)
    with pytest.raises(ConfigError, match="draft_vocab, draft_vocab_size"):
        ViewStore(tmp_path, TargetView.meta(tiny_native, layers, head.draft_ids[:100], 16))


def test_a_view_from_a_start_skips_the_prompts_distributions(tiny_any: LoadedModel, tmp_path) -> None:
    head = random_head(tiny_any, 256)
    layers = head.config.target_layers
    meta = TargetView.meta(tiny_any, layers, head.draft_ids, 16)
    view = TargetView(tiny_any, layers, head.draft_ids, 16, ViewStore(tmp_path, meta))
    ids, start = list(range(40, 70)), 11
    part = view(ids, start)
    whole = TargetView(tiny_any, layers, head.draft_ids, 16)(ids)
    # The rows it made are the whole view's (to rounding: a float32 LM head over fewer rows; the
    # quantized formats' kernels give the same bits, test_views_from_a_start_are_bitwise_the_whole_ones).
    torch.testing.assert_close(part.values[start:].float(), whole.values[start:].float())
    assert torch.equal(part.features, whole.features)
    assert part.top.shape == whole.top.shape and bool((part.top[:start] == -1).all())
    assert not part.values[:start].any()
    # Stored under its start: it serves that start, never a view counted from earlier rows.
    assert view.stored(ids, start) is not None and view.stored(ids) is None and view.stored(ids, 5) is None
    # A whole view serves every start.
    view(ids)
    assert view.stored(ids, 5) == view.stored(ids) == ViewStore.key(ids)
    with pytest.raises(ValueError, match="past the last row"):
        view(ids, 29)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        view([5])


def test_views_from_a_start_are_bitwise_the_whole_ones(default_model: LoadedModel) -> None:
    """On the default model's formats (q4 layers, a q8 LM head: row-invariant kernels), a view
    made from a start is bitwise the whole view's rows from there on: training reads the same."""
    head = random_head(default_model, 1024)
    view = TargetView(default_model, head.config.target_layers, head.draft_ids)
    ids = default_model.tokenizer.encode("The quick brown fox jumps over the lazy dog because it was late for work.")
    whole, part = view(ids), view(ids, 6)
    for name in ("features", "index", "values", "top"):
        assert torch.equal(getattr(part, name)[6:], getattr(whole, name)[6:]), name


@pytest.mark.skipif(not kernels.available(), reason="specdec's kernels are not built on this machine")
def test_views_keep_the_same_distribution_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = 3 * torch.randn(20, 300, generator=torch.Generator().manual_seed(4))
    draft = torch.randperm(300, generator=torch.Generator().manual_seed(5))[:100]
    fast = draft_distribution(logits, draft, 16)
    monkeypatch.setattr(kernels, "available", lambda: False)
    plain = draft_distribution(logits, draft, 16)
    assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])
    torch.testing.assert_close(fast[2], plain[2], rtol=1e-5, atol=1e-8)
