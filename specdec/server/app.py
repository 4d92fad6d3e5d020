"""The FastAPI application: OpenAI-compatible completions and chat completions (streaming and
not), `/v1/models`, `/health` and `/metrics`, over the scheduler thread.

Each choice of a request is one sequence in the batch. Its events arrive from the scheduler
thread on an asyncio queue; a client that goes away cancels its sequences. Prompts are
tokenized on a thread of their own, so a long one does not hold up the event loop. The guard
around the app (:mod:`specdec.server.guard`) refuses bodies over `max_request_bytes` (413) and
counts refused requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.config import SamplingParams, StructuredOutput
from specdec.drafters.base import CacheStats
from specdec.engine.batch import check_prompt, draft_room
from specdec.engine.stats import RequestStats
from specdec.engine.text import TokenBytes
from specdec.errors import ConfigError, PromptError
from specdec.models.prompts import Infill, PromptEncoder
from specdec.sampling.grammar import INSTALL_HINT, GrammarCompilerError, IsolatedCompiler
from specdec.sampling.logprobs import TokenLogprob
from specdec.server import dashboard
from specdec.server.config import RouteConfig, ServerConfig
from specdec.server.memory import MemoryPlan, resident_bytes
from specdec.server.logprobs import chat_logprobs, completion_logprobs
from specdec.server.guard import LIVENESS_PATH, RequestGuard, allowed_hosts
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SpeculativeOverride,
    error_body,
)
from specdec.server.scheduler import Event, QueueFullError, Scheduler, ServerRequest, StoppedError
from specdec.server.tools import CallScanner, ToolPlan, call_id_seeds, may_be_calls, plan_tools

log = logging.getLogger(__name__)

T = TypeVar("T")


def _one_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-encode")


def _compile_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-grammar")


@dataclass
class ServerState:
    """What the app serves: the config, an encoder (own tokenizer copy, used only by the one
    thread of `encode_pool`), the scheduler thread, metrics and the memory plan."""

    config: ServerConfig
    encoder: PromptEncoder
    scheduler: Scheduler
    metrics: ServerMetrics
    memory: MemoryPlan
    model_name: str
    max_model_len: int
    max_num_seqs: int
    shutting_down: bool = False
    # Under Ray Serve, this replica's id: every response names it (header x-specdec-replica).
    replica: str | None = None
    # One thread: a fast tokenizer must not be used from two threads at once.
    encode_pool: ThreadPoolExecutor = field(default_factory=_one_thread)
    # Structured outputs compile in a child process (None: xgrammar is not installed); a thread
    # of their own waits for it, so that a long compile holds up no tokenizing.
    grammars: IsolatedCompiler | None = None
    grammar_pool: ThreadPoolExecutor = field(default_factory=_compile_thread)
    _token_bytes: TokenBytes | None = None
    _longest_token: int | None = None  # bytes of the vocabulary's longest token

    def token_bytes(self) -> TokenBytes:
        """Every token's bytes and text, for logprobs (built on first use, on the encode thread)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.encoder.tokenizer)
        return self._token_bytes

    def check_size(self, texts: list[str], param: str) -> None:
        """Refuse a prompt that cannot fit the context before tokenizing it: no token is longer
        than the vocabulary's longest, so its bytes over that length bound its token count
        from below (a 4 MiB prompt is refused in milliseconds, without its tokens in memory)."""
        size = sum(len(text.encode("utf-8")) for text in texts)
        if size < self.max_model_len:
            return  # fewer bytes than the context: it fits, or tokenizing it is cheap
        if self._longest_token is None:
            self._longest_token = max(len(token) for token in self.token_bytes().table)
        at_least = -(-size // self._longest_token)
        if at_least >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt has at "
                                f"least {at_least} tokens ({size} bytes)", param=param, code="context_length_exceeded")

    async def encode(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a tokenizing function off the event loop, on the encoder's own thread."""
        return await asyncio.get_running_loop().run_in_executor(self.encode_pool, fn, *args)

    async def compile(self, structured: StructuredOutput | None, param: str) -> Any:
        """A request's structured output compiled off the event loop and the encode thread (its
        sequences take it to the engine, which compiles nothing); a spec that does not compile,
        or not within the limits, is the client's 400."""
        if structured is None:
            return None
        if self.grammars is None:
            raise APIError(400, INSTALL_HINT, param=param)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.grammar_pool, self.grammars.compile, structured)
        except ConfigError as exc:
            raise APIError(400, str(exc), param=param) from None
        except GrammarCompilerError as exc:
            raise APIError(503, str(exc), type="server_error", code="grammar_compiler_failed") from None


JSON_INVALID = "We could not parse the JSON body of your request."

# --- request -> sequences ------------------------------------------------------------------------


def _route(state: ServerState, name: str, request: Request) -> RouteConfig:
    """The route a request names (404 for an unknown one), noted on the request for the guard's count."""
    route = state.config.route(name)
    if route is None:
        known = ", ".join(r.name for r in state.config.routes)
        raise APIError(404, f"The model '{name}' does not exist; this server has: {known}", param="model", code="model_not_found")
    request.state.route = route.name
    return route


def _k(route: RouteConfig, override: bool | SpeculativeOverride | None, predicted: bool = False) -> int | None:
    """The request's own k (0 = off) within its route's cap, or None where it leaves k to the
    route (and a predicted output's to the engine: :meth:`~specdec.engine.batch.BatchEngine.admit`).
    With a prediction a request may set k on any route, up to the room a prediction's draft has
    (:func:`~specdec.engine.batch.draft_room`)."""
    if override is None or override is True:
        return None
    if override is False:
        return 0
    k = override.num_speculative_tokens
    if k is None:
        return route.k
    if k > 0 and route.speculative is None and not predicted:
        raise APIError(400, f"route '{route.name}' does not speculate; only num_speculative_tokens 0 is allowed",
                       param="speculative.num_speculative_tokens", code="speculation_not_allowed")
    cap = draft_room(route.k_cap) if predicted else route.k_cap
    if k > cap:
        raise APIError(400, f"num_speculative_tokens {k} exceeds route '{route.name}' limit of {cap}",
                       param="speculative.num_speculative_tokens", code="speculation_limit")
    return k


def _structured(body: CompletionRequest | ChatCompletionRequest) -> tuple[StructuredOutput | None, str]:
    """The request's structured output (chat's response_format, or the structured_outputs
    extension), and the field that asked for it (errors name it)."""
    fmt = getattr(body, "response_format", None)
    fmt = fmt if fmt is not None and fmt.type != "text" else None
    extension = body.structured_outputs
    if fmt is not None and extension is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    try:
        if extension is not None:
            if extension.json_ is not None:
                return StructuredOutput.json_schema(extension.json_), "structured_outputs.json"
            if extension.regex is not None:
                return StructuredOutput("regex", extension.regex), "structured_outputs.regex"
            return StructuredOutput("grammar", extension.grammar), "structured_outputs.grammar"
        if fmt is not None and fmt.json_schema is not None:
            return StructuredOutput.json_schema(fmt.json_schema.schema_), "response_format.json_schema.schema"
        if fmt is not None:  # json_object
            return StructuredOutput.json_schema(), "response_format"
    except ConfigError as exc:
        raise APIError(400, str(exc), param="structured_outputs" if extension is not None else "response_format") from None
    return None, ""


def _params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, choice: int,
            route: RouteConfig, vocab: int, structured: StructuredOutput | None = None,
            prediction: tuple[int, ...] = (), stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stop):
        raise APIError(400, "stop strings must be non-empty", param="stop")
    if len(stop) > 16:
        raise APIError(400, "at most 16 stop strings", param="stop")
    seed = None if body.seed is None else (body.seed + choice) % 2**63  # choices of one request differ
    # The request's own choice, else the route's (drafter-invariant tokens are the same with or
    # without speculation, so the rule may be asked for on any route).
    invariant = route.speculative is not None and route.speculative.drafter_invariant
    if isinstance(body.speculative, SpeculativeOverride) and body.speculative.drafter_invariant is not None:
        invariant = body.speculative.drafter_invariant
    bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
    if any(token >= vocab for token in bias):
        raise APIError(400, f"logit_bias token ids must be in 0..{vocab - 1}", param="logit_bias")
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = False
    else:
        logprobs, prompt_logprobs = body.logprobs, body.echo and body.logprobs is not None
    if structured is not None and body.ignore_eos:
        raise APIError(400, "ignore_eos cannot go with a structured output: the output ends where the grammar does",
                       param="ignore_eos")
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                          min_p=body.min_p, seed=seed, stop=stop, ignore_eos=body.ignore_eos, stop_token_ids=stop_token_ids,
                          drafter_invariant=invariant, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                          logit_bias=bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured,
                          prediction=prediction)


def _check_length(state: ServerState, prompt_ids: list[int], param: str) -> None:
    """The engine's prompt check (:func:`~specdec.engine.batch.check_prompt`), as the client's 400."""
    try:
        check_prompt(prompt_ids, state.max_model_len, "This model")
    except PromptError as exc:
        raise APIError(400, str(exc), param=param, code="context_length_exceeded" if exc.too_long else None) from None


def _check_budget(state: ServerState, prompts: list[list[int]], max_tokens: int | None, param: str) -> None:
    """An explicit max_tokens the context cannot hold after the longest prompt is refused, as
    OpenAI refuses it, rather than cut short in silence (unset, the output runs to the context)."""
    longest = max(len(ids) for ids in prompts)
    if max_tokens is not None and longest + max_tokens > state.max_model_len:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens; the prompt has {longest} "
                            f"and {param} asks for {max_tokens} more: at most {state.max_model_len - longest} fit",
                       param=param, code="context_length_exceeded")


@dataclass(frozen=True)
class _Prompts:
    """A request's prompts tokenized (on the encode thread): each prompt's ids, and what else its
    endpoint made of them."""

    ids: list[list[int]]
    texts: list[str] | None = None  # completions with echo: each prompt's text
    stop_token_ids: tuple[int, ...] = ()  # completions with a suffix: the ends of the middle
    tools: ToolPlan | None = None  # chat: what its tools do


def _encode(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> _Prompts:
    """The request's prompts: a completion's, or a chat's messages with its tools rendered."""
    return _encode_chat(state, body) if isinstance(body, ChatCompletionRequest) else _encode_completion(state, body)


def _encode_completion(state: ServerState, body: CompletionRequest) -> _Prompts:
    """Each prompt's token ids, its text when echoed, and a suffix's stop tokens."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    vocab = state.encoder.target.vocab_size
    if body.suffix is not None and not all(isinstance(p, str) for p in prompts):
        raise APIError(400, "a suffix (fill in the middle) needs the prompt as text, not token ids",
                       param="suffix")  # a field name
    encoded = []
    for p in prompts:
        if isinstance(p, str):
            state.check_size([p] if body.suffix is None else [p, body.suffix], "prompt")
            try:
                ids = state.encoder.encode(p if body.suffix is None else Infill(p, body.suffix))
            except PromptError as exc:
                raise APIError(400, str(exc), param="prompt" if body.suffix is None else "suffix") from None  # a field name
        else:
            if any(t < 0 or t >= vocab for t in p):
                raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
            ids = list(p)
        _check_length(state, ids, "prompt")
        encoded.append(ids)
    texts = [p if isinstance(p, str) else state.encoder.tokenizer.decode(p) for p in prompts] if body.echo else None
    stops = state.encoder.stop_token_ids(Infill("", body.suffix)) if body.suffix is not None else ()
    return _Prompts(encoded, texts, stops)


def _encode_prediction(state: ServerState, body: ChatCompletionRequest) -> tuple[int, ...]:
    """The predicted output's token ids."""
    assert body.prediction is not None
    return tuple(state.encoder.tokenizer.encode(body.prediction.text(), add_special_tokens=False))


def _encode_chat(state: ServerState, body: ChatCompletionRequest) -> _Prompts:
    """The prompt's token ids, with its tools rendered (`specdec.server.tools`), and the plan. A
    prompt too long for the context names `tools` where the messages alone would fit."""
    tools = plan_tools(body, state.encoder.tokenizer.chat_template)
    try:
        state.check_size([m["content"] for m in tools.messages], "messages")
        try:
            ids = state.encoder.encode(tools.messages, tools=tools.template_tools)
        except PromptError as exc:
            raise APIError(400, str(exc), param="messages") from None
        _check_length(state, ids, "messages")
    except APIError as exc:
        if exc.code == "context_length_exceeded" and body.tools and tools.callable and _fits_without_tools(state, body):
            exc.param = "tools"
            exc.message += f" with its {len(body.tools)} tools rendered (the messages alone would fit)"
        raise
    return _Prompts([ids], tools=tools)


def _fits_without_tools(state: ServerState, body: ChatCompletionRequest) -> bool:
    """Whether the request's messages alone fit the context: the same checks as the prompt's, the
    byte bound first (a huge message is never tokenized here either)."""
    bare = plan_tools(body.model_copy(update={"tools": None, "tool_choice": None}),
                      state.encoder.tokenizer.chat_template)
    try:
        state.check_size([m["content"] for m in bare.messages], "messages")
        return len(state.encoder.encode(bare.messages)) < state.max_model_len
    except (APIError, PromptError):
        return False


def _output_asked(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, str, int]:
    """What a request asks of its output: the token limit it set (None: none) and the field that
    set it, and the most tokens each choice generates (unset: a completion's 16, a chat's up to
    the context; 0, a completion's with echo: its prompt scored)."""
    if isinstance(body, ChatCompletionRequest):
        asked = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return asked, param, asked or state.max_model_len
    return body.max_tokens, "max_tokens", 16 if body.max_tokens is None else body.max_tokens


# --- the one set-up of both endpoints ---------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """What a response carries besides text: chat or completion, logprobs (and the token
    names they need), and whether the output is dropped (max_tokens 0: the prompt scored)."""

    chat: bool
    logprobs: bool = False
    score_only: bool = False
    names: TokenBytes | None = None
    predicted: bool = False  # a prediction was given: usage counts its accepted and rejected tokens
    callable: frozenset[str] = frozenset()  # the tools the output may call (chat)
    calls_only: bool = False  # the output is constrained to calls (tool_choice required or named)
    call_ids: list[str] = field(default_factory=list)  # per choice, the seed of its calls' ids (with tools)

    def call_seed(self, index: int) -> str:
        """Choice `index`'s seed of its calls' ids (`specdec.server.tools.call_id_seeds`)."""
        return self.call_ids[index] if index < len(self.call_ids) else ""

    def ending(self, index: int, output: str, reason: str | None,
               scanner: CallScanner | None = None) -> tuple[list[dict[str, Any]] | None, str | None]:
        """How choice `index` ends, streamed or not (the one place it is decided): its tool calls
        (None: its output is text) and its finish_reason. An output that stopped as an array of
        calls to its tools is those calls, finish_reason "tool_calls"; one constrained to calls
        and cut by its token limit is the calls it closed (maybe none), never its JSON as text.
        `scanner`: a stream's, which read the output as it came (else it is read here)."""
        if not self.callable:
            return None, reason
        if scanner is None:
            scanner = CallScanner(id_seed=self.call_seed(index))
            scanner.feed(output)
        if reason == "stop":
            calls = scanner.complete(self.callable)
            return calls, "tool_calls" if calls else reason
        if reason == "length" and self.calls_only:
            return scanner.closed(self.callable), reason
        return None, reason


@dataclass(frozen=True)
class _Plan:
    """What the set-up (`_plan`) made of a request: the sequences to run and how to answer."""

    route: RouteConfig
    arrival: float  # when the request came (time.monotonic)
    prompts: list[list[int]]  # each choice's
    params: list[SamplingParams]  # each choice's
    k: int | None  # the request's own k (0: off); None: its route's (a predicted output's: the engine's)
    shape: _Shape
    prompt_tokens: int
    echoes: list[tuple[list[int], str]] | None = None  # completions with echo: each choice's prompt
    per_prompt: int = 1  # choices of each prompt (n), in order: usage counts a prompt once
    grammar: Any = None  # the structured output, compiled (the sequences' params carry its spec)


async def _plan(state: ServerState, http: Request, body: CompletionRequest | ChatCompletionRequest) -> _Plan:
    """The set-up both endpoints share, in this order (the first step that refuses the request
    answers it, with its 4xx): what the request asks for, checked and made into sequences."""
    arrival = time.monotonic()
    chat = isinstance(body, ChatCompletionRequest)
    # 1. The route it names.
    route = _route(state, body.model, http)
    # 2. Its prompts, tokenized off the event loop (chat: its messages, with its tools rendered).
    prompts = await state.encode(_encode, state, body)
    # 3. The output it asks for, which must fit the context after its longest prompt.
    asked, param, max_tokens = _output_asked(state, body)
    _check_budget(state, prompts.ids, asked, param)
    # 4. k, and the predicted output that drafts it (chat): none where the request turned speculation off.
    prediction = await state.encode(_encode_prediction, state, body) if chat and body.prediction is not None else ()
    k = _k(route, body.speculative, predicted=bool(prediction))
    prediction = () if k == 0 else prediction
    # 5. Its structured output (chat: its calls, where its tools are required), compiled.
    tools = prompts.tools
    calls_only = tools is not None and tools.structured is not None
    structured, param = (tools.structured, "tools") if calls_only else _structured(body)
    grammar = await state.compile(structured, param)
    # 6. The response's shape, and each choice's sequence and sampling parameters.
    logprobs = bool(body.logprobs) if chat else body.logprobs is not None
    tool_names = tools.callable if tools is not None else frozenset()
    shape = _Shape(chat=chat, logprobs=logprobs, score_only=max_tokens == 0,
                   names=await state.encode(state.token_bytes) if logprobs else None, predicted=bool(prediction),
                   callable=tool_names, calls_only=calls_only, call_ids=call_id_seeds(body) if tool_names else [])
    choices = [ids for ids in prompts.ids for _ in range(body.n)]
    echoes = None
    if prompts.texts is not None:
        echoes = [(ids, text) for ids, text in zip(prompts.ids, prompts.texts) for _ in range(body.n)]
    # max_tokens 0 (with echo) scores the prompt: one token is generated, and not returned.
    params = [_params(body, max(max_tokens, 1), i % body.n, route, state.encoder.target.vocab_size, structured,
                      prediction, prompts.stop_token_ids) for i in range(len(choices))]
    prompt_tokens = sum(len(ids) for ids in prompts.ids)  # each prompt once, whatever n
    return _Plan(route, arrival, choices, params, k, shape, prompt_tokens, echoes, body.n, grammar)


# --- the answer ------------------------------------------------------------------------------------


@dataclass
class _Job:
    """The sequences of one HTTP request and the queue their events arrive on."""

    requests: list[ServerRequest]
    events: asyncio.Queue[Event]
    scheduler: Scheduler
    checked_at: float = 0.0  # when the client's connection was last checked

    def cancel(self) -> None:
        for request in self.requests:
            self.scheduler.cancel(request)


def _submit(state: ServerState, http: Request, plan: _Plan) -> _Job:
    """Queue a plan's sequences with the scheduler (all or none)."""
    if len(plan.prompts) > state.config.max_waiting:
        raise APIError(400, f"a request may start at most {state.config.max_waiting} sequences (prompts x n); this one "
                            f"starts {len(plan.prompts)}", param="n", code="too_many_sequences")
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def sink(event: Event) -> None:  # runs on the scheduler thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    route, k = plan.route, plan.k
    requests = [ServerRequest(route, ids, p, route.k if k is None else k, sink, index=i, arrival=plan.arrival,
                              grammar=plan.grammar, own_k=k is not None)
                for i, (ids, p) in enumerate(zip(plan.prompts, plan.params))]
    try:
        state.scheduler.submit_all(requests)  # all or none
    except QueueFullError as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from None
    except StoppedError as exc:
        raise APIError(503, str(exc), type="server_error", code="shutting_down") from None
    http.state.submitted = True  # from here on the scheduler counts its sequences in the metrics
    return _Job(requests, events, state.scheduler)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}




class _ClientGone(Exception):
    """A non-streaming request's client left before its answer: nothing to send, nothing to log
    (the scheduler counts its sequences as aborted)."""


@dataclass
class _Result:
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    stats: RequestStats | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def add(self, event: Event, shape: _Shape) -> None:
        """A "prompt" or "token" event's contents (none of the output when it is dropped)."""
        if event.kind == "prompt":
            self.prompt_logprobs = list(event.logprobs)
        elif not shape.score_only:
            self.text += event.text
            self.tokens += len(event.token_ids)
            self.token_ids.extend(event.token_ids)
            self.logprobs.extend(event.logprobs)



async def _answer(state: ServerState, http: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
    """The path both endpoints share: the set-up (`_plan`), the sequences queued, then their
    chunks streamed or one JSON body."""
    plan = await _plan(state, http, body)
    job = _submit(state, http, plan)
    prefix, obj = ("chatcmpl", "chat.completion") if plan.shape.chat else ("cmpl", "text_completion")
    meta = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": plan.route.name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _stream(job, meta, plan, include_usage=include_usage)
    results = await _collect(job, http, plan.shape)
    choices = [_choice(plan, i, r) for i, r in enumerate(results)]
    return JSONResponse(meta | {"object": obj, "choices": choices, **_totals(plan, results)})


def _choice(plan: _Plan, index: int, result: _Result) -> dict[str, Any]:
    """A finished choice's JSON (not streaming): chat's message, its text or its tool calls
    (`_Shape.ending`); a completion's text, after its prompt with echo."""
    shape = plan.shape
    if shape.chat:
        calls, finish = shape.ending(index, result.text, result.finish_reason)
        message = ({"role": "assistant", "content": None, "tool_calls": calls or None} if calls is not None
                   else {"role": "assistant", "content": result.text})
        return {"index": index, "message": message, "finish_reason": finish,
                "logprobs": chat_logprobs(result.logprobs, shape.names) if shape.logprobs else None,
                "speculation": _stats_dict(result)}
    text, logprobs = result.text, None
    if shape.logprobs:
        logprobs = completion_logprobs(result.logprobs, result.token_ids, shape.names)
    if plan.echoes is not None:
        ids, prompt_text = plan.echoes[index]
        text = prompt_text + text
        if shape.logprobs:
            logprobs = completion_logprobs(result.prompt_logprobs + result.logprobs, ids + result.token_ids,
                                           shape.names)
    return {"index": index, "text": text, "finish_reason": result.finish_reason, "logprobs": logprobs,
            "speculation": _stats_dict(result)}


def _stats_dict(result: _Result) -> dict[str, Any] | None:
    return result.stats.to_dict() if result.stats is not None else None


def _totals(plan: _Plan, results: list[_Result]) -> dict[str, Any]:
    """usage, and the speculation statistics of the request: with several choices, their
    counts added up and the rates recomputed from the sums (RequestStats.merge). With a
    prediction (which drafted every token), usage counts its tokens accepted and rejected.
    `prompt_tokens_details.cached_tokens`, as OpenAI's: of each prompt (once, not per choice),
    the tokens whose keys and values the prefix cache held."""
    merged = RequestStats()
    for result in results:
        if result.stats is not None:
            merged.merge(result.stats)
    if len(results) == 1 and results[0].stats is not None:
        merged = results[0].stats
    usage: dict[str, Any] = _usage(plan.prompt_tokens, sum(r.tokens for r in results))
    cached = sum(r.stats.cached_tokens for r in results[:: plan.per_prompt] if r.stats is not None)
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if plan.shape.predicted:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": merged.accepted_tokens,
                                              "rejected_prediction_tokens": merged.drafted_tokens - merged.accepted_tokens}
    return {"usage": usage, "speculation": merged.to_dict()}


async def _next_event(job: _Job, request: Request) -> Event:
    """The next event. Every 0.5 s (events arrive far more often) it also asks whether the client
    has gone; a client that has cancels the job."""
    while True:
        now = time.monotonic()
        if now - job.checked_at >= 0.5:
            job.checked_at = now
            if await request.is_disconnected():
                job.cancel()
                raise _ClientGone
        try:
            return await asyncio.wait_for(job.events.get(), timeout=0.5)
        except TimeoutError:
            continue


async def _collect(job: _Job, request: Request, shape: _Shape) -> list[_Result]:
    results = [_Result() for _ in job.requests]
    pending = len(job.requests)
    try:
        while pending:
            event = await _next_event(job, request)
            result = results[event.index]
            if event.kind in ("token", "prompt"):
                result.add(event, shape)
            elif event.kind == "done":
                result.finish_reason, result.stats = event.finish_reason, event.stats
                pending -= 1
            elif event.client:
                raise APIError(400, event.message, code="no_instance")
            else:
                raise APIError(503, event.message, type="server_error", code="generation_failed")
    finally:
        if pending:
            job.cancel()
    return results




# --- the app: its state's life, error handlers and routes ------------------------------------------


def create_app(state: ServerState, bind_host: str | None = None) -> FastAPI:
    """The FastAPI app over a ready ServerState; the scheduler thread starts with the app. Bound
    to a loopback address (`bind_host`), it answers only requests that name it so."""
    app = FastAPI(title="specdec", lifespan=_lifespan(state))
    app.state.specdec = state
    app.add_middleware(RequestGuard, state=state, allowed=allowed_hosts(bind_host))
    _add_error_handlers(app, state)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _lifespan(state: ServerState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the scheduler thread and the grammar compiler start with it; on
    shutdown the scheduler stops and the worker threads and the compiler are let go."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not state.scheduler.alive:
            state.scheduler.start()
        if state.grammars is not None:
            state.grammars.start()  # its start-up is not a client's wait
        yield
        state.shutting_down = True
        await asyncio.to_thread(state.scheduler.stop)
        state.encode_pool.shutdown(wait=False, cancel_futures=True)
        state.grammar_pool.shutdown(wait=False, cancel_futures=True)
        if state.grammars is not None:
            await asyncio.to_thread(state.grammars.close)

    return lifespan


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error as OpenAI's error body: ours (APIError), FastAPI's validation and HTTP errors,
    and anything unexpected (a 500)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _invalid(state, request, exc)

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # never arrives: nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's own: a body that is not UTF-8, or JSON nested past its reader's depth.
            return JSONResponse(error_body(JSON_INVALID, code="json_invalid"), status_code=400)
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error handling %s", request.url.path)
        return JSONResponse(error_body("internal server error", type="server_error"), status_code=500)


def _invalid(state: ServerState, request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body FastAPI could not validate, as a 400 naming its first error's parameter."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "invalid"}
    body = exc.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and state.config.route(body["model"]):
        request.state.route = body["model"]  # for the metrics: a refusal on this route
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = (first.get("ctx") or {}).get("param") or ".".join(loc) or None  # field_error names its own
    content_type = request.headers.get("content-type", "")
    if first.get("type") == "json_invalid":
        # Its location is a character offset into the body, not a parameter.
        message, code, param = JSON_INVALID, "json_invalid", None
    elif first.get("type") == "model_attributes_type" and not loc and "json" not in content_type.lower():
        # FastAPI reads a body that is not declared JSON as text: say what is wrong.
        message = f"Content-Type must be application/json; got {content_type or 'none'!r}"
        code, param = "invalid_content_type", None
    else:
        message, code = f"{param or 'body'}: {first.get('msg', 'invalid value')}", first.get("type")
    return JSONResponse(error_body(message, param=param, code=code), status_code=400)


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """What the server reports about itself: the dashboard, liveness, `/health`, `/metrics` and
    `/v1/models`."""

    @app.get("/dashboard")
    async def dashboard_page() -> Response:
        return HTMLResponse((dashboard.STATIC / "dashboard.html").read_text(encoding="utf-8"))

    @app.get("/dashboard/data")
    async def dashboard_data() -> JSONResponse:
        state.metrics.refresh_rates()
        return JSONResponse(dashboard.snapshot(state.metrics.registry, [r.name for r in state.config.routes],
                                               state.scheduler.running, state.scheduler.waiting, _memory_plan(state))
                            | {"model": state.model_name})

    app.mount("/dashboard/static", StaticFiles(directory=dashboard.STATIC / "vendor"), name="dashboard-static")

    @app.api_route(LIVENESS_PATH, methods=["GET", "HEAD"])  # probes may ask with HEAD (RFC 9110 9.3.2)
    async def live() -> JSONResponse:
        ok = _serving(state)
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        ok = _serving(state)
        return JSONResponse(_health(state, ok), status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.refresh_rates()
        state.metrics.memory.labels("resident").set(resident_bytes())
        for route, cache in _shared_caches(state):
            state.metrics.suffix_cache.labels(route).set(cache.nbytes)
            state.metrics.suffix_cache_requests.labels(route).set(cache.requests)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": r.name, "object": "model", "created": created, "owned_by": "specdec", "root": state.model_name,
             "max_model_len": state.max_model_len, "speculative": r.to_dict()} for r in state.config.routes
        ]}


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """The OpenAI endpoints, completions and chat completions: one set-up (`_plan`) and one
    answer (`_answer`) for both."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _answer(state, request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _answer(state, request, body)


def _serving(state: ServerState) -> bool:
    return state.scheduler.alive and not state.shutting_down


def _health(state: ServerState, ok: bool) -> dict[str, Any]:
    """`/health`'s body: status, model, routes, limits, load, kernels, memory and the prefix cache."""
    return {
        "status": "ok" if ok else "unavailable",
        "model": state.model_name,
        "routes": [r.to_dict() for r in state.config.routes],
        "max_model_len": state.max_model_len,
        "max_num_seqs": state.max_num_seqs,
        "running": state.scheduler.running,
        "waiting": state.scheduler.waiting,
        "threads": state.scheduler.torch_threads,
        "kernel_path": state.encoder.target.kernel_path,
        # the GGUF types the target's matrices came in (Q4_K, Q6_K...); empty for other sources
        "file_types": sorted(getattr(state.encoder.target.backend, "file_types", ())),
        "replica": state.replica,
        "memory": _memory_plan(state) | {"suffix_cache_bytes": {route: cache.nbytes for route, cache in _shared_caches(state)}},
        "prefix_cache": _prefix_cache(state),
    }


def _memory_plan(state: ServerState) -> dict[str, Any]:
    """The start-up memory plan, the KV cache actually allocated and the prefix cache's budget
    and what it holds now."""
    prefix = state.scheduler.engine.prefix_cache
    plan = state.memory.to_dict() | {"kv_allocated_bytes": state.scheduler.engine.cache.nbytes,
                                     "prefix_cache_budget_bytes": prefix.budget_bytes if prefix is not None else 0,
                                     "prefix_cache_held_bytes": prefix.nbytes if prefix is not None else 0}
    # What the plan adds up to, and what the process holds: the difference is the runtime's
    # own (Python, torch, the tokenizer, allocator slack; docs/server.md says how much).
    plan["plan_bytes"] = sum(plan[key] for key in ("target_weight_bytes", "draft_weight_bytes", "kv_allocated_bytes",
                                                   "prefix_cache_budget_bytes"))
    plan["resident_bytes"] = resident_bytes()
    return plan


def _prefix_cache(state: ServerState) -> dict[str, Any] | None:
    """What the prefix cache holds and has done (None: off)."""
    prefix = state.scheduler.engine.prefix_cache
    if prefix is None:
        return None
    return {"budget_bytes": prefix.budget_bytes, "bytes": prefix.nbytes, "blocks": len(prefix),
            "block_tokens": prefix.block, **asdict(prefix.stats)}


def _shared_caches(state: ServerState) -> list[tuple[str, CacheStats]]:
    """Each route's cache shared by its requests' drafters (the suffix drafter's earlier outputs)."""
    return [(route, cache) for route, d in state.scheduler.drafters.items() if d is not None and (cache := d.shared_cache()) is not None]


# --- streaming ------------------------------------------------------------------------------------

_DONE = "data: [DONE]\n\n"  # a stream's last event, as OpenAI ends theirs


def _sse(payload: dict[str, Any]) -> str:
    """One server-sent event: `payload` as JSON."""
    return f"data: {json.dumps(payload)}\n\n"


@dataclass(frozen=True)
class _Chunks:
    """A stream's chunks in OpenAI's format, each an SSE event with the response's id, created and
    model: chat's choices carry deltas, completions' carry text."""

    meta: dict[str, Any]
    chat: bool

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        """A chunk of `choices`, with `extra` fields (usage, at the end) beside them."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse(self.meta | {"object": obj, "choices": choices} | extra)

    def choice(self, index: int, text: str | None, finish: str | None, role: bool = False, logprobs: Any = None,
               tool_calls: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
        """One choice of a chunk. A chat delta holds only what is given (text None: no `content`);
        a completion's text is never null."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs, **extra}
        return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs, **extra}

    def role(self, index: int) -> str:
        """A chat choice's first chunk: the assistant's role, no text yet."""
        return self.chunk([self.choice(index, "", None, role=True)])

    def delta(self, index: int, text: str | None, logprobs: Any = None,
              tool_calls: list[dict[str, Any]] | None = None) -> str:
        """A chunk of what is new in one choice: text (with its logprobs) or tool-call deltas."""
        return self.chunk([self.choice(index, text, None, logprobs=logprobs, tool_calls=tool_calls)])

    def last(self, index: int, finish: str | None, stats: RequestStats | None) -> str:
        """A choice's last chunk: its finish_reason and `speculation` statistics, no text."""
        speculation = stats.to_dict() if stats else None
        return self.chunk([self.choice(index, None if self.chat else "", finish, speculation=speculation)])


class _Logprobs:
    """The logprobs of a stream's token chunks and, for completions, its echoed prompts (each
    choice's first chunk). A completion's logprobs give each token's `text_offset`: where it starts
    in the choice's text, echo included, in characters."""

    def __init__(self, chunks: _Chunks, shape: _Shape, echoes: list[tuple[list[int], str]] | None, n: int) -> None:
        self.chunks, self.shape, self.echoes = chunks, shape, echoes
        # Each choice's text so far, in characters: where its next token's text_offset starts.
        self.offsets = [len(text) for _, text in echoes] if echoes else [0] * n

    def echo(self, index: int, prompt_logprobs: list[TokenLogprob | None] | None) -> str:
        """Choice `index`'s echoed prompt as a chunk, with the prompt's logprobs when given."""
        ids, text = self.echoes[index]
        names = self.shape.names
        logprobs = completion_logprobs(prompt_logprobs, ids, names) if prompt_logprobs is not None else None
        return self.chunks.delta(index, text, logprobs)

    def tokens(self, index: int, event: Event) -> Any:
        """A "token" event's logprobs as its chunk carries them (None when not asked for). A
        completion's move its choice's text offset past the event's tokens."""
        if not self.shape.logprobs:
            return None
        if self.shape.chat:
            return chat_logprobs(list(event.logprobs), self.shape.names)
        out = completion_logprobs(list(event.logprobs), list(event.token_ids), self.shape.names, self.offsets[index])
        self.offsets[index] += sum(len(t) for t in out["tokens"])
        return out


@dataclass
class _ToolCalls:
    """How one choice's output streams when it may be tool calls. One constrained to calls
    (`scanner`) streams them as OpenAI does: each call's head, then its arguments' text as it
    comes. One that may call tools (auto) holds its text back while it may still be calls
    (`specdec.server.tools.may_be_calls`); calls it turns out to be go out whole at the end. Any
    other streams its text as it comes."""

    chunks: _Chunks
    shape: _Shape
    index: int
    scanner: CallScanner | None = None
    held: list[tuple[str, Any]] | None = None  # (text, logprobs) per chunk held back; None: none held, or sent

    @classmethod
    def of(cls, chunks: _Chunks, shape: _Shape, index: int) -> _ToolCalls:
        """Choice `index`'s, as the response's shape (its tools and tool_choice) has it."""
        scanner = CallScanner(id_seed=shape.call_seed(index)) if shape.calls_only else None
        return cls(chunks, shape, index, scanner, [] if shape.callable and not shape.calls_only else None)

    def calls(self, text: str) -> str | None:
        """The chunk of the call deltas that a constrained choice's new text makes, if any."""
        deltas = self.scanner.feed(text)
        return self.chunks.delta(self.index, None, tool_calls=deltas) if deltas else None

    def text(self, text: str, logprobs: Any, output: str) -> str | None:
        """The chunk of a token event's text, or None while it is held back (`output`: the choice's
        text so far, this event's included). The first text that cannot be calls releases it."""
        if self.held is None:
            return self.chunks.delta(self.index, text, logprobs)
        self.held.append((text, logprobs))
        return self.release() if not may_be_calls(output) else None

    def finish(self, output: str, reason: str | None) -> tuple[str | None, str | None]:
        """At the choice's end (`output`: its whole text): the chunk to send before its last one,
        if any (its calls, or the text it held), and its finish_reason, both as `_Shape.ending`
        decides them."""
        calls, finish = self.shape.ending(self.index, output, reason, self.scanner)
        if self.scanner is not None:
            return None, finish  # its calls went out as they came
        if calls:
            self.held = None
            deltas = [{"index": j} | call for j, call in enumerate(calls)]
            return self.chunks.delta(self.index, None, tool_calls=deltas), finish
        return self.release(), finish

    def release(self) -> str | None:
        """The held chunks as one (None when there are none); from then on the choice streams as it
        goes."""
        held, self.held = self.held or [], None
        if not held:
            return None
        logprobs = None
        if self.shape.logprobs:
            logprobs = {"content": [entry for _, lp in held for entry in lp["content"]], "refusal": None}
        return self.chunks.delta(self.index, "".join(text for text, _ in held), logprobs)


def _stream(job: _Job, meta: dict[str, Any], plan: _Plan, *, include_usage: bool) -> StreamingResponse:
    """SSE in OpenAI's chunk format, ending with `data: [DONE]`. Each choice's last chunk carries
    its finish_reason and `speculation` statistics; with include_usage a final chunk with no
    choices carries usage. Logprobs ride on the chunk of the tokens they belong to; an echoed
    prompt (completions) is each choice's first chunk. When the client disconnects, Starlette
    cancels this generator and its sequences are cancelled."""
    shape, n = plan.shape, len(job.requests)
    chunks = _Chunks(meta, shape.chat)
    logprobs = _Logprobs(chunks, shape, plan.echoes, n)
    tools = [_ToolCalls.of(chunks, shape, i) for i in range(n)]

    async def events() -> AsyncIterator[str]:
        results = [_Result() for _ in job.requests]
        pending = len(job.requests)
        try:
            if shape.chat:
                for i in range(n):
                    yield chunks.role(i)
            elif plan.echoes is not None and not shape.logprobs:  # with logprobs: at its "prompt" event
                for i in range(n):
                    yield logprobs.echo(i, None)
            while pending:
                event = await job.events.get()
                result, tool = results[event.index], tools[event.index]
                if event.kind == "prompt":
                    if plan.echoes is not None:
                        yield logprobs.echo(event.index, list(event.logprobs))
                elif event.kind == "token":
                    result.add(event, shape)
                    if tool.scanner is not None:
                        if out := tool.calls(event.text):
                            yield out
                    elif not shape.score_only and (event.text or (shape.logprobs and event.token_ids)):
                        if out := tool.text(event.text, logprobs.tokens(event.index, event), result.text):
                            yield out
                elif event.kind == "done":
                    result.finish_reason, result.stats = event.finish_reason, event.stats
                    pending -= 1
                    out, finish = tool.finish(result.text, event.finish_reason)
                    if out:
                        yield out
                    yield chunks.last(event.index, finish, event.stats)
                else:
                    pending -= 1
                    yield _sse(error_body(event.message, code="no_instance") if event.client else
                               error_body(event.message, type="server_error", code="generation_failed"))
            if include_usage:
                yield chunks.chunk([], **_totals(plan, results))
            yield _DONE
        finally:
            if pending:  # the client went away, or the server is stopping: free the sequences
                job.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
