"""The library entry point: `LLM(model, speculative_config).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine import Engine, Generation, RequestStats, StreamChunk
from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel, load_model
from specdec.models.prefix_cache import PrefixCache
from specdec.models.prompts import Infill, Message, Prompt, PromptEncoder
from specdec.sampling.logprobs import TokenLogprob



@dataclass(frozen=True)
class RequestOutput:
    """One finished request: text, token ids, why it finished, and its statistics; with
    SamplingParams.logprobs (and prompt_logprobs) the tokens' log-probabilities."""

    prompt: Prompt
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _as_config(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, dict):
        return SpeculativeConfig.from_dict(value)
    if isinstance(value, str):
        return SpeculativeConfig.from_json(value)
    raise ConfigError(f"speculative_config must be a SpeculativeConfig, dict or JSON string, not {type(value).__name__}")


class LLM:
    """A target model, optionally with a drafter.

    model: None for the embedded default (SmolLM2-135M-Instruct), a .gguf path, or a Hugging
        Face model directory.
    backend: `auto` (native where it runs the model), `native` or `hf`; dtype: the weight
        format, `auto` (a GGUF file's own quantization on native), `float32`, `bfloat16`, `int8`, `int4`.
    speculative_config: None for plain decoding, or a SpeculativeConfig, a dict with its keys,
        or the same as a JSON string.
    prefix_cache_mb: memory for keys and values kept from request to request, so that a prompt
        that starts with an earlier one's tokens (a system prompt, a conversation's earlier turns)
        prefills only the rest; 0 turns it off. Outputs are the same either way; where the backend
        cannot reuse them exactly (hf, float32 weights) there is none.

    A string prompt is raw text to continue; a list of {"role", "content"} messages is a chat,
    rendered with the model's chat template.
    """

    def __init__(
        self,
        model: str | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        *,
        device: str | torch.device = "cpu",
        backend: str = "auto",
        dtype: str | torch.dtype = "auto",
        loaded: LoadedModel | None = None,
        prefix_cache_mb: float = 256,
        kv_dtype: str = "auto",
    ) -> None:
        if isinstance(prefix_cache_mb, bool) or not isinstance(prefix_cache_mb, (int, float)) or not prefix_cache_mb >= 0:
            raise ConfigError(f"prefix_cache_mb must be a number >= 0, got {prefix_cache_mb!r}")
        self.speculative_config = _as_config(speculative_config)
        self.target = loaded if loaded is not None else load_model(model, device=device, backend=backend, dtype=dtype,
                                                                    kv_dtype=kv_dtype)
        self._encoder = PromptEncoder(self.target)
        # One prefix cache for both engines: they run the same target, so they share its KV.
        self.prefix_cache = PrefixCache.for_backend(self.target.backend, int(prefix_cache_mb * (1 << 20)))
        self.plain_engine = Engine(self.target, prefix_cache=self.prefix_cache)
        self.engine = self.plain_engine if self.speculative_config is None else \
            Engine.from_config(self.target, self.speculative_config, prefix_cache=self.prefix_cache)

    def memory(self) -> dict[str, int]:
        """Weight bytes: the target's, and what the drafter adds to them (0 when it shares them)."""
        drafter = self.engine.drafter
        return {
            "target_weight_bytes": self.target.weight_bytes(),
            "draft_added_bytes": drafter.added_memory_bytes if drafter is not None else 0,
        }

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: Prompt, tools: list[dict] | None = None) -> list[int]:
        """Token ids for a prompt (:class:`specdec.models.prompts.PromptEncoder`)."""
        return self._encoder.encode(prompt, tools)

    def stop_token_ids(self, prompt: Prompt) -> tuple[int, ...]:
        """Token ids besides EOS that end this prompt's output (an infill's FIM control tokens)."""
        return self._encoder.stop_token_ids(prompt)

    def request_params(self, params: SamplingParams, prompt: Prompt | None = None) -> SamplingParams:
        """The config's drafter-invariant rule applies to every request, speculating or not; an
        infill's output also ends at the model's FIM control tokens."""
        config = self.speculative_config
        if config is not None and config.drafter_invariant and not params.drafter_invariant:
            params = dataclasses.replace(params, drafter_invariant=True)
        stops = self._encoder.stop_token_ids(prompt) if prompt is not None else ()
        if stops:
            params = dataclasses.replace(params, stop_token_ids=tuple(sorted({*params.stop_token_ids, *stops})))
        return params

    def _engine(self, speculate: bool) -> Engine:
        return self.engine if speculate else self.plain_engine

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        *,
        speculate: bool = True,
        max_batch: int = 8,
    ) -> list[RequestOutput]:
        """Generate for every prompt, up to `max_batch` of them together in each target pass (one
        at a time with 1). speculate=False decodes plainly with the same engine."""
        single = isinstance(prompts, (str, Infill)) or (prompts and isinstance(prompts[0], dict))
        batch = [prompts] if single else list(prompts)
        engine = self._engine(speculate)
        encoded = [self.encode(prompt) for prompt in batch]  # every prompt checked before any runs
        params = [self.request_params(sampling_params or SamplingParams(), prompt) for prompt in batch]
        outputs = []
        for prompt, p, result in zip(batch, params, engine.generate_batch(encoded, params, max_batch)):
            outputs.append(RequestOutput(
                prompt, result.text, result.token_ids, result.finish_reason, result.stats,
                logprobs=result.logprobs if p.logprobs is not None else None,
                prompt_logprobs=result.prompt_logprobs if p.prompt_logprobs else None,
            ))
        return outputs

    def chat(self, messages: list[Message], sampling_params: SamplingParams | None = None, **kwargs: Any) -> RequestOutput:
        return self.generate([messages], sampling_params, **kwargs)[0]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, *, speculate: bool = True,
        result: Generation | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield text and token ids as each target step commits them. A `result` given is
        filled in as generation goes: prompt ids, tokens, text, finish reason, statistics."""
        prompt_ids = self.encode(prompt)
        if result is not None:
            result.prompt_ids = list(prompt_ids)
        return self._engine(speculate).stream(prompt_ids, self.request_params(sampling_params or SamplingParams(), prompt), result)
