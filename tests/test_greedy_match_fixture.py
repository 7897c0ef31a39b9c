"""The ``assert_greedy_match`` fixture itself: equal outputs pass with no tie; a difference passes
only at a proven near-tie, after which the comparison goes on (a later corruption still fails);
near-ties are counted and capped. Exact ties are engineered by giving two tokens the same
LM-head row in a copy of the ``sharp`` model."""
import copy

import pytest
import torch


def greedy(full_forward, model, input_ids: list[int], n: int) -> list[int]:
    """n greedy tokens after input_ids, one full forward each (this test's own reference)."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(full_forward(model, input_ids + out)[-1].argmax()))
    return out


def top2(full_forward, model, input_ids: list[int]) -> list[int]:
    return full_forward(model, input_ids)[-1].topk(2).indices.tolist()


def other_of_tie(full_forward, model, input_ids: list[int], chosen: int) -> int:
    """The tied token that greedy did not choose."""
    (pair,) = [t for t in top2(full_forward, model, input_ids) if t != chosen]
    return pair


def diverge_at(full_forward, model, prompt: list[int], path: list[int], positions: list[int]) -> list[int]:
    """``path`` with the other tied token taken at each of ``positions`` (ascending), each time
    continued greedily on its own path to the same length."""
    out = list(path)
    for i in positions:
        out[i] = other_of_tie(full_forward, model, prompt + out[:i], out[i])
        out[i + 1 :] = greedy(full_forward, model, prompt + out[: i + 1], len(out) - i - 1)
    return out


N = 10


@pytest.fixture(scope="module")
def prompt(sharp):
    return sharp[1].encode("The quick brown fox")


@pytest.fixture(scope="module")
def one_tie_model(sharp, prompt, full_forward):
    """``sharp`` with the runner-up of output position 2 given the LM-head row of that position's
    argmax: the two tokens tie exactly wherever that argmax wins."""
    model = copy.deepcopy(sharp[0])
    path = greedy(full_forward, model, prompt, 3)
    best, runner_up = top2(full_forward, model, prompt + path[:2])
    with torch.no_grad():
        model.lm_head.weight[runner_up] = model.lm_head.weight[best]
    return model


@pytest.fixture(scope="module")
def twins_model(sharp):
    """``sharp`` with LM-head rows 2k and 2k+1 equal: every position's top-2 is an exact tie."""
    model = copy.deepcopy(sharp[0])
    with torch.no_grad():
        model.lm_head.weight[1::2] = model.lm_head.weight[0::2]
    return model


def first_tie(full_forward, model, prompt: list[int], path: list[int]) -> int:
    for i in range(len(path)):
        values = full_forward(model, prompt + path[:i])[-1].topk(2).values
        if float(values[0] - values[1]) <= 1e-6 * float(values[0].abs()):
            return i
    raise AssertionError("no tie on the path")


def test_identical_outputs_pass_with_no_tie(sharp, prompt, full_forward, assert_greedy_match):
    expected = greedy(full_forward, sharp[0], prompt, N)
    assert assert_greedy_match(sharp[0], prompt, expected, list(expected)) == 0


def test_an_exact_tie_passes_once_and_the_comparison_goes_on_after_it(one_tie_model, prompt, full_forward, assert_greedy_match):
    model = one_tie_model
    expected = greedy(full_forward, model, prompt, N)
    i = first_tie(full_forward, model, prompt, expected)
    assert i <= 2
    actual = diverge_at(full_forward, model, prompt, expected, [i])
    assert actual[i] != expected[i] and actual[i + 1 :] != expected[i + 1 :]  # the paths really part
    assert assert_greedy_match(model, prompt, expected, actual) == 1
    # A later token of actual corrupted (to a token outside that position's top-2): the comparison
    # after the tie catches it.
    j = i + 3
    logits = full_forward(model, prompt + actual[:j])[-1]
    corrupted = actual[:j] + [int(logits.argmin())] + actual[j + 1 :]
    with pytest.raises(AssertionError, match=rf"differ at {j} .* without a near-tie"):
        assert_greedy_match(model, prompt, expected, corrupted)


def test_a_difference_without_a_near_tie_fails(sharp, prompt, full_forward, assert_greedy_match):
    model = sharp[0]
    expected = greedy(full_forward, model, prompt, N)
    runner_up = top2(full_forward, model, prompt + expected[:3])[1]  # top-2, but far from a tie
    actual = expected[:3] + [runner_up] + greedy(full_forward, model, prompt + expected[:3] + [runner_up], N - 4)
    with pytest.raises(AssertionError, match=r"differ at 3 .* without a near-tie"):
        assert_greedy_match(model, prompt, expected, actual)


def test_ties_are_counted_and_capped(twins_model, prompt, full_forward, assert_greedy_match):
    model = twins_model
    expected = greedy(full_forward, model, prompt, N)
    actual = diverge_at(full_forward, model, prompt, expected, [2, 6])
    assert assert_greedy_match(model, prompt, expected, actual, max_ties=2) == 2
    with pytest.raises(AssertionError, match=r"2 near-ties at positions \[2, 6\]: more than max_ties=1"):
        assert_greedy_match(model, prompt, expected, actual)
