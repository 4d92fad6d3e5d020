"""llama.cpp's own C++ programs as `bench` peers, on the same GGUF files and prompts: plain
decoding (`llama-completion`), speculative decoding with a draft model and n-gram drafting
(`llama-speculative-simple`). `make peers` builds them from the llama.cpp that llama-cpp-python's
source package vendors, into specdec's cache.

Each prompt is one run of the program (its model load is not timed: the rates are the ones the
program reports for its own prompt evaluation and decoding). The program tokenizes the prompt
text itself, parsing special tokens, so it sees the tokens specdec's template made; its output
text is tokenized with specdec's tokenizer for the identity check against its plain decoding.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.runner import RunResult, Runner
from specdec.errors import ConfigError
from specdec.models.prompts import Prompt
from specdec.paths import cache_dir

VERSION = "0.3.36"  # llama-cpp-python's source package whose vendored llama.cpp `make peers` builds
PROGRAMS = ("llama-completion", "llama-speculative-simple", "llama-bench")
CONTEXT = 4096


def tools_dir() -> Path:
    """Where `make peers` puts llama.cpp's programs (`$SPECDEC_LLAMA_CPP` overrides)."""
    if "SPECDEC_LLAMA_CPP" in os.environ:
        return Path(os.environ["SPECDEC_LLAMA_CPP"])
    return cache_dir() / f"llama.cpp-{VERSION}" / "bin"


def program(name: str) -> Path:
    """The path of one of llama.cpp's programs; a clear error when it is not built."""
    path = tools_dir() / name
    if not os.access(path, os.X_OK):
        raise ConfigError(f"llama.cpp's {name} is not at {path}: `make peers` builds it")
    return path


def build_info() -> str:
    """The build the peers run: llama.cpp's version line and the CPU features it was built for."""
    done = subprocess.run([str(program("llama-completion")), "--version"], capture_output=True, text=True, timeout=60)
    version = " ".join((done.stdout + done.stderr).split())
    return f"llama.cpp C++ from llama-cpp-python {VERSION}'s source: {version}"


@dataclass(frozen=True)
class Peer:
    """One llama.cpp configuration: the program, its arguments beyond model, prompt and length,
    and whether it decodes plainly."""

    name: str
    program: str
    args: tuple[str, ...] = ()
    plain: bool = False


def peers(draft_gguf: str | None) -> list[Peer]:
    """llama.cpp's plain decoding, its n-gram drafting, and with a draft model its speculative
    decoding at its defaults (at most 3 drafted, no probability floor) and at its best settings
    on CPUs (at most 16, stopping below 0.75)."""
    out = [
        Peer("llama.cpp plain", "llama-completion", ("-no-cnv", "--no-display-prompt"), plain=True),
        Peer("llama.cpp n-gram", "llama-speculative-simple", ("--spec-type", "ngram-simple")),
    ]
    if draft_gguf is not None:
        for n_max, p_min in ((3, 0.0), (16, 0.75)):
            out.append(Peer(f"llama.cpp draft model n-max {n_max} p-min {p_min:g}", "llama-speculative-simple",
                            ("-md", draft_gguf, "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max),
                             "--spec-draft-p-min", str(p_min), "-td", str(_threads()))))
    return out


def _threads() -> int:
    return len(os.sched_getaffinity(0))


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_EVAL = re.compile(r"_perf_\w*print:\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs")
_PROMPT_EVAL = re.compile(r"_perf_\w*print: prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens")


def parse_timings(peer: Peer, stderr: str) -> tuple[float, int, float]:
    """(prompt seconds, tokens decoded, decoding seconds) from what the program printed."""
    if peer.plain:
        prompt, decoded = _PROMPT_EVAL.findall(stderr), _EVAL.findall(stderr)
        if not prompt or not decoded:
            raise RuntimeError(f"{peer.name}: no timings in its output:\n{stderr[-2000:]}")
        (prompt_ms, _), (eval_ms, runs) = prompt[-1], decoded[-1]
        return float(prompt_ms) / 1e3, int(runs), float(eval_ms) / 1e3
    encoded, decoded = _ENCODED.findall(stderr), _DECODED.findall(stderr)
    if not encoded or not decoded:
        raise RuntimeError(f"{peer.name}: no timings in its output:\n{stderr[-2000:]}")
    return float(encoded[-1][1]), int(decoded[-1][0]), float(decoded[-1][1])


def generated_text(peer: Peer, stdout: str, prompt_text: str) -> str:
    """The generated text alone: llama-speculative-simple echoes the prompt first, and
    llama-completion marks an end of generation."""
    text = stdout
    if not peer.plain:
        text = text.removeprefix("\n\n")
        if not text.startswith(prompt_text):
            raise RuntimeError(f"{peer.name}: its echo of the prompt differs from the prompt")
        return text[len(prompt_text) :].removesuffix("\n\n\n\n")  # its two closing blank lines
    return text.removesuffix("\n\n").removesuffix(" [end of text]\n")


def cpp_runner(peer: Peer, gguf: str, text_of: Callable[[Prompt], str], tokenize: Callable[[str], list[int]],
               detokenize: Callable[[list[int]], str], max_tokens: int, extra_args: Sequence[str] = ()) -> Runner:
    """Runs `peer` greedily on each prompt; `text_of` renders a prompt as specdec's template
    tokens (special tokens as text), `tokenize` reads the output back into token ids. A
    speculative program may commit a whole draft past the length limit: its output is cut to
    `max_tokens` tokens (so a next turn sees what plain decoding would have said)."""
    binary = str(program(peer.program))

    def run(prompt: Prompt) -> RunResult:
        text = text_of(prompt)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as file:
            file.write(text + "\n")  # the program drops a file's last newline: the prompt keeps its own
            file.flush()
            command = [binary, "-m", gguf, "-f", file.name, "-n", str(max_tokens), "-t", str(_threads()),
                       "-c", str(CONTEXT), "--temp", "0", "--top-k", "1", "-s", "0", *peer.args, *extra_args]
            done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{peer.name} failed (exit code {done.returncode}): {done.stderr[-2000:]}")
        prompt_s, decoded, decode_s = parse_timings(peer, done.stderr)
        out = generated_text(peer, done.stdout, text)
        ids = tokenize(out)
        if len(ids) > max_tokens:
            ids = ids[:max_tokens]
            out = detokenize(ids)
        return RunResult(ids, out, prompt_s + decode_s, plain=peer.plain, decode=(decoded, decode_s))

    return run
