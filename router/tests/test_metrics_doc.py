"""docs/metrics.md and docs/grafana-dashboard.json against what /metrics really exposes.

The exposition comes from the router's own `Metrics`; every labelled metric is given one child first, because a
labelled family without children has no samples and so shows neither its labels nor, for counters, its series.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from specula_router.metrics import Metrics

DOCS = Path(__file__).resolve().parents[2] / "docs"

# TGI's metrics (TGI's docs/source/reference/metrics.md), by family. Its two step-phase histograms
# `tgi_batch_filter_duration` and `tgi_batch_concat_duration` have no Specula counterpart (metrics.md says so).
TGI_COUNTERS = ("request_count", "request_success", "request_failure", "batch_inference_count",
                "batch_inference_success", "batch_inference_failure", "batch_concat")
TGI_GAUGES = ("queue_size", "batch_current_size", "batch_current_max_tokens")
TGI_HISTOGRAMS = ("request_duration", "request_validation_duration", "request_queue_duration",
                  "request_inference_duration", "request_mean_time_per_token_duration", "request_input_length",
                  "request_generated_tokens", "request_max_new_tokens", "request_skipped_tokens",
                  "batch_inference_duration", "batch_forward_duration", "batch_decode_duration", "batch_next_size")


# Every series TGI's own Grafana dashboard (assets/tgi_grafana.json) queries, as written there.
TGI_DASHBOARD_SERIES = (
    "tgi_batch_concat", "tgi_batch_current_max_tokens", "tgi_batch_current_size", "tgi_batch_decode_duration_bucket",
    "tgi_batch_forward_duration_bucket", "tgi_batch_inference_duration_bucket", "tgi_queue_size", "tgi_request_count",
    "tgi_request_duration_bucket", "tgi_request_failure", "tgi_request_generated_tokens_bucket",
    "tgi_request_generated_tokens_count", "tgi_request_generated_tokens_sum", "tgi_request_input_length_bucket",
    "tgi_request_mean_time_per_token_duration_bucket", "tgi_request_queue_duration_bucket",
    "tgi_request_skipped_tokens_bucket", "tgi_request_success",
)
TGI_ONLY = ("tgi_batch_filter_duration", "tgi_batch_concat_duration")


def exposition(prefix: str = "specula") -> str:
    metrics = Metrics(prefix=prefix)
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*["x"] * len(metric._labelnames))
    return metrics.render().decode()


def exposed_families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """{family: (type, label names)}, without prometheus_client's `<name>_created` gauges (metrics.md describes
    them in prose) and without the histograms' `le`."""
    families = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge" and family.name.endswith("_created"):
            continue
        labels = frozenset(k for sample in family.samples for k in sample.labels) - {"le"}
        families[family.name] = (family.type, labels)
    return families


def documented_families() -> dict[str, tuple[str, frozenset[str]]]:
    """The table of docs/metrics.md: `| \\`name\\` | type ... | labels | meaning |`."""
    families = {}
    for line in (DOCS / "metrics.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"`specula_\w+`", cells[0]):
            continue
        name = cells[0].strip("`")
        assert name not in families, f"{name} is listed twice in metrics.md"
        labels = frozenset(label.strip() for label in cells[2].split(",") if label.strip())
        families[name] = (cells[1].split()[0], labels)
    return families


def sample_names(text: str) -> set[str]:
    """The series names on the wire (the parser renames TGI-style counters to `_total`, so read the raw lines)."""
    return {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_doc_lists_exactly_what_is_exposed():
    exposed, documented = exposed_families(exposition()), documented_families()
    assert len(documented) > 30  # the table was found and parsed
    assert sorted(set(exposed) - set(documented)) == [], "exposed but missing from docs/metrics.md"
    assert sorted(set(documented) - set(exposed)) == [], "in docs/metrics.md but not exposed"
    wrong = {name: (documented[name], exposed[name]) for name in exposed if documented[name] != exposed[name]}
    assert wrong == {}, "docs/metrics.md (type, labels) differ from the exposition: {doc: exposed}"


def test_parsers_see_a_missing_or_mistyped_metric():
    """The comparison above can fail: a table with a row dropped and a type changed differs from the exposition."""
    documented = documented_families()
    documented.pop("specula_queue_size")
    documented["specula_request_count"] = ("gauge", documented["specula_request_count"][1])
    exposed = exposed_families(exposition())
    assert set(exposed) - set(documented) == {"specula_queue_size"}
    assert exposed["specula_request_count"] != documented["specula_request_count"]


def test_tgi_prefix_gives_the_names_a_tgi_dashboard_queries():
    text = exposition("tgi")
    names = sample_names(text)
    expected = ({f"tgi_{name}" for name in TGI_COUNTERS + TGI_GAUGES}
                | {f"tgi_{name}_{part}" for name in TGI_HISTOGRAMS for part in ("bucket", "sum", "count")})
    assert sorted(expected - names) == []
    assert sorted(set(TGI_DASHBOARD_SERIES) - names) == []
    # As TGI's exporter writes them: `tgi_request_count 1`, never `tgi_request_count_total`, no `_created`.
    assert not [name for name in names if name.endswith(("_total", "_created"))]
    assert not [name for name in names if not name.startswith("tgi_")]
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert {types[f"tgi_{name}"] for name in TGI_COUNTERS} == {"counter"}
    assert {types[f"tgi_{name}"] for name in TGI_HISTOGRAMS} == {"histogram"}


def test_metrics_doc_names_the_tgi_metrics_specula_lacks():
    text = exposition("tgi")
    doc = (DOCS / "metrics.md").read_text()
    for name in TGI_ONLY:
        assert name not in text and f"`{name}`" in doc


def test_tgi_style_escapes_label_values():
    metrics = Metrics(prefix="tgi")
    metrics.request_failure.labels('a"b\\c\nd', "").inc(2)
    [family] = [f for f in text_string_to_metric_families(metrics.render().decode()) if f.name == "tgi_request_failure"]
    assert ({"err": 'a"b\\c\nd', "adapter": ""}, 2.0) in [(s.labels, s.value) for s in family.samples]


def test_failure_series_of_the_base_model_start_at_zero():
    """So `rate()` sees a kind's first failure (a series born at 1 shows no increase)."""
    families = text_string_to_metric_families(Metrics().render().decode())
    [family] = [f for f in families if f.name == "specula_request_failure"]
    zeros = {s.labels["err"] for s in family.samples if s.name.endswith("_total") and s.value == 0}
    assert zeros == {"validation", "overloaded", "generation", "cancelled"}


def test_default_prefix_keeps_prometheus_client_names():
    names = sample_names(exposition())
    assert "specula_request_count_total" in names and "specula_request_count" not in names


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [v["query"] for v in dashboard.get("templating", {}).get("list", []) if v.get("type") == "query"]
    return exprs


def metric_names_in(expr: str) -> set[str]:
    # Every metric name in a query is prefixed (`specula_...`); labels, functions and variables are not.
    return set(re.findall(r"\bspecula_[a-zA-Z0-9_]+", expr))


@pytest.mark.parametrize("title", ["Request rate", "Time to first token", "Inter-token latency",
                                   "Queue and batch size", "Speculative acceptance rate", "Prefix cache hit rate"])
def test_dashboard_has_panel(title):
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    assert title in [panel["title"] for panel in dashboard["panels"]]


def test_dashboard_queries_only_exposed_series():
    names = sample_names(exposition())
    used = set().union(*map(metric_names_in, dashboard_expressions()))
    assert len(used) >= 10
    assert sorted(used - names) == []


def test_dashboard_check_sees_a_wrong_name():
    assert metric_names_in("rate(specula_request_count[1m])") - sample_names(exposition()) == {
        "specula_request_count"}


def test_model_info_labels_what_the_workers_run():
    metrics = Metrics()
    metrics.set_model_info("float32", "int8", "float8_e4m3fn", "cpu")
    text = metrics.render().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "specula_model_info"]
    assert [(s.labels, s.value) for s in samples] == [
        ({"dtype": "float32", "quantize": "int8", "kv_cache_dtype": "float8_e4m3fn", "device": "cpu"}, 1.0)]
