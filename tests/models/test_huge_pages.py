"""Weights moved into huge pages: the same bytes and bits, one mapping, shared storages kept shared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec import kernels
from specdec.models import ModelRunner, huge_pages
from specdec.models.loader import load_model

needs_huge_pages = pytest.mark.skipif(huge_pages.unavailable_reason() is not None,
                                      reason=f"weights stay in 4 KiB pages here: {huge_pages.unavailable_reason()}")


@needs_huge_pages
def test_place_moves_the_bytes_into_one_mapping_and_keeps_views_views() -> None:
    generator = torch.Generator().manual_seed(0)
    big = torch.randint(-128, 127, (3000, 700), dtype=torch.int8, generator=generator)  # an odd size: not whole pages
    table = torch.randn(50, 64, generator=generator)
    rows = table[10:20]  # a view into table's storage, at an offset
    half = torch.randn(33, dtype=torch.float64, generator=generator).half()
    before = [t.clone() for t in (big, table, rows, half)]
    pointers = [t.data_ptr() for t in (big, table, half)]

    moved = huge_pages.place([big, table, rows, half])

    assert moved >= sum(t.numel() * t.element_size() for t in (big, table, half))
    for tensor, old in zip((big, table, rows, half), before):
        assert torch.equal(tensor, old) and tensor.dtype == old.dtype and tensor.shape == old.shape
    assert all(t.data_ptr() != p for t, p in zip((big, table, half), pointers))
    storages = {t.untyped_storage().data_ptr() for t in (big, table, rows, half)}
    assert len(storages) == 1  # one mapping holds them all
    assert rows.data_ptr() == table.data_ptr() + 10 * 64 * 4  # still a view into table
    table[12, 0] = 7.0
    assert rows[2, 0] == 7.0
    assert big.data_ptr() % huge_pages.ALIGN == 0 and table.data_ptr() % huge_pages.ALIGN == 0


def test_off_leaves_tensors_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV, "0")
    weight = torch.randn(512, 512)
    pointer = weight.data_ptr()
    assert huge_pages.unavailable_reason() == f"${huge_pages.ENV}=0"
    assert huge_pages.place([weight]) == 0 and weight.data_ptr() == pointer


@needs_huge_pages
@pytest.mark.parametrize("dtype", ["float32", "int8", "int4", "r8"])
def test_a_backend_in_huge_pages_computes_the_same_bits(tiny_model_dir: Path, dtype: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if dtype == "r8" and not kernels.available():
        pytest.skip(f"specdec's kernels are not built here: {kernels.missing_reason('auto')}")
    moved = load_model(str(tiny_model_dir), backend="native", dtype=dtype)
    monkeypatch.setenv(huge_pages.ENV, "0")
    kept = load_model(str(tiny_model_dir), backend="native", dtype=dtype)
    assert kept.backend.huge_page_bytes == 0
    assert moved.backend.huge_page_bytes >= moved.backend.matrix_bytes()
    layer = moved.backend.layers[0]
    assert layer.qkv.parts[0].tensors["weight"].untyped_storage().data_ptr() == \
        moved.backend.lm_head.parts[0].tensors["weight"].untyped_storage().data_ptr()
    prompt = list(range(3, 40))
    outputs = []
    for loaded in (moved, kept):
        runner = ModelRunner(loaded)
        cache = runner.new_cache(64)
        prefill = runner.forward(cache, prompt).logits
        steps = [runner.forward(cache, [int(prefill[-1].argmax())]).logits, runner.forward(cache, [5, 6, 7]).logits]
        outputs.append([prefill, *steps])
    for got, want in zip(*outputs):
        assert torch.equal(got, want)
