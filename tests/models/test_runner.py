"""ModelRunner: the one forward interface (new tokens in, logits and optionally hidden
states out) and its limits."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import PromptError
from specdec.models import LoadedModel, ModelRunner

TOKENS = [17, 905, 331, 42, 42, 7]


def test_new_cache_beyond_context_is_a_prompt_error(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    assert runner.new_cache(tiny_model.max_positions).max_len == 512
    with pytest.raises(PromptError, match="needs 513 positions but .* has a context of 512"):
        runner.new_cache(tiny_model.max_positions + 1)


def test_logits_are_float32_rows_per_new_token(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    logits = runner.forward(runner.new_cache(16), TOKENS).logits
    assert logits.shape == (len(TOKENS), tiny_model.vocab_size)
    assert logits.dtype == torch.float32
    assert not logits.requires_grad


def test_last_only_returns_the_last_row(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    full = runner.forward(runner.new_cache(16), TOKENS).logits
    last = runner.forward(runner.new_cache(16), TOKENS, last_only=True).logits
    assert last.shape == (1, tiny_model.vocab_size)
    torch.testing.assert_close(last[0], full[-1], atol=1e-5, rtol=1e-5)


def test_hidden_states_are_returned_only_when_asked(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    out = runner.forward(runner.new_cache(16), TOKENS, hidden=True)
    assert out.hidden is not None and out.hidden.shape == (len(TOKENS), tiny_model.model.config.hidden_size)
    assert runner.forward(runner.new_cache(16), TOKENS).hidden is None


def test_hidden_states_are_the_lm_head_input(default_model_hf: LoadedModel, default_model: LoadedModel) -> None:
    # ForwardOutput documents `hidden` as the last layer's output after the final norm, the LM
    # head's input: what a drafter head fed by the target's hidden states reads. The real model,
    # because a random model's norm weights are all one.
    runner = ModelRunner(default_model_hf)
    out = runner.forward(runner.new_cache(16), TOKENS, hidden=True)
    head = default_model_hf.model.get_output_embeddings()
    final_norm = default_model_hf.model.model.norm
    with torch.inference_mode():
        torch.testing.assert_close(head(out.hidden), out.logits, atol=1e-4, rtol=1e-4)
        # and it is not the pre-norm residual stream: normalising again changes the logits
        assert not torch.allclose(head(final_norm(out.hidden)), out.logits, atol=1e-2)
    # The native backend's hidden states are its LM head's input too.
    runner = ModelRunner(default_model)
    out = runner.forward(runner.new_cache(16), TOKENS, hidden=True)
    torch.testing.assert_close(default_model.backend.lm_head(out.hidden).float(), out.logits, atol=1e-4, rtol=1e-4)


def test_empty_forward_raises(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model)
    with pytest.raises(ValueError, match="at least one token"):
        runner.forward(runner.new_cache(4), [])
