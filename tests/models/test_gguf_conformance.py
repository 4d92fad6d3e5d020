"""The conformance tier: tiny random GGUF files of every architecture the native backend reads
from GGUF (Llama, whose files Mistral's are too, Qwen2, Qwen3, Gemma 3, Phi-3) with every matrix in
each block format (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q3_K, IQ4_NL, IQ4_XS, Q2_K, and
a Q4_K_M mixture of Q4_K and Q6_K as llama.cpp writes one), written with the `gguf`
package's writer (`gguf_files.py`) and loaded twice: by the native backend, and by transformers'
own GGUF reader and dequantization, the reference. Per file: the native backend in float32 gives
transformers' logits (to 1e-4); under `auto` every format runs on a kernel as stored (Q2_K, which none takes,
in float32, said in one line), each matrix holding the file's values bit for
bit, within the activations' int8 rounding of the reference; and
speculation (the file drafting for itself) is greedy-identical to plain decoding."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from specdec import LLM, SamplingParams, kernels
from specdec.models import load_model, loader
from specdec.models.runner import ModelRunner
from tests.conftest import tiny_tokenizer
from tests.models.gguf_files import ARCHITECTURES, FORMATS, MIXTURES, write_tiny_gguf

# The formats each file's matrices run in under `auto` where the kernels are built (Q4_K_M: its
# Q4_K and Q6_K matrices each in its own; a fused query/key/value mixing them, stacked).
ON_KERNELS = {"F16": {"f16"}, "Q8_0": {"q8"}, "Q5_0": {"q8"}, "Q6_K": {"q8"}, "Q4_0": {"q4"}, "Q4_1": {"q4"}, "Q5_1": {"q4"},
              "Q4_K": {"q4"}, "Q5_K": {"q4"}, "Q3_K": {"q8"}, "IQ4_NL": {"q8"}, "IQ4_XS": {"q8"}, "Q4_K_M": {"q4", "q8"}}
# A type no kernel takes: its matrices run in float32, and one line says so.
WIDENED = "Q2_K"
PROMPT = list(range(5, 41))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    # The files' converted metadata in a directory of the module's own, not the user's cache.
    directory = tmp_path_factory.mktemp("gguf-converted")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "cache_dir", lambda: directory)
        yield directory


@pytest.mark.parametrize("fmt", FORMATS + tuple(MIXTURES))
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_gguf_file_runs_natively_as_transformers_reads_it(architecture: str, fmt: str, cache, tmp_path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = tiny_tokenizer()
    path = write_tiny_gguf(tmp_path / f"{architecture}-{fmt}.gguf", architecture, fmt, tokenizer)
    transformers_logging.disable_progress_bar()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0]

    exact = load_model(str(path), backend="native", dtype="float32")
    assert exact.backend.name == "native" and exact.backend.model_type == reference.config.model_type
    torch.testing.assert_close(ModelRunner(exact).score(PROMPT), want, rtol=1e-4, atol=1e-4)

    with caplog.at_level(logging.WARNING, logger="specdec.models.native"):
        native = load_model(str(path))
    if kernels.available():
        assert native.backend._formats() == ON_KERNELS.get(fmt, {"float32"})
    # ... holding the file's own values: every matrix is bitwise the float32 load's (no matrix
    # requantized, a mixture's fused parts each in its own format)
    for packed, plain in zip(native.backend.layers, exact.backend.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(getattr(packed, name).dequantized(), getattr(plain, name).dequantized()), name
    widened = [r.getMessage() for r in caplog.records if "run in float32" in r.getMessage()]
    assert bool(widened) == (fmt == WIDENED) and all(fmt in line for line in widened)
    got = ModelRunner(native).score(PROMPT)
    assert float((got - want).norm() / want.norm()) < 0.06  # the activations' int8 rounding, at most

    # The file drafting for itself: every step verifies 4 tokens in one pass, which must pick
    # what plain decoding's one-token passes pick.
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(loaded=native).plain_engine.generate(PROMPT, greedy).token_ids
    config = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}
    result = LLM(loaded=native, speculative_config=config).engine.generate(PROMPT, greedy)
    assert result.token_ids == plain and result.stats.drafted_tokens >= 8


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_fast_config_is_transformers_own(architecture: str, tmp_path) -> None:
    # The config read through transformers' fast metadata reader is the dict its full GGUF
    # loader builds, key for key (a 151,936-token vocabulary: 0.1 s against 19 s).
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = write_tiny_gguf(tmp_path / f"{architecture}.gguf", architecture, "Q8_0", tiny_tokenizer())
    assert loader.gguf_config_dict(path) == load_gguf_checkpoint(str(path), return_tensors=False)["config"]
