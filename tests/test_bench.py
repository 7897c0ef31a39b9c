"""``specdecode bench``: end to end on the tiny random model (both systems, real subprocesses),
and the output checks on hand-made results. No timing is asserted: the machine is noisy."""
import json

import pytest
import torch

from specdecode.bench import command, correctness, report
from specdecode.bench.records import RequestTiming, RunResult, SystemResult, TieCheck
from specdecode.bench.systems import NOSPEC, PEER_PLAIN, build_systems


def test_bench_end_to_end_on_tiny_model(tiny_hf_model_dir, tmp_path, capsys):
    out_dir = tmp_path / "results"
    argv = ["--model", str(tiny_hf_model_dir), "--num-prompts", "2", "--max-tokens", "4", "--runs", "2",
            "--threads", "1", "--busy-retries", "0", "--quiet-wait", "0", "--output-dir", str(out_dir)]
    assert command.main(argv) == 0

    printed = capsys.readouterr().out
    assert f"| {NOSPEC} | 1 |" in printed and f"| {PEER_PLAIN} | 8 |" in printed
    (json_path,) = out_dir.glob("bench-*.json")
    (png_path,) = out_dir.glob("bench-*.png")
    assert png_path.read_bytes().startswith(b"\x89PNG")
    data = json.loads(json_path.read_text())
    assert data["correctness"]["ok"] and data["correctness"]["mismatches"] == []
    assert data["correctness"]["references"] == {f"{NOSPEC}@1": PEER_PLAIN, f"{NOSPEC}@8": f"{NOSPEC} c=1"}
    assert {"torch", "transformers", "python", "git_commit"} <= data["versions"].keys()
    assert data["machine"]["threads"] == 1
    ours, peer = data["systems"][NOSPEC], data["systems"][PEER_PLAIN]
    assert ours["prompt_token_ids"] == peer["prompt_token_ids"]
    for system in (ours, peer):  # two rounds: each system ran twice, a warm-up and c = 1, 8 each time
        assert [(r["round"], r["concurrency"], r["warmup"]) for r in system["runs"]] == [
            (n, c, w) for n in (1, 2) for c in (1, 8) for w in (True, False)]
        timed = [r for r in system["runs"] if not r["warmup"]]
        assert all(len(o) == 4 for r in timed for o in r["outputs"])
    assert [r["system"] for r in data["summary"]] == [NOSPEC, PEER_PLAIN] * 2
    assert data["truncation"]["keep_tokens"] == 2048 - 4 and data["truncation"]["note"].startswith("0 of 2")


def _rounds(name: str, tokens_per_s: list[float]) -> SystemResult:
    """One result per round (as each round's subprocess returns it), merged as ``command`` does."""
    timing = RequestTiming(0.1, 0.01, 0.2, 3)
    per_round = [SystemResult(name, {}, 1, 0.0, [[1]], [RunResult(1, False, 6 / t, 6, [timing] * 2, [[5]] * 2)])
                 for t in tokens_per_s]
    return command.merge_rounds(per_round)


def test_rounds_interleave_systems_and_speedups_pair_within_a_round():
    systems = build_systems(["ngram"], 2, None, [1])
    assert [s.name for s in command.round_order(systems, 1)][0] == NOSPEC
    assert [s.name for s in command.round_order(systems, 2)][-1] == NOSPEC
    assert command.round_order(systems, len(systems) + 1) == systems

    # The machine slows down 2x in round 2 and 3x in round 3; ngram is 1.5x nospec within each round.
    nospec, ngram = _rounds(NOSPEC, [10.0, 5.0, 20 / 6]), _rounds("ours-ngram", [15.0, 7.5, 5.0])
    assert [r.round for r in ngram.runs] == [1, 2, 3]
    assert report.paired_ratio(ngram, nospec, 1) == pytest.approx(1.5)
    assert report.paired_ratio(ngram, nospec, 8) is None
    # Without nospec's round 2 a ratio of medians would read 7.5 / 6.67 = 1.125; paired, it stays 1.5.
    nospec.runs[1].discarded = True
    assert report.paired_ratio(ngram, nospec, 1) == pytest.approx(1.5)


def _system(name: str, outputs_by_c: dict[int, list[list[int]]], ties=()) -> SystemResult:
    timing = RequestTiming(0.1, 0.01, 0.2, 3)
    runs = [RunResult(c, False, 1.0, 3 * len(o), [timing] * len(o), o) for c, o in outputs_by_c.items()]
    return SystemResult(name, {}, 1, 0.0, [[1, 2]] * 2, runs, list(ties))


def test_mismatch_is_a_failure_unless_a_near_tie():
    systems = build_systems(["none"], 4, None, [1, 8])
    peer = _system(PEER_PLAIN, {1: [[5, 6, 7], [8, 9, 10]], 8: [[5, 6, 7], [8, 9, 10]]},
                   [TieCheck(1, 1, 9, 4, [9, 4], [20.0, 20.0005])])
    tie = _system(NOSPEC, {1: [[5, 6, 7], [8, 4, 11]], 8: [[5, 6, 7], [8, 4, 11]]})
    result = correctness.check(systems, {NOSPEC: tie, PEER_PLAIN: peer})
    assert result.ok and [m.near_tie for m in result.mismatches] == [True]

    peer.tie_checks = [TieCheck(1, 1, 9, 4, [9, 4], [20.0, 19.0])]  # a clear winner: a real bug
    assert not correctness.check(systems, {NOSPEC: tie, PEER_PLAIN: peer}).ok


def test_batch_output_must_equal_our_single_output():
    systems = build_systems(["none"], 4, None, [1, 8], with_peer=False)
    ours = _system(NOSPEC, {1: [[5, 6, 7], [8, 9, 10]], 8: [[5, 6, 7], [8, 9, 3]]})
    result = correctness.check(systems, {NOSPEC: ours})
    assert not result.ok and [(m.concurrency, m.prompt_index) for m in result.mismatches] == [(8, 1)]
    rows = report.build_summaries(systems, {NOSPEC: ours}, result)
    assert rows[1].check.startswith("MISMATCH") and rows[0].vs_peer is None


def test_a_run_disturbed_by_other_processes_is_discarded_and_repeated(monkeypatch):
    from specdecode.bench import schedule
    from specdecode.bench.records import Job

    readings = iter([0.0, 0.0, 0.9, 0.0])  # warm-up, run 1, run 2 (busy), run 2 again

    class FakeMeter:
        def cores(self):
            return next(readings)

    monkeypatch.setattr(schedule, "CompetingCpu", FakeMeter)
    job = Job("ours", "m", "float32", "cpu", 1, 3, [1], runs=2, busy_retries=1, quiet_wait_s=0, prompts=[])
    timing = RequestTiming(0.1, 0.01, 0.2, 3)
    runs = schedule.run_schedule(
        "ours", job, [[1], [2], [3]], lambda ids, c, warmup, tag: RunResult(c, warmup, 1.0, 3, [timing], [[7]] * len(ids))
    )
    assert [(r.warmup, r.discarded) for r in runs] == [(True, False), (False, False), (False, True), (False, False)]
    result = SystemResult("ours", {}, 1, 0.0, [], runs)
    assert len(result.timed(1)) == 2 and result.max_competing_cpu_cores == 0.0


def test_bench_kernels_plumbing_under_the_interpreter(tmp_path, capsys):
    """Small sizes on the CPU under TRITON_INTERPRET=1: every kernel's Triton output equals its
    reference, and the table, JSON and plot are written (the timings mean nothing here)."""
    from specdecode.runtime.cli import main

    assert main(["bench-kernels", "--device", "cpu", "--quick", "--repeats", "1", "--output-dir", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("kernels-*.json")).read_text())
    kernels = {t["kernel"] for t in data["timings"]}
    assert kernels == {"greedy_verify", "target_match_verify", "rejection_verify", "rejection_verify_one_hot",
                       "topp_verify", "ngram_propose"}
    assert all(t["triton_us"] > 0 and t["reference_us"] > 0 for t in data["timings"])
    assert next(tmp_path.glob("kernels-*.png")).stat().st_size > 0
    assert "| rejection_verify |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, reason", [
    (["--device", "bogus"], "is not a device"),
    pytest.param(["--device", "cuda"], "no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),
    (["--device", "cpu", "--repeats", "0"], "--repeats must be >= 1"),
])
def test_bench_kernels_refuses_bad_arguments_with_a_reason(argv, reason):
    from specdecode.runtime.cli import main

    with pytest.raises(SystemExit, match=reason):
        main(["bench-kernels", *argv])



def test_bench_step_plumbing_and_paired_ratios(tiny_hf_model_dir, tmp_path, capsys):
    """The smallest grid on the tiny model, no baseline: the worker runs, the table, JSON and plot
    are written (the timings mean nothing here). Then two hand-made rounds of both checkouts: the
    ratio is the median of the per-round ratios, not a ratio of medians."""
    import argparse

    from specdecode.bench import step
    from specdecode.runtime.cli import main

    out = tmp_path / "results"
    argv = ["bench-step", "--model", str(tiny_hf_model_dir), "--device", "cpu", "--batch", "1", "--context", "64",
            "--k", "0", "--steps", "2", "--rounds", "1", "--output-dir", str(out)]
    assert main(argv) == 0
    data = json.loads(next(out.glob("step-*.json")).read_text())
    assert list(data["checkouts"]) == ["this"] and data["dtype"] == "float32" and data["threads"] == 1
    assert data["checkouts"]["this"]["attention_module"].endswith("attention.py")
    (case,) = data["cases"]
    assert (case["case"], case["batch"], case["context"], case["k"]) == ("B=1 L=64 K=0", 1, 64, 0)
    (measured,) = case["this"]["rounds"]
    assert measured["ms_per_step"] > 0 and measured["tokens_per_s"] > 0 and measured["rows_per_step"] == 1.0
    assert measured["attention_copied_bytes_per_step"] >= 0 and measured["attention_largest_copy_bytes"] > 0
    assert measured["context_at_start"] >= 65
    assert measured["syncs_per_step"] >= 1 and measured["ops_per_step"] > 100  # the sampled token is read back
    assert measured["uploads_per_step"] >= 1  # the step's inputs
    assert "ratio_ms_per_step" not in case
    assert next(out.glob("step-*.png")).read_bytes().startswith(b"\x89PNG")
    assert "| B=1 L=64 K=0 | 1.0 |" in capsys.readouterr().out

    def worker(ms: float, copied: float) -> dict:  # one worker run's result, as the worker writes it
        meta = {k: data["checkouts"]["this"][k] for k in ("device", "dtype", "torch", "attention_module")}
        return {**meta, "device_name": "CPU",
                "cases": [{**measured, "ms_per_step": ms, "attention_copied_bytes_per_step": copied,
                           "attention_largest_copy_bytes": copied / 40}]}

    checkouts = [step.Checkout(step.BASELINE, "python", tmp_path), step.Checkout(step.THIS, "python", tmp_path)]
    rounds = {step.BASELINE: [worker(200.0, 4e8), worker(400.0, 4e8)],
              step.THIS: [worker(100.0, 0.0), worker(330.0, 0.0)]}
    args = argparse.Namespace(model="m", steps=2, rounds=2, threads=1, load_format="dummy", graphs="off")
    report = step.build_report(args, checkouts, [step.Case(1, 64, 0)], rounds)
    assert step.format_table(report).startswith("bench-step: m (dummy weights) on CPU")
    assert report["cases"][0]["ratio_ms_per_step"] == pytest.approx((0.5 + 0.825) / 2)  # not 215 / 300
    assert "| B=1 L=64 K=0 | 1.0 / 1.0 | 300.0 | 215.0 | 0.66× |" in step.format_table(report)
    counts = " | ".join(f"{measured[f'{what}_per_step']:.0f}" for what in step.COUNTS for _ in range(2))
    assert step.format_table(report).split("\n")[-1].endswith(f"| 400.0 MB | 0 B | 10.0 MB | 0 B | {counts} |")
