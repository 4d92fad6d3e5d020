"""Structured outputs compiled in a child process, so that a compile has a deadline (the child is
killed at it, and its memory with it) and a size limit, and runs on no thread that serves others.

`compile_spec` is the one way specdec compiles a spec, in-process
(:class:`specdec.sampling.grammar.GrammarCompiler`) and here. Run as a script
(`python grammar_worker.py`), this file imports no specdec module: it reads frames from stdin
and writes frames to stdout, each an 8-byte little-endian length and a JSON body.

1. in: {"info": TokenizerInfo JSON, "max_bytes": n}; out: {"ready": true}
2. then per spec, in: {"kind": "json" | "regex" | "grammar", "spec": text}; out: {"grammar":
   CompiledGrammar JSON}, {"error": message} or {"too_big": bytes} (its memory past max_bytes).
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Any, BinaryIO

import xgrammar

HEADER = struct.Struct("<Q")


def compile_spec(compiler: xgrammar.GrammarCompiler, kind: str, spec: str) -> xgrammar.CompiledGrammar:
    if kind == "json":
        # Compact JSON (no free whitespace): a small model let loose on whitespace can fill its
        # budget with newlines inside a valid document.
        return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_grammar(spec)


def frame(message: Any) -> bytes:
    body = json.dumps(message).encode()
    return HEADER.pack(len(body)) + body


def _read(stream: BinaryIO) -> Any | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None  # the parent closed the pipe
    return json.loads(stream.read(HEADER.unpack(head)[0]))


def main() -> None:
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    setup = _read(source)
    if setup is None:
        return
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(setup["info"]), max_threads=1,
                                        cache_enabled=False)
    sink.write(frame({"ready": True}))
    sink.flush()
    while (request := _read(source)) is not None:
        try:
            compiled = compile_spec(compiler, request["kind"], request["spec"])
        except (RuntimeError, ValueError, TypeError) as exc:
            reply = {"error": str(exc)}
        else:
            size = compiled.memory_size_bytes
            reply = {"too_big": size} if size > setup["max_bytes"] else {"grammar": compiled.serialize_json()}
        sink.write(frame(reply))
        sink.flush()


if __name__ == "__main__":
    main()
