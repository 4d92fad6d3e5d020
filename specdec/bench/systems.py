"""The systems `specdec bench` sets side by side: plain decoding and the configured speculation,
other speculative configs on the same target, plain decoding on other backends, and the peers
(transformers' generate, plain, with prompt lookup and assisted by the same draft model;
llama.cpp's C++ programs, plain, with n-gram drafting and with the same draft model, when `make
peers` has built them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specdec.api import LLM
from specdec.bench import llama_cpp
from specdec.bench.report import PLAIN, SPEC
from specdec.bench.runner import System, specdec_runner, transformers_runner
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel, load_model, model_file

PEERS = ("transformers", "llama.cpp")
PROMPT_LOOKUP_TOKENS = 10  # the peers' prompt-lookup guesses per step


def gguf_file(model: str | None) -> str | None:
    """The GGUF file behind a model argument (the default's or a catalog model's), or None when
    it is not one."""
    path = model_file(model)
    return str(path) if path.suffix == ".gguf" else None


def bench_systems(
    llm: LLM,
    params: SamplingParams,
    *,
    model: str | None = None,
    compare: Sequence[SpeculativeConfig] = (),
    plain_on: Sequence[str] = (),
    peers: Sequence[str] = (),
    device: str = "cpu",
    note: Callable[[str], None] = lambda message: None,
) -> list[System]:
    """Every system of a bench run, its baselines first. `plain_on` holds BACKEND[:DTYPE]
    strings; `peers` names from PEERS; `note` hears why a peer was skipped. The LLMs made here
    keep no prefix cache (every system prefills each prompt whole); `llm` should not either."""
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ConfigError(f"unknown peer(s): {', '.join(unknown)}; choose {' or '.join(PEERS)}")
    systems = [System(PLAIN, specdec_runner(llm, params, False)), System(SPEC, specdec_runner(llm, params, True), PLAIN)]
    for other in compare:
        other_llm = LLM(loaded=llm.target, speculative_config=other, prefix_cache_mb=0)
        systems.append(System(f"specdec {other.label}", specdec_runner(other_llm, params, True), PLAIN))
    for text in plain_on:
        name, _, fmt = text.partition(":")
        other_llm = LLM(model, None, device=device, backend=name, dtype=fmt or "auto", prefix_cache_mb=0)
        systems.append(System(f"specdec {other_llm.target.describe()} plain", specdec_runner(other_llm, params, False), PLAIN))
    encode, ends = llm.encode, llm.stop_token_ids
    if "transformers" in peers:
        stock = load_model(model, device=device, backend="hf", fast_kernels=False)
        systems += [
            System("transformers generate", transformers_runner(stock, encode, params, ends)),
            System("transformers prompt lookup", transformers_runner(stock, encode, params, ends, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
                   "transformers generate"),
        ]
        draft = _draft_model(llm)
        if draft is not None and draft.model is not None:
            # A draft model of its own on transformers: transformers' assisted generation with it.
            systems.append(System("transformers assisted", transformers_runner(stock, encode, params, ends, assistant_model=draft.model),
                                  "transformers generate"))
    if "llama.cpp" in peers:
        systems += _llama_cpp_systems(llm, params, model, note)
    return systems


def _draft_model(llm: LLM) -> LoadedModel | None:
    """The draft model the drafter drafts with, when it has one of its own (not the target's layers)."""
    runner = llm.engine.drafter.model_runner() if llm.engine.drafter is not None else None
    return runner.loaded if runner is not None and runner.layers is None else None


def _llama_cpp_systems(llm: LLM, params: SamplingParams, model: str | None, note: Callable[[str], None]) -> list[System]:
    """llama.cpp's programs on the target's GGUF file (and the draft model's, when the method
    reads one), each prompt given as the text of specdec's template tokens."""
    gguf = gguf_file(model)
    if gguf is None:
        note("llama.cpp peers skipped: the model is not a GGUF file")
        return []
    try:
        note(f"llama.cpp peers: {llama_cpp.build_info()}")
    except ConfigError as error:
        note(f"llama.cpp peers skipped: {error}")
        return []
    draft = _draft_model(llm)
    draft_gguf = gguf_file(draft.source) if draft is not None else None
    tokenizer = llm.target.tokenizer

    def text_of(prompt) -> str:
        return tokenizer.decode(llm.encode(prompt), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    systems = []
    for peer in llama_cpp.peers(draft_gguf):
        run = llama_cpp.cpp_runner(peer, gguf, text_of, tokenize, detokenize, params.max_tokens)
        systems.append(System(peer.name, run, None if peer.plain else "llama.cpp plain"))
    return systems
