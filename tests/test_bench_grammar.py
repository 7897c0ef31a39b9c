"""``specdecode bench-grammar`` on the tiny sharp model (``--quick``: 2 requests, 1 round, 16
tokens): the report's JSON has every configuration off and on per method with consistent counts,
greedy outputs agree across configurations, and the identity check flags an altered or cut output
(exit status 1 from the command); the built-in requests are enough and all compile."""
from __future__ import annotations

import copy
import json

import pytest

from specdecode.bench import grammar
from specdecode.runtime.cli import main
from specdecode.runtime.engine.grammar import GrammarCompiler, StructuredKind

LABELS = ["none", "none+grammar", "ngram", "ngram+grammar"]


def quick(model_dir, out_dir) -> list[str]:
    return ["bench-grammar", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--quick",
            "--output-dir", str(out_dir)]


@pytest.fixture(scope="module")
def report(sharp_target_dir, tmp_path_factory) -> dict:
    """A quick run's JSON report; its table printed."""
    out = tmp_path_factory.mktemp("bench-grammar")
    assert main(quick(sharp_target_dir, out)) == 0
    assert len(list(out.glob("grammar-*.png"))) == 1
    (path,) = out.glob("grammar-*.json")
    return json.loads(path.read_text())


def test_report_has_every_configuration_with_consistent_counts(report):
    assert [c["label"] for c in report["configs"]] == LABELS and report["reference"] == "none"
    assert [r["name"] for r in report["requests"]] == [r.name for r in grammar.load_requests(2)]
    assert (report["rounds"], report["max_tokens"]) == (1, 16)
    for config in report["configs"]:
        (round_,) = config["rounds"]
        assert [r["name"] for r in round_["requests"]] == [r["name"] for r in report["requests"]]
        assert round_["tokens"] == sum(len(r["token_ids"]) for r in round_["requests"])
        assert round_["steps"] == sum(r["steps"] for r in round_["requests"])
        assert all(1 <= len(r["token_ids"]) <= 16 for r in round_["requests"])
        assert config["tokens_per_step"] == pytest.approx(round_["tokens"] / round_["steps"])
        assert config["tokens_per_s"] == pytest.approx(round_["tokens"] / round_["wall_s"])
        spec = round_["spec"]
        assert spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
        # a step emits its accepted drafts and one more token (fewer where the output ends)
        steps = round_["steps"]
        assert steps - len(round_["requests"]) <= round_["tokens"] <= steps + spec["num_accepted_tokens"]
    nospec = report["configs"][0]
    assert nospec["rounds"][0]["spec"]["num_draft_tokens"] == 0 and nospec["acceptance"]["rate"] is None
    assert [o["method"] for o in report["on_off"]] == ["none", "ngram"]
    for o in report["on_off"]:
        off, on = (c for c in report["configs"] if c["method"] == o["method"])
        assert o["tokens_per_s"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])
    assert report["mismatches"] == []


def test_identity_check_flags_an_altered_or_cut_output(report):
    assert grammar.check_outputs(report["configs"]) == []
    altered = copy.deepcopy(report["configs"])
    request = altered[3]["rounds"][0]["requests"][1]
    request["token_ids"][2] += 1
    assert grammar.check_outputs(altered) == [{
        "config": "ngram+grammar", "round": 1, "request": request["name"], "position": 2,
        "reference_token": request["token_ids"][2] - 1, "token": request["token_ids"][2]}]
    cut = copy.deepcopy(report["configs"])
    tokens = cut[1]["rounds"][0]["requests"][0]["token_ids"]
    last = tokens.pop()
    (mismatch,) = grammar.check_outputs(cut)
    assert (mismatch["config"], mismatch["position"], mismatch["reference_token"], mismatch["token"]) == \
           ("none+grammar", len(tokens), last, None)


def test_a_mismatch_is_printed_and_exits_1(sharp_target_dir, tmp_path, monkeypatch, capsys):
    run_set = grammar.run_set
    calls = []

    def altering(engine, names, prompts, params):  # the 4th set of round 1 is ngram+grammar's
        result = run_set(engine, names, prompts, params)
        calls.append(1)
        if len(calls) == 4:
            result["requests"][0]["token_ids"][0] += 1
        return result

    monkeypatch.setattr(grammar, "run_set", altering)
    assert main(quick(sharp_target_dir, tmp_path)) == 1
    assert "MISMATCH: ngram+grammar round 1 customer_account token 0" in capsys.readouterr().out
    (path,) = tmp_path.glob("grammar-*.json")
    assert [m["config"] for m in json.loads(path.read_text())["mismatches"]] == ["ngram+grammar"]


def test_builtin_requests_are_schema_shaped_and_compile(tiny):
    requests = grammar.load_requests()
    assert len(requests) >= 16 and len({r.name for r in requests}) == len(requests)
    assert {r.structured.kind for r in requests} == {StructuredKind.JSON, StructuredKind.LARK}
    compiler = GrammarCompiler(tiny[1], tiny[0].config.vocab_size)
    for r in requests:
        compiler.compile(r.structured)  # ValueError with llguidance's reason otherwise
    call = '{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}'
    forced = [r for r in requests if r.structured.kind is StructuredKind.LARK and "get_weather" in r.structured.text]
    tokens = tiny[1].encode(call, add_special_tokens=False)
    assert forced and compiler.grammar(forced[0].structured).valid_prefix(tokens) == len(tokens)
