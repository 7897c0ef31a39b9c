"""The Grafana dashboard (charts/specdecode/dashboards/specdecode.json): every PromQL expression
parses, and every metric it reads is one the runtime's or the operator's metrics registry really
exports, scoped to the selected SpecDecodeDeployment."""
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from prometheus_client import CollectorRegistry

from specdecode.operator import metrics as operator_metrics
from specdecode.runtime.engine.llm_engine import EngineStats
from specdecode.runtime.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "specdecode" / "dashboards" / "specdecode.json"

# Series of one SpecDecodeDeployment: the runtime's through its Service (the ServiceMonitor adds
# namespace and service), the operator's by the resource's own namespace and name labels.
RUNTIME_SCOPE = {"namespace": "$namespace", "service": "$deployment"}
OPERATOR_SCOPE = {"namespace": "$namespace", "name": "$deployment"}


def exported_series(registry: CollectorRegistry) -> dict[str, str]:
    """Series name → type, for every collector in ``registry`` (labelled ones without children too)."""
    series = {}
    for family in registry.collect():
        if family.type == "counter":
            series[family.name + "_total"] = "counter"
        elif family.type == "histogram":
            series.update({family.name + suffix: "histogram" for suffix in ("_bucket", "_sum", "_count")})
        else:
            series[family.name] = family.type
    return series


def runtime_series() -> dict[str, str]:
    """From the runtime's own registry, its engine-side collector included."""
    metrics = ServerMetrics(lambda: EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=0,
                                                num_total_blocks=0, num_preemptions=0, prefix_cache_hit_tokens=0))
    return exported_series(metrics.registry)


OPERATOR_METRICS = exported_series(operator_metrics.OperatorMetrics().registry)


# -- a PromQL parser for the subset dashboards use -----------------------------------------------

AGGREGATIONS = {"sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev", "group"}
RANGE_FUNCTIONS = {"rate", "irate", "increase", "delta", "avg_over_time", "max_over_time", "min_over_time"}
FUNCTIONS = AGGREGATIONS | RANGE_FUNCTIONS | {"histogram_quantile", "clamp_min", "clamp_max", "abs", "vector"}
COUNTER_FUNCTIONS = {"rate", "irate", "increase"}
BINARY = {"+", "-", "*", "/", "%", "^", "==", "!=", "<", ">", "<=", ">=", "and", "or", "unless"}
TOKEN = re.compile(r"""\s*(?:
    (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<range>\[(?:[0-9]+[smhdwy])+\]|\[\$\w+\])
  | (?P<number>[0-9]+(?:\.[0-9]+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|==|!=|<=|>=|[-+*/%^<>=(){},])
)""", re.VERBOSE)


@dataclass
class Selector:
    metric: str
    matchers: dict[str, str]
    function: str | None  # the function applied directly to it (rate, histogram_quantile's rate, …)


@dataclass
class PromQL:
    """Recursive descent over tokens; raises ValueError on anything it does not understand."""

    text: str
    tokens: list[tuple[str, str]] = field(init=False)
    pos: int = 0
    selectors: list[Selector] = field(default_factory=list)

    def __post_init__(self):
        self.tokens, end = [], 0
        for match in TOKEN.finditer(self.text):
            if match.start() != end:
                break
            self.tokens.append((match.lastgroup, match.group(match.lastgroup)))
            end = match.end()
        if self.text[end:].strip():
            raise ValueError(f"cannot tokenize {self.text[end:]!r}")

    def parse(self) -> list[Selector]:
        self.expr(None)
        if self.pos != len(self.tokens):
            raise ValueError(f"trailing {self.tokens[self.pos:]}")
        return self.selectors

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def take(self, kind: str | None = None, value: str | None = None) -> str:
        if self.pos >= len(self.tokens):
            raise ValueError(f"expected {value or kind} at the end of {self.text!r}")
        got_kind, got = self.tokens[self.pos]
        if (kind and got_kind != kind) or (value and got != value):
            raise ValueError(f"expected {value or kind}, got {got!r} in {self.text!r}")
        self.pos += 1
        return got

    def expr(self, function: str | None) -> None:
        self.unary(function)
        while self.peek() in BINARY:
            self.take()
            if self.peek() == "bool":
                self.take()
            if self.peek() in ("on", "ignoring"):
                self.take()
                self.labels()
                if self.peek() in ("group_left", "group_right"):
                    self.take()
                    if self.peek() == "(":
                        self.labels()
            self.unary(function)

    def unary(self, function: str | None) -> None:
        if self.peek() in ("-", "+"):
            self.take()
        kind = self.tokens[self.pos][0] if self.pos < len(self.tokens) else None
        following = self.tokens[self.pos + 1][1] if self.pos + 1 < len(self.tokens) else None
        if kind == "number":
            self.take()
        elif self.peek() == "(":
            self.take()
            self.expr(function)
            self.take(value=")")
        elif kind == "ident" and following in ("(", "by", "without"):
            self.call()
        else:
            self.selector(function)

    def call(self) -> None:
        name = self.take("ident")
        if name not in FUNCTIONS:
            raise ValueError(f"unknown function {name!r}")
        if name in AGGREGATIONS and self.peek() in ("by", "without"):
            self.take()
            self.labels()
        self.take(value="(")
        while self.peek() != ")":
            self.expr(name)
            if self.peek() == ",":
                self.take()
        self.take(value=")")
        if name in AGGREGATIONS and self.peek() in ("by", "without"):
            self.take()
            self.labels()

    def labels(self) -> list[str]:
        self.take(value="(")
        names = []
        while self.peek() != ")":
            names.append(self.take("ident"))
            if self.peek() == ",":
                self.take()
        self.take(value=")")
        return names

    def selector(self, function: str | None) -> None:
        metric = self.take("ident")
        if metric in BINARY or metric in ("by", "without", "on", "ignoring", "bool", "offset"):
            raise ValueError(f"keyword {metric!r} where a metric belongs")
        matchers = {}
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                label = self.take("ident")
                operator = self.take("op")
                if operator not in ("=", "!=", "=~", "!~"):
                    raise ValueError(f"bad matcher operator {operator!r}")
                matchers[label] = json.loads(self.take("string"))
                if self.peek() == ",":
                    self.take()
            self.take(value="}")
        is_range = self.pos < len(self.tokens) and self.tokens[self.pos][0] == "range"
        if is_range:
            self.take("range")
        if is_range != (function in RANGE_FUNCTIONS):
            raise ValueError(f"{metric}: a range vector goes exactly into a range function, not {function}")
        self.selectors.append(Selector(metric, matchers, function))


LABEL_VALUES = re.compile(r"^label_values\((?P<expr>.+),\s*(?P<label>\w+)\)$")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def panel_expressions() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def variable_expressions() -> dict[str, tuple[str, str]]:
    """Query variable → (the PromQL inside its label_values(), the label it lists)."""
    found = {}
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["query"]["query"])
            found[variable["name"]] = (match["expr"], match["label"])
    return found


def selectors(exprs: list[str]) -> list[Selector]:
    return [s for e in exprs for s in PromQL(e).parse()]


def all_selectors() -> list[Selector]:
    return selectors(panel_expressions() + [e for e, _ in variable_expressions().values()])


# -- the parser itself can fail ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    "sum by (revision) (rate(x_total{a=\"b\"}[5m])",  # unbalanced
    "rate(x_total{a=\"b\"})",  # rate without a range
    "sum(x_total[5m])",  # a range outside a range function
    "sum by (revision) (rates(x_total[5m]))",  # unknown function
    "x_total{a=b}",  # unquoted matcher value
    "x_total y_total",  # two selectors without an operator
])
def test_parser_refuses_broken_promql(bad):
    with pytest.raises(ValueError):
        PromQL(bad).parse()


def test_parser_finds_every_selector():
    found = PromQL('1 + sum by (r) (rate(a_total{x="1"}[$__rate_interval])) / on (r) group_left '
                   'histogram_quantile(0.5, sum by (le) (rate(b_bucket[5m]))) - c').parse()
    assert [(s.metric, s.matchers, s.function) for s in found] == [
        ("a_total", {"x": "1"}, "rate"), ("b_bucket", {}, "rate"), ("c", {}, None)]


# -- the dashboard -------------------------------------------------------------------------------


def test_every_metric_is_exported_by_the_runtime_or_the_operator():
    runtime = runtime_series()
    assert "specdecode:spec_decode_num_accepted_tokens_per_pos_total" in runtime  # the engine-side collector
    assert OPERATOR_METRICS.keys() == set(operator_metrics.ALL)  # the names the operator declares
    known = {**runtime, **OPERATOR_METRICS}
    unknown = sorted({s.metric for s in all_selectors()} - known.keys())
    assert not unknown, f"the dashboard reads series nobody exports: {unknown}"


def test_rates_are_taken_of_counters_and_histograms():
    types = {**runtime_series(), **OPERATOR_METRICS}
    for s in all_selectors():
        if s.function in COUNTER_FUNCTIONS:
            assert types[s.metric] in ("counter", "histogram"), f"{s.function}() over the {types[s.metric]} {s.metric}"
        if types[s.metric] == "histogram":
            assert s.function in COUNTER_FUNCTIONS, f"{s.metric} read without rate()"


def test_every_panel_is_scoped_to_the_selected_deployment():
    for s in selectors(panel_expressions()):
        scope = OPERATOR_SCOPE if s.metric in OPERATOR_METRICS else RUNTIME_SCOPE
        assert s.matchers == scope, f"{s.metric}: {s.matchers}"
    variables = variable_expressions()
    assert {v["name"] for v in dashboard()["templating"]["list"]} == {"datasource", *variables}
    (namespaces,) = PromQL(variables["namespace"][0]).parse()
    (deployments,) = PromQL(variables["deployment"][0]).parse()
    assert (namespaces.matchers, variables["namespace"][1]) == ({}, "namespace")
    assert (deployments.matchers, variables["deployment"][1]) == ({"namespace": "$namespace"}, "service")


def test_panels_cover_speculation_serving_and_rollout():
    used = {s.metric for s in all_selectors()}
    runtime = runtime_series()
    wanted = {name for name in runtime if "spec_decode" in name} | {
        "specdecode:generation_tokens_total", "specdecode:time_to_first_token_seconds_bucket",
        "specdecode:inter_token_latency_seconds_bucket", "specdecode:num_requests_running",
        "specdecode:num_requests_waiting", "specdecode:kv_cache_usage_perc"}
    assert wanted | OPERATOR_METRICS.keys() <= used, sorted(wanted | OPERATOR_METRICS.keys() - used)
    by_title = {p["title"]: [t["expr"] for t in p["targets"]] for p in panels()}
    for title in ("Time to first token", "Inter-token latency"):
        assert [e.split(",")[0] for e in by_title[title]] == ["histogram_quantile(0.5", "histogram_quantile(0.95"]
    scraped, measured = by_title["Acceptance rate by revision"]  # from Prometheus, and the operator's own
    assert scraped.count("sum by (revision)") == 2 and measured.startswith("specdecode_operator_acceptance_rate{")
    assert "by (revision, position)" in by_title["Acceptance by draft position"][0]


def test_layout_and_data_source():
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] == "specdecode"
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["description"] and panel["targets"]
        assert [t["refId"] for t in panel["targets"]] == [chr(ord("A") + i) for i in range(len(panel["targets"]))]
