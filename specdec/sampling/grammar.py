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

from specdec.errors import ConfigError
from specdec.sampling.params import StructuredOutput

try:
    import xgrammar

    from specdec.sampling import grammar_worker
except ImportError:  # pragma: no cover - the Makefile installs it
    xgrammar = grammar_worker = None

INSTALL_HINT = "structured outputs need xgrammar: pip install --no-deps xgrammar apache-tvm-ffi"
# xgrammar's errors start with a time and its C++ source's path and line: not the client's business.
_SOURCE_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


def _pointer(schema: Any, ref: str) -> Any:
    """The node a local `$ref` ("#/$defs/name") names, or None."""
    node = schema
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check_schema(schema: Any) -> None:
    """Refuse what the grammar would not enforce: a `$ref` outside the schema (a URL, a file: left
    unconstrained), and a schema with no finite instance (a required `$ref` recursion that never
    ends: the output could never be complete). ConfigError saying which."""
    refs: set[str] = set()

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                if not ref.startswith("#"):
                    raise ConfigError(f"the JSON schema's $ref {ref!r} points outside the schema: only local "
                                      "references (#/...) are enforced")
                refs.add(ref)
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(schema)
    # Which references have a finite instance: the least fixpoint, from none, of "a node has one
    # when what it requires has one" (required properties, a non-empty array's items, one branch
    # of anyOf/oneOf, every one of allOf, the target of its $ref).
    targets = {ref: _pointer(schema, ref) for ref in refs}
    finite = {ref for ref, target in targets.items() if target is None}  # a missing target: xgrammar says so

    def has_instance(node: Any) -> bool:
        if not isinstance(node, dict):
            return node is not False
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in finite:
            return False
        if any(not has_instance(b) for b in node.get("allOf", []) if isinstance(node.get("allOf"), list)):
            return False
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches and not any(has_instance(b) for b in branches):
                return False
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if any(name in properties and not has_instance(properties[name]) for name in required):
            return False
        items, least = node.get("items"), node.get("minItems", 0)
        return not (isinstance(least, int) and least > 0 and items is not None and not has_instance(items))

    changed = True
    while changed:
        changed = False
        for ref in refs - finite:
            if has_instance(targets[ref]):
                finite.add(ref)
                changed = True
    if not has_instance(schema):
        raise ConfigError("the JSON schema has no finite instance: a required $ref recursion never ends")


_WHAT = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}


def _source(structured: StructuredOutput) -> str:
    """The text xgrammar compiles, checked first where specdec checks more than xgrammar does (a
    JSON schema's references and finiteness)."""
    if structured.kind != "json":
        return structured.spec
    schema = structured.spec or json.dumps({"type": "object"})
    try:
        parsed = json.loads(schema)
    except ValueError:
        parsed = None  # xgrammar says what is wrong with it
    if parsed is not None:
        check_schema(parsed)
    return schema


def _compile_error(structured: StructuredOutput, message: str) -> ConfigError:
    reason = _SOURCE_PREFIX.sub("", message.strip().splitlines()[-1] if message.strip() else "unknown error")
    return ConfigError(f"the {_WHAT[structured.kind]} does not compile: {reason}")


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer and vocabulary, keeping the compiled grammars
    by spec (least recently used first out past `cache_bytes`).

    stop_ids: the tokens that end the output once the grammar is complete (the model's EOS).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: frozenset[int], cache_bytes: int = 256 << 20) -> None:
        if xgrammar is None:
            raise ConfigError(INSTALL_HINT)
        self.vocab_size = vocab_size
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
        self.adopt(structured, compiled)
        return compiled

    def constraint(self, structured: StructuredOutput, compiled=None) -> Constraint:
        """A fresh state for one request (before its first output token); `compiled`: the spec's
        grammar where the caller compiled it (a server's :class:`IsolatedCompiler`)."""
        return Constraint(xgrammar.GrammarMatcher(compiled or self.compile(structured)), self.vocab_size)


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


class IsolatedCompiler:
    """Compiles for a server: in a child process (:mod:`specdec.sampling.grammar_worker`), one spec
    at a time, within `timeout_s` (the child is killed at the deadline, its memory freed, and a
    new one started for the next spec) and `max_bytes` of compiled grammar. What compiles is
    adopted by `compiler`, whose cache the engine reads, so a spec is compiled once. A spec that
    does not compile, compiles too slowly or too large is a ConfigError that says which.
    """

    READY_TIMEOUT_S = 120.0  # the child's start (importing xgrammar, reading the vocabulary)

    def __init__(self, compiler: GrammarCompiler, timeout_s: float, max_bytes: int) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._info: str | None = None

    def compile(self, structured: StructuredOutput):
        """The compiled grammar (also adopted by `compiler`)."""
        if (compiled := self.compiler.cached(structured)) is not None:
            return compiled
        source = _source(structured)
        with self._lock:
            if (compiled := self.compiler.cached(structured)) is not None:  # compiled while this one waited
                return compiled
            child = self._ready_child()
            child.stdin.write(grammar_worker.frame({"kind": structured.kind, "spec": source}))
            child.stdin.flush()
            reply = self._receive(child, self.timeout_s)
            if reply is None:
                self._stop()
                raise ConfigError(f"the {_WHAT[structured.kind]} took longer than {self.timeout_s:g} s to compile "
                                  "(the server's grammar_timeout_s): give a smaller one")
        if "error" in reply:
            raise _compile_error(structured, reply["error"])
        if "too_big" in reply:
            raise ConfigError(f"the {_WHAT[structured.kind]} compiles to {reply['too_big'] / (1 << 20):.0f} MiB, more than "
                              f"the server's {self.max_bytes / (1 << 20):g} MiB (max_grammar_mb): give a smaller one")
        compiled = xgrammar.CompiledGrammar.deserialize_json(reply["grammar"], self.compiler.info)
        self.compiler.adopt(structured, compiled)
        return compiled

    def _ready_child(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        if self._info is None:
            self._info = self.compiler.info.serialize_json()
        child = subprocess.Popen([sys.executable, str(Path(grammar_worker.__file__))], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._child = child
        child.stdin.write(grammar_worker.frame({"info": self._info, "max_bytes": self.max_bytes}))
        child.stdin.flush()
        if self._receive(child, self.READY_TIMEOUT_S) is None:
            self._stop()
            raise ConfigError("the grammar compiler did not start")
        return child

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
                    return None
                data += chunk
                if need == grammar_worker.HEADER.size and len(data) >= need:
                    need += grammar_worker.HEADER.unpack(data[: grammar_worker.HEADER.size])[0]
        return json.loads(bytes(data[grammar_worker.HEADER.size : need]))

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
    """One request's grammar state after its committed output tokens."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher  # xgrammar.GrammarMatcher, rollback unbounded
        self.vocab_size = vocab_size

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
        if walked:
            self._matcher.rollback(len(walked))
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        return logits

    def advance(self, tokens: list[int]) -> None:
        """Committed output tokens (each chosen under this constraint's mask)."""
        for token in tokens:
            if not self._matcher.accept_token(token):
                raise RuntimeError(f"token {token} was committed against the grammar")

    @property
    def complete(self) -> bool:
        """Whether the output so far is a whole sentence of the grammar."""
        return self._matcher.is_completed()
