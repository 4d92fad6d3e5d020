"""The docs say what is: the README stays a front page, README and docs/ carry no history (no
"round"), history goes to CHANGELOG.md and benchmarks/results/history/, the results page and its
files are named by topic, and every relative link in the pages a reader starts from resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROUND = re.compile(r"\bround\b", re.I)
# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))  # code blocks hold commands, not links
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; reference belongs in docs/"


@pytest.mark.parametrize("path", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_docs_say_what_is(path: Path) -> None:
    hits = [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if ROUND.search(line)]
    assert not hits, "history belongs in CHANGELOG.md or benchmarks/results/history/:\n" + "\n".join(hits)


def test_the_results_page_is_by_topic() -> None:
    headings = [line for line in (RESULTS / "README.md").read_text(encoding="utf-8").splitlines()
                if line.startswith("#") and ROUND.search(line)]
    assert not headings, headings
    assert (RESULTS / "history").is_dir()


def test_history_has_a_changelog() -> None:
    assert (ROOT / "CHANGELOG.md").is_file()


def test_result_files_are_named_by_topic() -> None:
    named = sorted(p.name for p in RESULTS.iterdir() if "round" in p.name.lower())
    assert not named, named


@pytest.mark.parametrize("path", [*pages(), RESULTS / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    broken = [t for t in relative_links(path) if not (path.parent / t.split("#")[0]).exists()]
    assert not broken, broken
