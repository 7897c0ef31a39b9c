"""equivalence: the probe that holds a canary's greedy outputs to the stable's — comparing two
outputs (same, near-tie, divergence), the probe's requests and its control pair against runtime
stand-ins, the status it keeps; and on the emulator tier, the operator acting on it: a divergence
rolls back at once, a near-tie is shown, a control that disagrees with itself is inconclusive, a
model change is skipped."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from operator_harness import (
    FAST_ANALYSIS,
    Cluster,
    HttpStandIn,
    RuntimeStandIn,
    echo,
    emulated_cluster,
    running_stable,
    start_canary,
    wait_for,
)

from specdecode.operator.equivalence import (
    PROBE_PROMPTS,
    Match,
    Output,
    ProbeResult,
    Probing,
    compare,
    output_of,
    probe,
    prompts_for,
    recorded,
)
from specdecode.operator.loop import _probe_events
from specdecode.operator.spec import Equivalence, EquivalenceState, OutputDivergence

GAP = Equivalence().near_tie_logprob_gap  # 0.1 nats, fixed by the issue before any test


def output(*pairs: tuple[str, float]) -> Output:
    return Output(tuple(t for t, _ in pairs), tuple(g for _, g in pairs))


def changed_at(position: int, gap: float = 2.0):
    """An answer like ``echo`` whose token at ``position`` is another one, the stable's gap there ``gap``."""
    def answer(prompt: str, _: int) -> list[tuple[str, float]]:
        words = echo(prompt, 0)
        return [(word + "!" if i == position else word, gap) for i, (word, _) in enumerate(words)]
    return answer


def near_tie_at(position: int):
    """``echo`` with a near-tie (0.05 nats) at ``position``: what the stable answers there."""
    def answer(prompt: str, _: int) -> list[tuple[str, float]]:
        return [(word, 0.05 if i == position else gap) for i, (word, gap) in enumerate(echo(prompt, 0))]
    return answer


# -- comparing ----------------------------------------------------------------------------------


def test_equal_outputs_are_the_same_and_the_first_difference_decides():
    stable = output(("The", 3.0), (" cat", 0.05), (" sat", 2.0))
    assert compare("p", stable, stable, GAP).match is Match.SAME
    tie = compare("p", stable, output(("The", 1.0), (" dog", 1.0), (" ran", 1.0)), GAP)
    assert tie.match is Match.NEAR_TIE  # the stable's own top-2 at position 1 were 0.05 nats apart
    assert tie.divergence == OutputDivergence(prompt="p", position=1, stable_token=" cat", other_token=" dog",
                                              logprob_gap=0.05)
    wide = compare("p", output(("The", 3.0), (" cat", 0.5)), output(("The", 3.0), (" dog", 0.5)), GAP)
    assert wide.match is Match.DIVERGED and wide.divergence.logprob_gap == 0.5


def test_an_output_that_ended_early_differs_where_it_ended():
    stable = output(("Yes", 2.0), (".", 2.0))
    shorter = compare("p", stable, output(("Yes", 2.0)), GAP)
    assert shorter.match is Match.DIVERGED and (shorter.divergence.position, shorter.divergence.other_token) == (1, "")
    longer = compare("p", output(("Yes", 2.0)), stable, GAP)  # the stable ended: no gap can show a near-tie
    assert longer.match is Match.DIVERGED and longer.divergence.logprob_gap is None
    assert longer.divergence.stable_token == "" and longer.divergence.other_token == "."


def test_output_of_reads_tokens_and_top_two_gaps_and_refuses_no_logprobs():
    answer = {"choices": [{"logprobs": {"content": [
        {"token": "a", "logprob": -0.2, "top_logprobs": [{"token": "b", "logprob": -1.7}, {"token": "a", "logprob": -0.2}]},
        {"token": "c", "logprob": 0.0, "top_logprobs": [{"token": "c", "logprob": 0.0}]}]}}]}
    assert output_of(answer) == Output(("a", "c"), (pytest.approx(1.5), None))
    with pytest.raises(OSError, match="no logprobs"):
        output_of({"choices": [{"message": {"content": "hi"}}]})


def test_prompts_are_taken_in_turn_round_the_set():
    config = Equivalence(prompts_per_interval=5)
    assert len(PROBE_PROMPTS) >= 16 and len(set(PROBE_PROMPTS)) == len(PROBE_PROMPTS)
    assert prompts_for(config, 0) == list(PROBE_PROMPTS[:5])
    assert prompts_for(config, 14) == [*PROBE_PROMPTS[14:16], *PROBE_PROMPTS[:3]]
    assert prompts_for(Equivalence(prompts=("a", "b"), prompts_per_interval=4), 1) == ["b", "a"]


def test_recorded_adds_up_per_revision_and_a_divergence_stays():
    where = OutputDivergence(prompt="p", position=0, stable_token="a", other_token="b", logprob_gap=1.0)
    first = recorded(None, ProbeResult("rev2", EquivalenceState.PROBING, same=3, near_ties=1, message="3 of 4"))
    second = recorded(first, ProbeResult("rev2", EquivalenceState.PROBING, same=4))
    assert (second.prompts_same, second.near_ties, second.state) == (7, 1, EquivalenceState.PROBING)
    diverged = recorded(second, ProbeResult("rev2", EquivalenceState.DIVERGED, divergence=where, message="diverged"))
    assert diverged.last_divergence == where and diverged.state is EquivalenceState.DIVERGED
    assert recorded(diverged, ProbeResult("rev2", EquivalenceState.PROBING, same=4)) == diverged
    fresh = recorded(diverged, ProbeResult("rev3", EquivalenceState.PROBING, same=2))
    assert (fresh.revision, fresh.prompts_same, fresh.last_divergence) == ("rev3", 2, None)
    at_once = recorded(fresh, ProbeResult("rev4", EquivalenceState.DIVERGED, divergence=where, message="diverged"))
    assert (at_once.state, at_once.last_divergence, at_once.message) == (EquivalenceState.DIVERGED, where, "diverged")


# -- one probe, against stand-ins ---------------------------------------------------------------


def run_probe(stable: RuntimeStandIn, canary: RuntimeStandIn, prompts: list[str]) -> ProbeResult:
    return probe(stable.url, canary.url, revision="rev2", model="m", prompts=prompts, config=Equivalence(max_tokens=8))


def test_the_probe_asks_greedy_tokens_with_two_logprobs_alone_then_beside_load(stand_ins: list[HttpStandIn]):
    stand_ins.extend([stable := RuntimeStandIn(0.8), canary := RuntimeStandIn(0.8)])
    prompts = list(PROBE_PROMPTS[:4])
    result = run_probe(stable, canary, prompts)
    assert (result.state, result.same, result.near_ties) == (EquivalenceState.PROBING, 4, 0)
    assert [c["messages"][0]["content"] for c in stable.calls[:4]] == prompts  # alone: one at a time, in order
    assert len(stable.calls) == 8 and len(canary.calls) == 4
    assert {(c["model"], c["temperature"], c["logprobs"], c["top_logprobs"], c["max_tokens"])
            for c in stable.calls + canary.calls} == {("m", 0, True, 2, 8)}


def test_a_divergence_names_the_prompt_the_position_and_both_tokens(stand_ins: list[HttpStandIn]):
    stand_ins.extend([stable := RuntimeStandIn(0.8), canary := RuntimeStandIn(0.8, changed_at(2))])
    result = run_probe(stable, canary, ["What is 17 times 3?"])
    assert result.state is EquivalenceState.DIVERGED
    assert result.divergence == OutputDivergence(prompt="What is 17 times 3?", position=2, stable_token="17",
                                                 other_token="17!", logprob_gap=2.0)
    assert "'What is 17 times 3?' at generated token 2: stable '17'" in result.message


def test_a_near_tie_is_counted_not_failed(stand_ins: list[HttpStandIn]):
    stand_ins.extend([stable := RuntimeStandIn(0.8, near_tie_at(1)), canary := RuntimeStandIn(0.8, changed_at(1))])
    result = run_probe(stable, canary, ["Name three primary colours.", "What does HTTP stand for?"])
    assert (result.state, result.same, result.near_ties) == (EquivalenceState.PROBING, 0, 2)
    assert result.divergence.logprob_gap == pytest.approx(0.05) and "2 differed first at a near-tie" in result.message


def test_a_stable_that_disagrees_with_itself_makes_the_probe_inconclusive(stand_ins: list[HttpStandIn]):
    stand_ins.extend([stable := RuntimeStandIn(0.8, batch_variant), canary := RuntimeStandIn(0.8, changed_at(0))])
    result = run_probe(stable, canary, ["What is the capital of France?"])
    assert result.state is EquivalenceState.INCONCLUSIVE
    assert "cannot be proven on this hardware" in result.message


def test_a_probe_whose_requests_fail_is_inconclusive(stand_ins: list[HttpStandIn]):
    stand_ins.append(stable := RuntimeStandIn(0.8))
    gone = HttpStandIn(lambda _: ("text/plain", b""))
    gone.close()
    result = probe(stable.url, gone.url, revision="rev2", model="m", prompts=["p"], config=Equivalence(), timeout=5)
    assert result.state is EquivalenceState.INCONCLUSIVE and result.message.startswith("probe requests failed: ")


def test_a_probe_runs_on_its_own_thread_and_one_that_raises_is_inconclusive():
    release = threading.Event()
    running = Probing("rev2", lambda: release.wait(5) and ProbeResult("rev2", EquivalenceState.PROBING, same=1))
    assert running.result() is None  # the caller never waits for it
    release.set()
    assert wait_for(running.result, "the probe ended").same == 1
    broken = Probing("rev2", lambda: 1 / 0)
    ended = wait_for(broken.result, "the broken probe ended")
    assert ended.state is EquivalenceState.INCONCLUSIVE and "ZeroDivisionError" in ended.message


# -- the operator acting on it (emulator tier) --------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    with emulated_cluster(tmp_path, monkeypatch) as running:
        yield running


def stand_in_pair(cluster: Cluster, stand_ins: list[HttpStandIn], stable: str, canary: str
                  ) -> tuple[RuntimeStandIn, RuntimeStandIn]:
    """Ready stand-in pods for the stable and the canary revision, their metrics passing; the
    tests set what each answers."""
    pair = []
    for rev in (stable, canary):
        stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
        cluster.stand_in_pod("smollm2-ngram", rev, runtime.port)
        pair.append(runtime)
    return pair[0], pair[1]


def equivalence(cluster: Cluster) -> dict:
    return cluster.status("smollm2-ngram").get("equivalence") or {}


def batch_variant(prompt: str, nth: int) -> list[tuple[str, float]]:
    """A stable whose every second answer to a prompt (the probe's beside-load one) differs."""
    return changed_at(0)(prompt, nth) if nth % 2 else echo(prompt, nth)


def test_near_ties_are_shown_a_disagreeing_control_is_inconclusive_and_a_divergence_rolls_back(
        cluster: Cluster, stand_ins: list[HttpStandIn]):
    slow = {**FAST_ANALYSIS, "interval": "1s", "window": "30s"}  # no promotion before the probe is through
    stable = running_stable(cluster, rollout={"analysis": slow})
    assert cluster.status("smollm2-ngram")["stableModel"] == "smollm2-135m"
    canary = start_canary(cluster)
    stable_pod, canary_pod = stand_in_pair(cluster, stand_ins, stable, canary)
    stable_pod.answer, canary_pod.answer = near_tie_at(1), changed_at(1)
    seen = wait_for(lambda: (e := equivalence(cluster)).get("nearTies", 0) >= 4 and e, "near-ties counted")
    assert (seen["revision"], seen["state"], seen.get("promptsSame", 0)) == (canary, "Probing", 0)
    assert seen["lastDivergence"]["logprobGap"] == pytest.approx(0.05)

    stable_pod.answer = batch_variant  # this "hardware" changes greedy outputs with the batch
    seen = wait_for(lambda: (e := equivalence(cluster))["state"] == "Inconclusive" and e, "the control disagrees")
    assert "cannot be proven on this hardware" in seen["message"]
    assert cluster.status("smollm2-ngram").get("canaryRevision") == canary  # never a failure
    wait_for(lambda: any((t, r) == ("Warning", "EquivalenceInconclusive") for t, r, _ in cluster.events("smollm2-ngram")),
             "a Warning Event EquivalenceInconclusive")

    stable_pod.answer, canary_pod.answer = echo, changed_at(3)
    rolled_back = wait_for(lambda: cluster.condition("smollm2-ngram", "RolledBack").get("status") == "True"
                           and cluster.condition("smollm2-ngram", "RolledBack"), "RolledBack=True")
    assert rolled_back["reason"] == "OutputDiverged" and "at generated token 3" in rolled_back["message"]
    seen = equivalence(cluster)
    assert seen["state"] == "Diverged" and seen["lastDivergence"]["position"] == 3
    assert seen["lastDivergence"]["otherToken"].endswith("!")
    wait_for(lambda: any((t, r) == ("Warning", "OutputDiverged") for t, r, _ in cluster.events("smollm2-ngram")),
             "a Warning Event OutputDiverged")


def test_a_model_change_is_not_probed_and_says_so(cluster: Cluster, stand_ins: list[HttpStandIn]):
    stable = running_stable(cluster)
    cluster.patch("smollm2-ngram", {"spec": {"model": {"uri": "file:///models/other.gguf"}}})
    canary = wait_for(lambda: cluster.status("smollm2-ngram").get("canaryRevision"), "a canary revision")
    stable_pod, canary_pod = stand_in_pair(cluster, stand_ins, stable, canary)
    canary_pod.answer = changed_at(0)
    seen = wait_for(lambda: (e := equivalence(cluster)).get("state") == "Skipped" and e, "the probe skipped")
    assert seen["revision"] == canary and "outputs of two models are not compared" in seen["message"]
    assert stable_pod.calls == canary_pod.calls == []  # nothing was sent to either
    wait_for(lambda: [r for _, r, _ in cluster.events("smollm2-ngram")].count("EquivalenceSkipped") == 1,
             "one Event EquivalenceSkipped")


def test_only_a_disagreeing_control_or_a_skip_makes_an_event():
    where = OutputDivergence(prompt="p", position=0, stable_token="a", other_token="b", logprob_gap=1.0)
    control = ProbeResult("rev2", EquivalenceState.INCONCLUSIVE, divergence=where, message="the stable disagreed")
    failed = ProbeResult("rev2", EquivalenceState.INCONCLUSIVE, message="probe requests failed: HTTP 503")
    skipped = ProbeResult("rev2", EquivalenceState.SKIPPED, message="no ready stable replica to compare with")
    assert [e.reason for e in _probe_events(None, control)] == ["EquivalenceInconclusive"]
    assert _probe_events(None, failed) == []  # a replica going away mid-probe: status says so, no Warning
    assert [e.reason for e in _probe_events(recorded(None, control), skipped)] == ["EquivalenceSkipped"]
    assert _probe_events(recorded(None, skipped), skipped) == []  # once per state
