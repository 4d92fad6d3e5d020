"""`specdec train-draft` as a user runs it: answers, training, a head the other commands load,
and a resumed run; refusals for what cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import CliRun
from tests.server.test_cli_serve import cli_env


def _train(run_cli_tiny: CliRun, model_dir: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli_tiny("train-draft", "--model", str(model_dir), "--backend", "native", "--answers", "0",
                   "--code-prompts", "6", "--answer-tokens", "12", "--draft-vocab", "256", "--out", str(out), *extra)


def test_train_then_draft_with_the_head(run_cli_tiny: CliRun, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "head"
    code, stdout, stderr = _train(run_cli_tiny, tiny_model_dir, out, "--max-tokens", "200")
    assert code == 0, stderr
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    # Six code prompts; one longer than the answering limit in this tokenizer would be skipped.
    assert 4 <= len(answers) <= 6 and all(a["id"].startswith("stdlib/") and a["answer_ids"] for a in answers)
    assert f"{len(answers)} answers (" in stderr
    report = json.loads((out / "report.json").read_text())
    assert report["tokens"] >= 200
    # 3% of the answers are held out by a hash of their ids: of 6, maybe none. Either way the run says which.
    held_out = report["validation_sequences"] > 0
    assert ("validation top-1 agreement per draft position (answer tokens)" in stdout) == held_out
    assert ("no held-out answers" in stdout) == (not held_out)
    assert (len(report["validation_agreement"]) == 3) if held_out else report["validation_agreement"] is None
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 256 and config["specdec"]["tied_lm_head"]

    code, stdout, stderr = run_cli_tiny("generate", "def add(a, b):", "--model", str(tiny_model_dir), "--backend", "native",
                                   "--method", "eagle", "--draft-model", str(out), "--max-tokens", "8", "--stats")
    assert code == 0, stderr

    # A second run into the same directory must say how to continue it; --resume continues
    # (here: nothing left to answer, the budget already spent, so it only rewrites the head).
    code, _, stderr = _train(run_cli_tiny, tiny_model_dir, out, "--max-tokens", "200")
    assert code == 2 and "--resume" in stderr
    code, stdout, stderr = _train(run_cli_tiny, tiny_model_dir, out, "--max-tokens", "200", "--resume")
    assert code == 0, stderr
    assert json.loads((out / "report.json").read_text())["steps"] == report["steps"]


@pytest.mark.parametrize(("args", "message"), [
    (["--max-tokens", "10", "--arch", "hydra"], "unknown head architecture"),
    (["--max-tokens", "10", "--arch", "medusa", "--ttt-steps", "4"], "ttt_steps is an option of eagle heads"),
    (["--max-tokens", "10", "--medusa-heads", "2"], "medusa_heads is an option of medusa heads"),
    ([], "give a budget"),
    (["--max-tokens", "10", "--self-prompts", "2", "--exclude", "no/such/benchmark.jsonl"], "--exclude file not found"),
])
def test_refusals(run_cli_tiny: CliRun, tiny_model_dir: Path, tmp_path: Path, args: list[str], message: str) -> None:
    code, _, stderr = _train(run_cli_tiny, tiny_model_dir, tmp_path / "out", *args)
    assert code == 2 and message in stderr, stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to train on")
def test_a_missing_gpu_is_refused_before_the_target_loads(run_cli_tiny: CliRun, tiny_model_dir: Path, tmp_path: Path) -> None:
    code, _, stderr = _train(run_cli_tiny, tiny_model_dir, tmp_path / "out", "--max-tokens", "10", "--device", "cuda")
    assert code == 2 and "no CUDA GPU here" in stderr, stderr
    code, _, stderr = _train(run_cli_tiny, tiny_model_dir, tmp_path / "out", "--max-tokens", "10", "--device", "tpu")
    assert code == 2 and "train on cpu or cuda" in stderr, stderr


def test_fixed_text_of_prompts_not_answered(run_cli_tiny: CliRun, tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "category": "c", "turns": [f"Text number {i} to read."]}) + "\n"
                            for i in range(6)))
    # No prompt of the file answered: all 6 are fixed text (more asked for than there are).
    code, _, stderr = _train(run_cli_tiny, tiny_model_dir, tmp_path / "head", "--data", str(data), "--text", "10",
                             "--max-tokens", "100")
    assert code == 0, stderr
    assert "6 fixed texts" in stderr
    # 2 of them answered: their text is left out, so no held-out answer's prompt is trained on.
    out = tmp_path / "head2"
    code, _, stderr = run_cli_tiny("train-draft", "--model", str(tiny_model_dir), "--backend", "native", "--answers", "2",
                              "--code-prompts", "0", "--answer-tokens", "6", "--draft-vocab", "256",
                              "--data", str(data), "--text", "10", "--max-tokens", "100", "--out", str(out))
    assert code == 0, stderr
    answered = [json.loads(line)["id"] for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answered) == 2 and "4 fixed texts" in stderr
    # Fixed text only: nothing is held out, and the run says so instead of reporting NaN.
    out = tmp_path / "head3"
    code, stdout, stderr = run_cli_tiny("train-draft", "--model", str(tiny_model_dir), "--backend", "native",
                                   "--answers", "0", "--code-prompts", "0", "--draft-vocab", "256", "--data", str(data),
                                   "--text", "6", "--max-tokens", "60", "--out", str(out))
    assert code == 0, stderr
    assert "no held-out answers" in stdout
    report = json.loads((out / "report.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in report"))
    assert report["validation_agreement"] is None and report["validation_sequences"] == 0


def test_fixed_text_needs_data(run_cli_tiny: CliRun, tiny_model_dir: Path, tmp_path: Path) -> None:
    code, _, stderr = _train(run_cli_tiny, tiny_model_dir, tmp_path / "out", "--text", "3", "--max-tokens", "10")
    assert code == 2 and "give --data" in stderr, stderr


def test_requests_the_target_wrote_are_answered_unless_they_share_a_benchmark_run(
        run_cli_tiny: CliRun, tiny_model_dir: Path, tmp_path: Path) -> None:
    # A random model rarely ends its turn, so the requests are written here as a killed run
    # would have left them; --resume judges them, writes no more, and answers the kept ones.
    benchmark_text = "Write a persuasive essay to convince your audience that sleep matters more than you think"
    benchmark = tmp_path / "bench.jsonl"
    benchmark.write_text(json.dumps({"id": 1, "turns": [benchmark_text]}) + "\n")
    out = tmp_path / "head"
    out.mkdir()
    attempts = [("Tell me about cats and dogs.", True), ("Tell me about the history of", False),
                (f"Please {benchmark_text.lower()}.", True), ("How do I bake bread at home?", True)]
    (out / "self_prompts.jsonl").write_text("".join(
        json.dumps({"attempt": n, "text": text, "finished": finished}) + "\n" for n, (text, finished) in enumerate(attempts)))
    code, _, stderr = _train(run_cli_tiny, tiny_model_dir, out, "--code-prompts", "0", "--self-prompts", "2", "--exclude",
                             str(benchmark), "--max-tokens", "30", "--resume")
    assert code == 0, stderr
    assert "2 requests written by the target" in stderr
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert sorted(a["id"] for a in answers) == ["self:0", "self:3"] and all(a["category"] == "self" for a in answers)
    assert len((out / "self_prompts.jsonl").read_text().splitlines()) == 4


def test_task_requests_are_answered_then_translated_back(run_cli_tiny: CliRun, tiny_model_dir: Path, tmp_path: Path) -> None:
    article = " ".join(["the model"] * 35)  # 70 words, few tokens: a prompt under the answering limit
    records = [{"id": "news", "category": "t0_cnn_dailymail", "turns": [f"Summarise the article:\n\n{article}"]},
               {"id": "fact", "category": "t0_sciq", "turns": ["Plants use light from the sun to grow and live."]}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "head"
    code, _, stderr = run_cli_tiny("train-draft", "--model", str(tiny_model_dir), "--backend", "native", "--answers", "0",
                                   "--code-prompts", "0", "--answer-tokens", "6", "--draft-vocab", "256", "--data",
                                   str(data), "--tasks", "2", "--max-tokens", "60", "--out", str(out))
    assert code == 0, stderr
    answers = {r["id"]: r for r in map(json.loads, (out / "answers.jsonl").read_text().splitlines())}
    (translated,) = [i for i in answers if i.startswith("translate:")]
    assert sorted(answers) == sorted(["summarize:news", translated, f"back{translated}"])
    assert all(r["category"] in ("summarization", "translation") and r["answer_ids"] for r in answers.values())
    code, _, stderr = _train(run_cli_tiny, tiny_model_dir, tmp_path / "out", "--tasks", "3", "--max-tokens", "10")
    assert code == 2 and "give --data" in stderr, stderr


def test_a_killed_run_resumes_to_the_uninterrupted_result(run_cli_tiny: CliRun, tiny_model_dir: Path, tmp_path: Path) -> None:
    # A real process killed (SIGKILL) mid-training, then --resume: the head, steps and tokens are
    # exactly an uninterrupted run's. A checkpoint every step, one sequence a step: many steps.
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    args = ["train-draft", "--model", str(tiny_model_dir), "--backend", "native", "--answers", "0", "--code-prompts", "6",
            "--answer-tokens", "12", "--draft-vocab", "256", "--batch-tokens", "64", "--checkpoint-every", "0",
            "--max-tokens", "4000"]
    code, _, stderr = run_cli_tiny(*args, "--out", str(tmp_path / "whole"))
    assert code == 0, stderr
    split = tmp_path / "split"
    process = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", *args, "--out", str(split)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=cli_env(OMP_NUM_THREADS=str(torch.get_num_threads())))  # this process's threads: the same sums
    log, deadline = split / "log.jsonl", time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        if log.is_file() and len(log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    assert process.poll() is None, "the run ended before it could be killed: " + process.stderr.read().decode()[-500:]
    process.send_signal(signal.SIGKILL)
    process.wait()
    steps_at_kill = len(log.read_text().splitlines())
    code, _, stderr = run_cli_tiny(*args, "--out", str(split), "--resume")
    assert code == 0, stderr
    whole, resumed = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("whole", "split"))
    assert whole["steps"] > steps_at_kill and (resumed["steps"], resumed["tokens"]) == (whole["steps"], whole["tokens"])
    a, b = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
