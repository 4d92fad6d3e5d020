"""The Grafana dashboard in deploy/grafana queries only what the server exposes: every metric
its panels name is in a real server's /metrics, and every label it groups by or prints is one
those metrics carry."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.config import SpeculativeConfig
from specdec.models import LoadedModel
from specdec.server.config import RouteConfig, ServerConfig
from specdec.server.runtime import ServerThread, build_state

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "specdec.json"
pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def exposition(default_model: LoadedModel) -> Iterator[str]:
    """/metrics of a server whose every route (lookup, suffix, plain) has served a request."""
    routes = (RouteConfig("lookup", SpeculativeConfig("ngram", 3)), RouteConfig("suffix", SpeculativeConfig("suffix", 4)),
              RouteConfig("plain"))
    server = ServerThread(build_state(ServerConfig(routes=routes, max_model_len=256, max_num_seqs=2), loaded=default_model)).start()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for route in ("lookup", "suffix", "plain"):
        client.chat.completions.create(model=route, messages=[{"role": "user", "content": "List three colours, one per line."}],
                                       max_tokens=24, temperature=0)
    yield httpx.get(f"{server.url}/metrics").text
    server.stop()


def _exposed(text: str) -> dict[str, set[str]]:
    """{sample name: the label names its samples carry}."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def _targets() -> list[dict]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target for panel in dashboard["panels"] for target in panel["targets"]]


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(panel["targets"] and panel["datasource"]["type"] == "prometheus" for panel in dashboard["panels"])


def test_every_queried_metric_and_label_exists(exposition: str) -> None:
    exposed = _exposed(exposition)
    assert len(_targets()) >= 12
    for target in _targets():
        expr = target["expr"]
        metrics = set(re.findall(r"\bspecdec_[a-z0-9_]+", expr))
        assert metrics, expr
        missing = metrics - set(exposed)
        assert not missing, f"{expr}: not in /metrics: {missing}"
        labels = set().union(*(exposed[m] for m in metrics))
        grouped = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}
        assert grouped <= labels, f"{expr}: groups by {grouped - labels}"
        shown = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
        assert shown <= labels, f"{expr}: legend shows {shown - labels}"


def test_the_check_catches_a_wrong_name(exposition: str) -> None:
    # What the test above would say of a typo: the name or the label is not exposed.
    assert "specdec_acceptance_rates" not in _exposed(exposition)
    assert "reason" not in _exposed(exposition)["specdec_requests_total"]
