"""``specdecode bench --method``: a missing prompt set, system list, acceptance math, output
checks, and a tiny end-to-end run (ours with n-gram + transformers' prompt lookup, real
subprocesses). No timing is asserted: the machine is noisy."""
import argparse
import json

import pytest

from specdecode.bench import acceptance, command, correctness, report
from specdecode.bench.ours import counts_since, truncate
from specdecode.bench.records import RequestTiming, RunResult, SystemResult, TieCheck
from specdecode.bench.systems import LOAD_CONTROL_ON, NOSPEC, PEER_PLAIN, build_systems
from specdecode.runtime import prompt_sets
from specdecode.runtime.config import BatchSizeRule, LoadControl
from specdecode.runtime.engine.sequence import SpecCounts


def test_bench_exits_2_with_the_hint_when_data_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec", lambda name: None)
    assert command.main(["--prompts", "humaneval", "--num-prompts", "2"]) == 2
    assert "scripts/bench_data.sh" in capsys.readouterr().err


def test_truncation_keeps_the_last_tokens():
    kept, t = truncate([[1, 2, 3, 4, 5, 6], [7, 8]], max_model_len=6, max_tokens=2)
    assert kept == [[3, 4, 5, 6], [7, 8]]
    assert (t.keep_tokens, t.original_lengths, t.num_truncated) == (4, [6, 2], 1)
    assert "1 of 2 prompts" in t.note() and "last 4" in t.note()
    with pytest.raises(ValueError):
        truncate([[1]], max_model_len=4, max_tokens=4)


def test_system_list():
    names = [s.name for s in build_systems(["ngram", "suffix"], 4, None, [1, 8, 32])]
    assert names == [NOSPEC, "ours-ngram", "ours-ngram+lc", "ours-suffix", "ours-suffix+lc",
                     "transformers-prompt-lookup", PEER_PLAIN]
    systems = {s.name: s for s in build_systems(["ngram", "draft"], 3, "qwen2.5-coder-0.5b", [8, 1])}
    assert systems["ours-ngram"].concurrency == (1, 8) and systems["ours-ngram+lc"].concurrency == (8,)
    assert systems["ours-draft"].speculative["draft_model"] == "qwen2.5-coder-0.5b"
    assert systems["ours-draft"].speculative["num_speculative_tokens"] == 3
    assert systems["ours-draft+lc"].speculative["load_control"] == LOAD_CONTROL_ON.model_dump(mode="json")
    assert systems["ours-draft"].speculative["load_control"]["batch_size_table"] == []
    assert systems["ours-draft+lc"].self_reference == "ours-draft" and systems["ours-draft"].peer == "transformers-assisted"
    assert systems["transformers-assisted"].concurrency == (1,) and systems[PEER_PLAIN].concurrency == (1, 8)
    assert [s.name for s in build_systems(["none"], 4, None, [1], with_peer=False)] == [NOSPEC]
    mtp = {s.name: s for s in build_systems(["mtp", "ngram"], 2, None, [1, 8], mtp_path="/heads/smollm2")}
    assert list(mtp) == [NOSPEC, "ours-mtp", "ours-mtp+lc", "ours-mtp-fullvocab", "ours-mtp-fullvocab+lc", "ours-ngram",
                         "ours-ngram+lc", "transformers-prompt-lookup", PEER_PLAIN]  # transformers has no MTP
    assert mtp["ours-mtp"].speculative["mtp_path"] == "/heads/smollm2" and mtp["ours-mtp"].peer is None
    assert mtp["ours-mtp"].speculative["draft_vocab_size"] is None  # the head's reduced vocabulary
    assert mtp["ours-mtp-fullvocab"].speculative["draft_vocab_size"] == 0 and mtp["ours-ngram"].speculative["mtp_path"] is None
    eagle3 = {s.name: s for s in build_systems(["eagle3"], 2, None, [1], with_peer=False, eagle3_path="/heads/e3")}
    assert list(eagle3) == [NOSPEC, "ours-eagle3"] and eagle3["ours-eagle3"].speculative["eagle3_path"] == "/heads/e3"
    with pytest.raises(ValueError, match="eagle3_path"):
        build_systems(["eagle3"], 2, None, [1])
    with pytest.raises(ValueError, match="draft_model"):
        build_systems(["draft"], 4, None, [1])


def test_load_control_option_sets_the_lc_systems_and_refuses_a_bad_one(capsys):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args([]).load_control == LOAD_CONTROL_ON
    text = '{"goodput": true, "batch_size_table": [{"max_batch_size": 8, "num_speculative_tokens": 2}]}'
    chosen = parser.parse_args(["--load-control", text]).load_control
    table = (BatchSizeRule(max_batch_size=8, num_speculative_tokens=2),)
    assert chosen == LoadControl(goodput=True, batch_size_table=table)
    systems = {s.name: s for s in build_systems(["ngram"], 4, None, [1, 8], load_control=chosen)}
    assert systems["ours-ngram+lc"].speculative["load_control"] == chosen.model_dump(mode="json")
    assert systems["ours-ngram"].speculative["load_control"]["batch_size_table"] == []
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--load-control", '{"reprobe_steps": 0}'])
    assert exc.value.code == 2
    assert "--load-control" in capsys.readouterr().err


def test_acceptance_math():
    runs = [SpecCounts(4, 16, 8, [4, 2, 1, 1]), SpecCounts(4, 12, 4, [3, 1])]
    a = acceptance.summarize(runs)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (8, 28, 12)
    assert a.rate == pytest.approx(12 / 28)
    assert a.mean_length == pytest.approx(1 + 12 / 8)
    assert a.per_position == pytest.approx([7 / 8, 3 / 8, 1 / 8, 1 / 8])
    assert acceptance.format_per_position([0.875, 0.375], 4) == "0.88/0.38/0.00/0.00"
    empty = acceptance.summarize([SpecCounts()])
    assert empty.rate is None and empty.mean_length is None and empty.per_position == []
    assert counts_since(SpecCounts(1, 4, 2, [1, 1]), SpecCounts(3, 12, 5, [3, 1, 1])) == SpecCounts(2, 8, 3, [2, 0, 1])


def _result(name: str, outputs_by_c: dict[int, list[list[int]]], ties=(), spec=None) -> SystemResult:
    timing = RequestTiming(0.1, 0.01, 0.2, 3)
    runs = [RunResult(c, False, 1.0 if name != NOSPEC else 2.0, 3 * len(o), [timing] * len(o), o, spec=spec)
            for c, o in outputs_by_c.items()]
    return SystemResult(name, {}, 1, 0.0, [[1, 2]] * 2, runs, list(ties))


def test_correctness_classification_and_summary_rows():
    good = [[5, 6, 7], [8, 9, 10]]
    tied = [[5, 6, 7], [8, 4, 11]]  # prompt 1 differs at token 1: a near tie of transformers' top-2
    systems = build_systems(["ngram"], 2, None, [1, 8])
    results = {
        NOSPEC: _result(NOSPEC, {1: good, 8: good}),
        "ours-ngram": _result("ours-ngram", {1: tied, 8: tied}, spec=SpecCounts(2, 4, 3, [2, 1])),
        "ours-ngram+lc": _result("ours-ngram+lc", {8: [[5, 6, 7], [8, 4, 3]]}),  # ≠ ours-ngram at c=1
        "transformers-prompt-lookup": _result("transformers-prompt-lookup", {1: good}),
        PEER_PLAIN: _result(PEER_PLAIN, {1: good, 8: good}, [TieCheck(1, 1, 9, 4, [9, 4], [20.0, 20.0005])]),
    }
    checked = correctness.check(systems, results)
    assert checked.label(NOSPEC, 1) == "= transformers-plain" and checked.label(NOSPEC, 8) == "= ours-nospec c=1"
    assert checked.label("ours-ngram", 1) == "= transformers-plain (1 near-ties)"
    assert checked.label("ours-ngram", 8) == "= ours-ngram c=1"
    assert checked.label("ours-ngram+lc", 8) == "MISMATCH (1 ≠ ours-ngram c=1)"
    assert checked.label(PEER_PLAIN, 1) == "reference"
    assert not checked.ok and len(checked.failures) == 1

    rows = {(r.system, r.concurrency): r for r in report.build_summaries(systems, results, checked)}
    ngram = rows[("ours-ngram", 1)]
    assert ngram.vs_nospec == pytest.approx(2.0) and ngram.vs_peer == pytest.approx(1.0)
    assert ngram.acceptance.rate == pytest.approx(0.75) and ngram.acceptance.mean_length == pytest.approx(2.5)
    assert rows[(NOSPEC, 8)].vs_peer == pytest.approx(0.5) and rows[("ours-ngram+lc", 8)].vs_peer is None
    table = report.format_table(list(rows.values()), 2)
    assert "| ours-ngram | 1 |" in table and "0.75" in table and "1.00/0.50" in table and "MISMATCH" in table

    results[PEER_PLAIN].tie_checks = [TieCheck(1, 1, 9, 4, [9, 4], [20.0, 19.0])]  # a clear winner: a real bug
    assert correctness.check(systems, results).label("ours-ngram", 1) == "MISMATCH (1 ≠ transformers-plain)"


def test_bench_method_ngram_end_to_end_on_tiny_model(tiny_hf_model_dir, tmp_path, capsys):
    prompts = tmp_path / "repetitive.jsonl"
    chats = [[{"role": "user", "content": "the cat sat on the mat. " * (8 + i)},  # longer than the context
              {"role": "assistant", "content": "the cat sat"}, {"role": "user", "content": "again"}] for i in range(3)]
    prompts.write_text("\n".join(json.dumps(chat) for chat in chats) + "\n")
    out_dir = tmp_path / "results"
    argv = ["--model", str(tiny_hf_model_dir), "--prompts", str(prompts), "--num-prompts", "3", "--max-tokens", "6",
            "--max-model-len", "64", "--method", "ngram", "--num-speculative-tokens", "3", "--concurrency", "1", "2",
            "--runs", "1", "--threads", "1", "--busy-retries", "0", "--quiet-wait", "0", "--output-dir", str(out_dir)]
    assert command.main(argv) == 0

    printed = capsys.readouterr().out
    assert "| ours-ngram | 1 |" in printed and "| ours-ngram+lc | 2 |" in printed
    assert "| transformers-prompt-lookup | 1 |" in printed and "kept their last 58" in printed
    data = json.loads((out_dir / "bench-tiny-llama0-repetitive-ngram.json").read_text())
    assert (out_dir / "bench-tiny-llama0-repetitive-ngram.png").read_bytes().startswith(b"\x89PNG")
    assert (out_dir / "bench-tiny-llama0-repetitive-ngram-acceptance.png").read_bytes().startswith(b"\x89PNG")
    assert data["correctness"]["ok"]
    assert data["truncation"]["keep_tokens"] == 58 and data["truncation"]["note"].startswith("3 of 3")
    systems = data["systems"]
    assert list(systems) == [NOSPEC, "ours-ngram", "ours-ngram+lc", "transformers-prompt-lookup", PEER_PLAIN]
    assert all(len(ids) == 58 for ids in systems[NOSPEC]["prompt_token_ids"])
    assert all(s["prompt_token_ids"] == systems[NOSPEC]["prompt_token_ids"] for s in systems.values())
    spec_runs = [r for r in systems["ours-ngram"]["runs"] if not r["warmup"]]
    assert all(r["spec"] is not None for r in spec_runs)  # counters recorded (a random model rarely matches)
    row = next(r for r in data["summary"] if r["system"] == "ours-ngram" and r["concurrency"] == 1)
    assert row["acceptance"] is not None and row["vs_nospec"] is not None and row["vs_peer"] is not None
