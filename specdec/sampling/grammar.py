"""Structured outputs: a grammar that masks the target's logits, exact under speculation.

A request's :class:`~specdec.sampling.params.StructuredOutput` (a JSON schema, any JSON object,
a regular expression or an EBNF grammar) compiles once per tokenizer into xgrammar's token-level
automaton. A :class:`Constraint` holds one request's state: the grammar after its committed
output. A verification pass scores several positions, each after a different path of drafted
tokens (a chain's prefixes, a tree node's ancestors); :meth:`Constraint.mask` walks the matcher
along each path, fills that position's allowed-token bitmask, and rolls back, so every position
is masked exactly as plain decoding would mask it at the same point. Tokens outside the mask get
-inf: greedy output is token-identical to plain constrained decoding, and sampled output follows
the masked target's distribution.

A path through a token the grammar forbids is never reached (the position before it gives that
token probability 0), nor is one past the model's EOS, so their masks allow everything: no row
becomes all -inf.

xgrammar is optional here (its wheel pulls a GPU compiler that the CPU path never uses; the
Makefile installs it without): without it, a request with a structured output is refused with a
message that says how to install it.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ConfigError, SpecDecError
from specdec.sampling.params import StructuredOutput
from specdec.sampling.schema import check_schema

try:
    import xgrammar

    from specdec.sampling import grammar_worker
except ImportError:  # pragma: no cover - the Makefile installs it
    xgrammar = grammar_worker = None

INSTALL_HINT = "structured outputs need xgrammar: pip install --no-deps xgrammar apache-tvm-ffi"
# xgrammar's errors start with a time and its C++ source's path and line: not the client's business.
_SOURCE_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


def _source(structured: StructuredOutput) -> str:
    """The text xgrammar compiles: a JSON schema checked first (:func:`~specdec.sampling.schema.check_schema`)."""
    if structured.kind != "json":
        return structured.spec
    schema = structured.spec or json.dumps({"type": "object"})
    try:
        parsed = json.loads(schema)
    except (ValueError, RecursionError):
        raise ConfigError("the JSON schema is not JSON, or is nested too deep to read") from None
    return json.dumps(check_schema(parsed))


def check_nonempty(structured: StructuredOutput, compiled, vocab_size: int) -> None:
    """Refuse a grammar that no output can follow: complete with nothing, or allowing no first
    token (a regex such as `[^\\s\\S]`, a grammar whose rules never end). Such a spec would
    otherwise reach generation and fail there, as the server's error rather than the client's."""
    if Constraint(xgrammar.GrammarMatcher(compiled), vocab_size).dead_end():  # before any output
        raise ConfigError(f"the {structured.what} has no instance: no output can follow it")


def _compile_error(structured: StructuredOutput, message: str) -> ConfigError:
    reason = _SOURCE_PREFIX.sub("", message.strip().splitlines()[-1] if message.strip() else "unknown error")
    return ConfigError(f"the {structured.what} does not compile: {reason}")


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer and vocabulary, keeping the compiled grammars
    by spec (least recently used first out past `cache_bytes`).

    stop_ids: the tokens that end the output once the grammar is complete (the model's EOS).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: frozenset[int], cache_bytes: int = 256 << 20) -> None:
        if xgrammar is None:
            raise ConfigError(INSTALL_HINT)
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                           stop_token_ids=sorted(stop_ids))
        self._compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_bytes, self._held = cache_bytes, 0
        self._lock = threading.Lock()  # the cache is shared by the server's threads

    def cached(self, structured: StructuredOutput):
        """The compiled grammar if it is held, else None."""
        with self._lock:
            compiled = self._compiled.get((structured.kind, structured.spec))
            if compiled is not None:
                self._compiled.move_to_end((structured.kind, structured.spec))
            return compiled

    def adopt(self, structured: StructuredOutput, compiled) -> None:
        """Hold a grammar compiled elsewhere (:class:`IsolatedCompiler`'s child) for this spec."""
        with self._lock:
            key = (structured.kind, structured.spec)
            if key in self._compiled:
                return
            self._compiled[key] = compiled
            self._held += compiled.memory_size_bytes
            while self._held > self._cache_bytes and len(self._compiled) > 1:
                _, old = self._compiled.popitem(last=False)
                self._held -= old.memory_size_bytes

    def compile(self, structured: StructuredOutput):
        """The compiled grammar; ConfigError saying what is wrong with a spec that does not compile."""
        compiled = self.cached(structured)
        if compiled is not None:
            return compiled
        source = _source(structured)
        try:
            compiled = grammar_worker.compile_spec(self._compiler, structured.kind, source)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _compile_error(structured, str(exc)) from None
        check_nonempty(structured, compiled, self.vocab_size)
        self.adopt(structured, compiled)
        return compiled

    def constraint(self, structured: StructuredOutput, compiled=None) -> Constraint:
        """A fresh state for one request (before its first output token); `compiled`: the spec's
        grammar where the caller compiled it (a server's :class:`IsolatedCompiler`)."""
        return Constraint(xgrammar.GrammarMatcher(compiled or self.compile(structured)), self.vocab_size, self.stop_ids)


def _int32(value: int) -> int:
    """A 32-bit word's bits as the signed int32 a bitmask tensor holds."""
    return value - (1 << 32) if value >= 1 << 31 else value


def xgrammar_installed() -> bool:
    return xgrammar is not None


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiler_for(tokenizer, vocab_size: int, stop_ids: frozenset[int]) -> GrammarCompiler:
    """The compiler of a tokenizer, built once (its vocabulary scan is the costly part) and shared
    by every engine and server thread that uses that tokenizer object."""
    key = (vocab_size, stop_ids)
    per_tokenizer = _compilers.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        per_tokenizer[key] = GrammarCompiler(tokenizer, vocab_size, stop_ids)
    return per_tokenizer[key]


class GrammarCompilerError(SpecDecError):
    """The child that compiles grammars died (not the spec's fault): the server's 503."""


class IsolatedCompiler:
    """Compiles for a server: in a child process (:mod:`specdec.sampling.grammar_worker`), one spec
    at a time, within `timeout_s` of the caller's wait (the child's start-up included, should it
    be starting) and `max_bytes` of compiled grammar. The child starts with the server
    (:meth:`start`); one that passes the deadline or compiles too large a grammar is killed, its
    memory freed, and a new one started at once for the next spec. What compiles is adopted by
    `compiler`, whose cache the engine reads, so a spec is compiled once. A spec that does not
    compile, compiles too slowly or too large is a ConfigError that says which; a child that dies
    while compiling is a GrammarCompilerError.
    """

    def __init__(self, compiler: GrammarCompiler, timeout_s: float, max_bytes: int) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._child: subprocess.Popen | None = None
        self._ready = False  # whether the child has said it is ready
        self._lock = threading.Lock()
        self._info: str | None = None

    def start(self) -> None:
        """Start the child without waiting for it (it reads the vocabulary while the server starts)."""
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                self._spawn()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the child has started (True), or `timeout_s` passes (False)."""
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                self._spawn()
            if not self._ready:
                self._ready = self._receive(self._child, timeout_s) is not None
            return self._ready

    def compile(self, structured: StructuredOutput):
        """The compiled grammar (also adopted by `compiler`)."""
        if (compiled := self.compiler.cached(structured)) is not None:
            return compiled
        source = _source(structured)
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            if (compiled := self.compiler.cached(structured)) is not None:  # compiled while this one waited
                return compiled
            if self._child is None or self._child.poll() is not None:
                self._spawn()
            child = self._child
            if not self._ready:
                if self._receive(child, deadline - time.monotonic()) is None:
                    self._failed(child, structured, "starting")
                self._ready = True
            try:
                child.stdin.write(grammar_worker.frame({"kind": structured.kind, "spec": source}))
                child.stdin.flush()
            except BrokenPipeError:  # the child died since: no reply will come
                child.wait()
                self._failed(child, structured, "waiting for a spec")
            reply = self._receive(child, deadline - time.monotonic())
            if reply is None:
                self._failed(child, structured, "compiling")
            if "too_big" in reply:
                self._restart()  # the child holds the grammar's memory until it is gone
        if "error" in reply:
            raise _compile_error(structured, reply["error"])
        if "too_big" in reply:
            raise ConfigError(f"the {structured.what} compiles to {reply['too_big'] / (1 << 20):.0f} MiB, more than "
                              f"the server's {self.max_bytes / (1 << 20):g} MiB (max_grammar_mb): give a smaller one")
        compiled = xgrammar.CompiledGrammar.deserialize_json(reply["grammar"], self.compiler.info)
        check_nonempty(structured, compiled, self.compiler.vocab_size)
        self.compiler.adopt(structured, compiled)
        return compiled

    def _failed(self, child: subprocess.Popen, structured: StructuredOutput, doing: str) -> None:
        """No reply by the deadline: a child that died is named as such, a live one was too slow."""
        code = child.poll()
        self._restart()
        if code is not None:
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            raise GrammarCompilerError(f"the grammar compiler stopped ({how}) while {doing}; a new one has started: "
                                       "send the request again")
        raise ConfigError(f"the {structured.what} took longer than {self.timeout_s:g} s to compile (the server's "
                          "grammar_timeout_s, the compiler's start-up included): give a smaller one")

    def _spawn(self) -> None:
        if self._info is None:
            self._info = self.compiler.info.serialize_json()
        child = subprocess.Popen([sys.executable, str(Path(grammar_worker.__file__))], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        child.stdin.write(grammar_worker.frame({"info": self._info, "max_bytes": self.max_bytes}))
        child.stdin.flush()
        self._child, self._ready = child, False

    def _restart(self) -> None:
        self._stop()
        self._spawn()

    @staticmethod
    def _receive(child: subprocess.Popen, timeout_s: float) -> Any | None:
        """The child's next frame, or None when it is not all there by the deadline (or the child died)."""
        deadline = time.monotonic() + timeout_s
        fd = child.stdout.fileno()
        data = bytearray()
        need = grammar_worker.HEADER.size
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while len(data) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(fd, max(need - len(data), 1 << 16))
                if not chunk:
                    child.wait()  # closed: the child is gone (its exit code says how)
                    return None
                data += chunk
                if need == grammar_worker.HEADER.size and len(data) >= need:
                    need += grammar_worker.HEADER.unpack(data[: grammar_worker.HEADER.size])[0]
        return json.loads(bytes(data[grammar_worker.HEADER.size : need]))

    @property
    def pid(self) -> int | None:
        """The child's process id (None before it starts)."""
        return self._child.pid if self._child is not None else None

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None

    def close(self) -> None:
        """Stop the child (the server's shutdown)."""
        with self._lock:
            self._stop()


class Constraint:
    """One request's grammar state after its committed output tokens.

    A dead end, a position where the grammar allows no token though it is not complete (a rule
    that never ends, say `a[^\\s\\S]` after its "a"), allows only the stop tokens: the output
    ends there, the same with or without speculation, and :attr:`dead_end` says so once an EOS
    is committed before the grammar was complete.
    """

    def __init__(self, matcher, vocab_size: int, stop_ids: frozenset[int] = frozenset()) -> None:
        self._matcher = matcher  # xgrammar.GrammarMatcher, rollback unbounded
        self.vocab_size = vocab_size
        self._stop_words = [(token // 32, _int32(1 << (token % 32))) for token in sorted(stop_ids) if token < vocab_size]

    def allowed_prefix(self, draft: list[int]) -> int:
        """How many leading tokens of a chain draft the grammar allows after the committed output."""
        accepted = 0
        for token in draft:
            if not self._matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def mask(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """logits: [n, vocab] float32, the target's at n positions; paths[j]: the uncommitted
        tokens between the committed output and position j (parents before children, as
        :func:`~specdec.sampling.penalties.chain_paths` and `tree_paths` give them). Masks in place
        (forbidden tokens -inf) and returns logits."""
        n = logits.shape[0]
        if len(paths) != n:
            raise ValueError(f"need one path per position: {n} positions, {len(paths)} paths")
        bitmask = xgrammar.allocate_token_bitmask(n, self.vocab_size)  # [n, words], all allowed
        walked: list[int] = []  # tokens accepted past the committed output
        for j, path in enumerate(paths):
            common = 0
            while common < min(len(walked), len(path)) and walked[common] == path[common]:
                common += 1
            if len(walked) > common:
                self._matcher.rollback(len(walked) - common)
                del walked[common:]
            for token in path[common:]:
                if not self._matcher.accept_token(token):
                    break
                walked.append(token)
            if len(walked) == len(path) and not self._matcher.is_terminated():  # past EOS: never reached
                self._matcher.fill_next_token_bitmask(bitmask, j)
                if not bool(bitmask[j].any()):  # a dead end: only a stop token may follow
                    for word, bit in self._stop_words:
                        bitmask[j, word] |= bit
        if walked:
            self._matcher.rollback(len(walked))
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        return logits

    def advance(self, tokens: list[int]) -> None:
        """Committed output tokens (each chosen under this constraint's mask)."""
        for token in tokens:
            if not self._matcher.accept_token(token):
                raise RuntimeError(f"token {token} was committed against the grammar")

    def dead_end(self) -> bool:
        """Whether the output so far ends at a dead end: nothing but a stop token may follow it."""
        if self._matcher.is_completed() or self._matcher.is_terminated():
            return False
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        return not bool(bitmask.any())

    @property
    def complete(self) -> bool:
        """Whether the output so far is a whole sentence of the grammar."""
        return self._matcher.is_completed()
