"""``specdecode bench --pipeline-parallel-size / --compare-overlap``: the layout variants of our
systems, the pipeline table, and one quick end-to-end run on the tiny model (real subprocesses, a
real two-stage group). No timing is asserted: the machine is noisy."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from specdecode.bench import command, correctness, report, schedule
from specdecode.bench.records import PipelineSteps, RequestTiming, RunResult, SystemResult
from specdecode.bench.systems import NOSPEC, PEER_PLAIN, build_systems
from specdecode.runtime.config import MTP_PIPELINE_GATE


def test_pipeline_and_overlap_variants_follow_their_base():
    systems = {s.name: s for s in build_systems(["none", "ngram"], 3, None, [1, 4], with_peer=False,
                                                pipeline_parallel_size=2, compare_overlap=True)}
    assert list(systems) == [  # overlap flipped from the default: off in one process, on with stages
        NOSPEC, f"{NOSPEC}-overlap", f"{NOSPEC}-pp2", f"{NOSPEC}-pp2-no-overlap",
        "ours-ngram", "ours-ngram-overlap", "ours-ngram+lc", "ours-ngram+lc-overlap",
        "ours-ngram-pp2", "ours-ngram-pp2-no-overlap",
    ]
    layout = {name: (s.pipeline_parallel_size, s.overlap) for name, s in systems.items()}
    assert layout[NOSPEC] == layout["ours-ngram+lc"] == (1, None) and layout[f"{NOSPEC}-pp2"] == (2, None)
    assert layout["ours-ngram-pp2-no-overlap"] == (2, False) and layout["ours-ngram+lc-overlap"] == (1, True)
    pp = systems["ours-ngram-pp2"]
    assert pp.speculative == systems["ours-ngram"].speculative and pp.concurrency == (1, 4)
    assert pp.self_reference == "ours-ngram-pp2" and pp.peer == "transformers-prompt-lookup"
    assert systems["ours-ngram+lc-overlap"].self_reference == "ours-ngram-overlap"
    assert systems["ours-ngram+lc-overlap"].concurrency == (4,)

    plain = [s.name for s in build_systems(["ngram"], 3, None, [1])]
    assert plain == [NOSPEC, "ours-ngram", "transformers-prompt-lookup", PEER_PLAIN]  # the defaults add nothing
    mtp = {s.name: s for s in build_systems(["mtp"], 2, None, [1], with_peer=False, pipeline_parallel_size=3)}
    assert mtp["ours-mtp-pp3"].speculative["gates"] == [MTP_PIPELINE_GATE] and mtp["ours-mtp"].speculative["gates"] == []
    eagle3 = {s.name: s for s in build_systems(["eagle3"], 2, None, [1], with_peer=False, pipeline_parallel_size=2,
                                               eagle3_path="/heads/e3")}
    assert eagle3["ours-eagle3-pp2"].speculative["gates"] == [MTP_PIPELINE_GATE]
    with pytest.raises(ValueError, match="suffix proposer's cache"):
        build_systems(["ngram", "suffix"], 3, None, [1], pipeline_parallel_size=2)


def test_pipeline_steps_pool_weighted_by_steps_and_the_table_shows_pipeline_rows_only():
    pooled = PipelineSteps.pool([PipelineSteps(10, 40.0, 64.0, 0.010, 0.020), PipelineSteps(30, 80.0, 96.0, 0.030, 0.040)])
    assert pooled == PipelineSteps(40, pytest.approx(70.0), pytest.approx(88.0), pytest.approx(0.025), pytest.approx(0.035))
    assert PipelineSteps.pool([]) is None

    timing = RequestTiming(0.1, 0.01, 0.2, 3)
    runs = [RunResult(1, False, 1.0, 3, [timing], [[5, 6, 7]], pipeline=PipelineSteps(4, 16.0, 24.0, 0.002, 0.0125))]
    piped = SystemResult(f"{NOSPEC}-pp2", {}, 1, 0.0, [[1]], runs)
    assert SystemResult.from_json(json.loads(json.dumps(piped.to_json()))) == piped
    plain = SystemResult(NOSPEC, {}, 1, 0.0, [[1]], [RunResult(1, False, 1.0, 3, [timing], [[5, 6, 7]])])
    table = report.format_pipeline_table([report.summarize(plain, 1), report.summarize(piped, 1)])
    assert table.splitlines()[2:] == ["| ours-nospec-pp2 | 1 | 4 | 16 | 24 | 12.5 | 2.0 |"]
    assert report.format_pipeline_table([report.summarize(plain, 1)]) == ""


def test_the_speedup_cell_shows_the_range_of_the_per_round_ratios():
    timing = RequestTiming(0.1, 0.01, 0.2, 3)

    def rounds(name: str, tokens_per_s: list[float]) -> SystemResult:
        return command.merge_rounds([SystemResult(name, {}, 1, 0.0, [[1]], [RunResult(1, False, 6 / t, 6, [timing], [[5]])])
                                     for t in tokens_per_s])

    systems = build_systems(["none"], 2, None, [1], with_peer=False, pipeline_parallel_size=2)
    results = {NOSPEC: rounds(NOSPEC, [10.0, 10.0, 10.0]), f"{NOSPEC}-pp2": rounds(f"{NOSPEC}-pp2", [8.0, 9.0, 7.0])}
    rows = report.build_summaries(systems, results, correctness.Correctness())
    assert rows[1].vs_nospec == pytest.approx(0.8) and rows[1].vs_nospec_range == pytest.approx((0.7, 0.9))
    assert rows[0].vs_nospec_range is None
    assert "| 0.80× (0.70–0.90) |" in report.format_table(rows, 2)
    single = {name: replace(r, runs=r.runs[:1]) for name, r in results.items()}  # one round: no range
    assert report.build_summaries(systems, single, correctness.Correctness())[1].vs_nospec_range is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_child_process_cpu_is_own_not_competing():
    """A pipeline group's other ranks are this system's processes: their CPU must not read as
    "other processes" (which would discard every pipeline run as disturbed)."""
    spin = "import time\nwhile time.process_time() < 0.5: pass\nprint('spun', flush=True)\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "spun\n"
        assert sum(schedule._descendants_cpu_s(os.getpid())) >= 0.45  # clock ticks: 0.49 s or so
    finally:
        child.kill()
        child.wait()


def test_bench_pipeline_and_overlap_end_to_end_on_tiny_model(tiny_hf_model_dir, tmp_path, capsys):
    """Without speculation (each speculative system costs two more subprocesses, ~10 s): the
    pipeline group serves all four runs (warm-up and timed at c = 1, 2) of its round."""
    out_dir = tmp_path / "results"
    argv = ["--model", str(tiny_hf_model_dir), "--num-prompts", "2", "--max-tokens", "5", "--concurrency", "1", "2",
            "--runs", "1", "--threads", "1", "--pipeline-parallel-size", "2", "--compare-overlap", "--skip-peer",
            "--busy-retries", "0", "--quiet-wait", "0", "--output-dir", str(out_dir)]
    assert command.main(argv) == 0

    printed = capsys.readouterr().out
    assert f"| {NOSPEC}-pp2-no-overlap | 2 |" in printed and "bubble ms/step" in printed
    data = json.loads(next(out_dir.glob("bench-*.json")).read_text())
    assert data["correctness"]["ok"]
    systems = data["systems"]
    assert list(systems) == [NOSPEC, f"{NOSPEC}-overlap", f"{NOSPEC}-pp2", f"{NOSPEC}-pp2-no-overlap"]
    (reference,) = [r["outputs"] for r in systems[NOSPEC]["runs"] if r["concurrency"] == 1 and not r["warmup"]]
    for name, system in systems.items():
        timed = [r for r in system["runs"] if not r["warmup"]]
        assert [r["concurrency"] for r in timed] == [1, 2]
        assert all(r["outputs"] == reference for r in timed), name  # greedy: every layout says the same
        for run in system["runs"]:
            pipeline = run["pipeline"]
            assert (pipeline is not None) == name.startswith(f"{NOSPEC}-pp2"), name
            if pipeline is not None:  # per run: the shared engine's counters were read as differences
                assert pipeline["steps"] >= 5 and pipeline["waiting_s_per_step"] > 0
                assert pipeline["first_stage_s_per_step"] > 0
                assert 0 < pipeline["verdict_bytes_per_step"] <= pipeline["verdict_budget_bytes_per_step"]
    rows = {(r["system"], r["concurrency"]): r for r in data["summary"]}
    assert rows[(f"{NOSPEC}-pp2", 2)]["pipeline"]["steps"] == systems[f"{NOSPEC}-pp2"]["runs"][3]["pipeline"]["steps"]
    assert rows[(f"{NOSPEC}-pp2", 1)]["vs_nospec"] is not None and rows[(NOSPEC, 1)]["pipeline"] is None
