"""llama.cpp's C++ programs as bench peers: the runner gives each program the prompt's text,
reads back its timings and its output (without the echoed prompt), and names a missing build.
Fake programs that print what llama.cpp's print stand in for the real ones (`make peers`)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from specdec.bench import llama_cpp
from specdec.errors import ConfigError

SPECULATIVE = '''#!/usr/bin/env python3
import sys
args = sys.argv[1:]
prompt = open(args[args.index("-f") + 1]).read()[:-1]  # as llama.cpp reads -f: the last newline dropped
open(sys.argv[0] + ".args", "w").write(" ".join(args))
sys.stdout.write("\\n\\n" + prompt + " world, again\\n\\n\\n\\n")
sys.stderr.write("encoded   12 tokens in    0.250 seconds, speed:   48.000 t/s\\n"
                 "decoded    4 tokens in    0.100 seconds, speed:   40.000 t/s\\n\\nn_draft   = 3\\n")
'''
COMPLETION = '''#!/usr/bin/env python3
import sys
sys.stdout.write(" world, again [end of text]\\n\\n\\n")
sys.stderr.write("0.25.281.452 I common_perf_print: prompt eval time =     250.00 ms /    12 tokens\\n"
                 "0.25.281.454 I common_perf_print:        eval time =      75.00 ms /     3 runs   (x)\\n")
'''


def _install(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def programs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _install(tmp_path, "llama-speculative-simple", SPECULATIVE)
    _install(tmp_path, "llama-completion", COMPLETION)
    monkeypatch.setenv("SPECDEC_LLAMA_CPP", str(tmp_path))
    return tmp_path


def _tokenize(text: str) -> list[int]:
    return [len(word) for word in text.split()]


def _detokenize(ids: list[int]) -> str:
    return " " + " ".join("x" * n for n in ids)


def test_a_draft_past_the_limit_is_cut_to_it(programs: Path) -> None:
    peer = llama_cpp.peers(None)[1]  # the fake program says " world, again": two tokens
    result = llama_cpp.cpp_runner(peer, "target.gguf", lambda prompt: "p", _tokenize, _detokenize, 1)([])
    assert result.token_ids == [6] and result.text == " xxxxxx"  # what the next turn sees


def test_the_draft_model_peer_gets_the_prompt_and_both_models(programs: Path) -> None:
    peer = next(p for p in llama_cpp.peers("draft.gguf") if "n-max 16" in p.name)
    run = llama_cpp.cpp_runner(peer, "target.gguf", lambda prompt: "<|im_start|>user\nhello\n", _tokenize, _detokenize, 64)
    result = run([{"role": "user", "content": "hello"}])
    assert result.text == " world, again"  # the echoed prompt (its own newline kept) is not output
    assert result.token_ids == [6, 5]
    assert result.decode == (4, 0.1) and result.seconds == pytest.approx(0.35) and not result.plain
    args = (programs / "llama-speculative-simple.args").read_text().split()
    for flag, value in (("-m", "target.gguf"), ("-md", "draft.gguf"), ("-n", "64"), ("--spec-draft-n-max", "16"),
                        ("--spec-draft-p-min", "0.75"), ("--temp", "0"), ("--spec-type", "draft-simple")):
        assert args[args.index(flag) + 1] == value


def test_plain_decoding_reads_llama_perf_lines(programs: Path) -> None:
    peer = llama_cpp.peers(None)[0]
    assert peer.plain and peer.program == "llama-completion"
    result = llama_cpp.cpp_runner(peer, "target.gguf", lambda prompt: "p", _tokenize, _detokenize, 64)([])
    assert result.text == " world, again" and result.decode == (3, 0.075) and result.plain


def test_without_a_draft_model_no_draft_model_peer() -> None:
    assert [p.name for p in llama_cpp.peers(None)] == ["llama.cpp plain", "llama.cpp n-gram"]
    assert len(llama_cpp.peers("d.gguf")) == 4


def test_a_missing_build_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_LLAMA_CPP", str(tmp_path))
    with pytest.raises(ConfigError, match="make peers"):
        llama_cpp.program("llama-completion")


def test_an_echo_that_is_not_the_prompt_is_an_error(programs: Path) -> None:
    peer = llama_cpp.peers(None)[1]
    with pytest.raises(RuntimeError, match="echo"):
        llama_cpp.generated_text(peer, "\n\nsomething else entirely\n\n\n\n", "the prompt")


def test_output_without_timings_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no timings"):
        llama_cpp.parse_timings(llama_cpp.peers(None)[1], "error: model not found")
