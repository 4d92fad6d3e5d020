"""Fixtures shared by the training tests (EAGLE, Medusa)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from specdec import SamplingParams
from specdec.engine import Engine
from specdec.models import LoadedModel

SelfDistilled = Callable[[int], tuple[LoadedModel, list[dict[str, Any]]]]


@pytest.fixture(scope="session")
def self_distilled(small_model_factory) -> SelfDistilled:
    """(target, records): a small target with peaked distributions over 8 tokens (so top-1 is well
    defined) and its own greedy answers of `answer_tokens` to 12 random prompts, the text
    `specdec train-draft` trains a head on. A random target follows no pattern a head could
    generalise from, so training on it measures fitting the text, which a broken loss or mask
    would not do."""

    def make(answer_tokens: int) -> tuple[LoadedModel, list[dict[str, Any]]]:
        target = small_model_factory(seed=4, vocab_size=8)
        generator = torch.Generator().manual_seed(0)
        engine = Engine(target)
        params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
        records = []
        for i in range(12):
            prompt = torch.randint(0, 8, (6,), generator=generator).tolist()
            records.append({"id": f"r{i}", "prompt_ids": prompt, "answer_ids": engine.generate(prompt, params).token_ids})
        return target, records

    return make
