"""The `specdec` command as a user runs it, on the real model: one-line errors, generation and
costs. Two tests run it as a real process; the rest run its `main()` in this process
(`run_cli`: the same exit status, stdout and stderr, without a Python start-up and model load
per command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import kernels
from tests.conftest import CliRun, _tiny_llama, small_vocab_tokenizer

SPECDEC = [sys.executable, "-m", "specdec.cli.main"]
pytestmark = pytest.mark.real  # every test here runs the real model (some in a subprocess)


@pytest.fixture(scope="module")
def other_vocabulary_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a 64-word vocabulary of its own, saved as a Hugging Face directory:
    a draft model whose tokens are not the default model's (Gemma's own mismatch with SmolLM2,
    a 262k vocabulary, is checked in process by tests/models/test_loader.py)."""
    path = tmp_path_factory.mktemp("other-vocab")
    tokenizer = small_vocab_tokenizer(64)
    _tiny_llama(64, seed=3, eos=63).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SPECDEC, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "hi", "--method", "bogus"], "unknown speculative method 'bogus'"),
        (["generate", "hi", "--model", "/no/such/model.gguf"], "model path does not exist"),
        (["generate", "hi", "-k", "0"], "num_speculative_tokens must be an integer >= 1"),
        (
            ["generate", "hi", "--speculative-config", '{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}'],
            "prompt_lookup_min (5) must be <= prompt_lookup_max (2)",
        ),
        (["generate", "hi", "--speculative-config", "{method: ngram"], "not valid JSON"),
        (["generate", "hi", "--method", "draft_model"], "needs a draft model"),
        (["bench", "--data", "/no/such/file.jsonl"], "data file not found"),
        (["bench", "--data", str(Path(__file__).parent)], "is a directory, not a data file"),
        (["serve", "--config", str(Path(__file__).parent / "no_routes.toml")], "needs a [routes.NAME] table for each served model name"),
    ],
)
def test_bad_input_is_one_line_error(run_cli: CliRun, args: list[str], message: str) -> None:
    code, _, stderr = run_cli(*args)
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]


def test_bad_input_in_a_real_process_is_one_line_and_exit_2() -> None:
    result = run("generate", "hi", "--method", "bogus")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: unknown speculative method 'bogus'; choose one of: " + result.stderr.split("choose one of: ")[1].strip()]


def test_draft_with_other_vocabulary_is_refused(run_cli: CliRun, other_vocabulary_dir: Path) -> None:
    code, _, stderr = run_cli("generate", "hi", "--method", "draft_model", "--draft-model", str(other_vocabulary_dir))
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert "cannot draft for SmolLM2-135M-Instruct" in stderr
    assert "logit sizes differ: target 49152, draft 64" in stderr


def test_generate_streams_text_and_reports_stats() -> None:
    result = run("generate", "List the numbers from one to ten, separated by commas.", "--max-tokens", "24", "--stats")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # the text
    stats = json.loads(result.stderr[result.stderr.index("{") :])
    assert stats["generated_tokens"] == 24 or stats["generated_tokens"] < 24  # EOS may end it first
    assert stats["target_forward_passes"] <= stats["generated_tokens"] + 1
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert "ngram k=4" in result.stderr


def test_generate_plain_and_speculative_print_the_same_text(run_cli: CliRun) -> None:
    prompt = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
    plain = run_cli("generate", prompt, "--method", "none", "--max-tokens", "32", "--no-stream")
    spec = run_cli("generate", prompt, "--method", "ngram", "-k", "6", "--max-tokens", "32")
    assert plain[0] == 0 and spec[0] == 0, plain[2] + spec[2]
    assert plain[1] == spec[1]
    assert plain[1].strip()


def test_generate_at_a_tiny_temperature_is_greedy(run_cli: CliRun) -> None:
    prompt = "Name three colours."
    greedy = run_cli("generate", prompt, "--max-tokens", "12", "--no-stream")
    tiny = run_cli("generate", prompt, "--max-tokens", "12", "--no-stream", "--temperature", "1e-38", "--seed", "3")
    assert tiny[0] == 0 and "Traceback" not in tiny[2], tiny[2]
    assert tiny[1] == greedy[1] and tiny[1].strip()


def test_costs_prints_a_ratio_per_size_and_format(run_cli: CliRun, tmp_path) -> None:
    path = tmp_path / "costs.json"
    code, stdout, stderr = run_cli("costs", "--max-verified", "3", "--repeats", "2", "--context", "16", "--prefill", "24",
                                   "--format", "native:auto", "--format", "hf:float32", "--json", str(path))
    assert code == 0, stderr
    rows = [line for line in stdout.splitlines() if line.strip().startswith("│")]
    assert len(rows) == 3 + 1  # three pass sizes, then the prefill table's one length
    cells = rows[0].split("│")
    assert cells[3].strip().endswith("(1.00)") and cells[4].strip().endswith("(1.00)")  # a plain step costs itself
    data = json.loads(path.read_text())
    curves = data["curves"]
    assert list(curves) == ["native q4 (LM head q8)", "hf float32"]
    # What ran the products, and on which CPU: the kernels' path on native, PyTorch on hf.
    native = kernels.default_isa() if kernels.available() else "pytorch"
    assert [c["kernel_path"] for c in curves.values()] == [native, "pytorch"]
    assert data["cpu"] and f"native q4 (LM head q8): {native}" in " ".join(stdout.split())
    assert all(c["cost_over_plain_step"]["1"] == 1.0 and len(c["seconds"]) == 3 for c in curves.values())
    assert all(list(c["prefill_tokens_per_s"]) == ["24"] and c["prefill_tokens_per_s"]["24"] > 0 for c in curves.values())
