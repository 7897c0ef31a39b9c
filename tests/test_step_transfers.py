"""Host↔device traffic of a step, counted by ``bench/step.py``'s ``counting`` (torch function and
dispatch modes): a verify step uploads everything the verifier and sampler need once, with reads that
do not grow with the batch; a whole decode step reads the device once, at batch 1 as at batch 32,
and its preparation dispatches as many ops at either; so does an n-gram verify step (exact shapes
and batch buckets), its drafts for the next step read with its verdicts; bucketed, it uploads once."""
import pytest
import torch

from specdecode.bench.step import counting
from specdecode.runtime.config import VerifyStrategy
from specdecode.runtime.engine.sampler import SamplerRow
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.engine.verifier import Verifier

VOCAB = 32


def step_rows(batch: int) -> list[SamplerRow]:
    """Sampled and greedy sequences alternating, 0 to 3 drafts (one with dense q), penalties,
    logit bias and top-k/top-p on some, logprobs on every third only (the first asks)."""
    gen = torch.Generator().manual_seed(batch)
    rows = []
    for i in range(batch):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=5 * (i % 3), top_p=0.9 if i % 4 else 1.0,
                                presence_penalty=0.5 * (i % 2), frequency_penalty=0.25 * (i % 3),
                                logit_bias=((i, 3.0),) if i % 3 else (), logprobs=2 if i % 3 == 0 else None)
        drafts = torch.randint(0, VOCAB, (i % 4,), generator=gen).tolist()
        q = torch.rand(len(drafts), VOCAB, generator=gen).softmax(-1) if i == 2 else None  # [K_i, V]
        rows.append(SamplerRow(params, seed=i, first_position=10, output_token_ids=[1, 2, i], draft_token_ids=drafts,
                               draft_probs=q))
    return rows


def transfers(batch: int) -> tuple[int, int]:
    rows = step_rows(batch)
    logits = torch.randn(sum(r.num_rows for r in rows), VOCAB, generator=torch.Generator().manual_seed(0))  # [R, V]
    verifier = Verifier(VerifyStrategy.REJECTION, verify_top_p=0.9)
    with counting() as counted:
        verdicts = verifier(logits, rows)
    assert len(verdicts) == batch and verdicts[0].logprobs
    return counted["uploads"], counted["syncs"]


def test_a_verify_step_uploads_once_and_syncs_as_often_at_batch_1_as_at_batch_8():
    assert transfers(1) == transfers(8)
    assert transfers(8)[0] == 1


def counting_preparation(engine, monkeypatch) -> list[int]:
    """The ops each step's preparation dispatches, appended as it runs: its host lists
    (``ModelRunner.prepare``), their one upload and their views on the device."""
    from specdecode.runtime.engine import execution
    from specdecode.runtime.engine.model_runner import StepLists

    ops: list[int] = []

    def counted(run):
        def wrapper(*args, **kwargs):
            with counting() as counted_ops:
                out = run(*args, **kwargs)
            ops.append(counted_ops["ops"])
            return out
        return wrapper

    monkeypatch.setattr(engine.runner, "prepare", counted(engine.runner.prepare))
    monkeypatch.setattr(execution, "upload_groups", counted(execution.upload_groups))
    monkeypatch.setattr(StepLists, "on_device", counted(StepLists.on_device))
    return ops


def decode_step(tiny, make_engine, monkeypatch, batch: int) -> tuple[int, int, int]:
    """(syncs, uploads) of one plain decode step over ``batch`` sequences (greedy and seeded sampled
    alternating), and the ops its preparation dispatched."""
    model, tokenizer = tiny
    engine = make_engine(model, tokenizer, overlap=False)
    for i in range(batch):
        params = SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        engine.add_request(str(i), [1 + i, 2, 3, 4 + i], params)
    engine.step()  # the prompts
    engine.step()  # a first decode step: warm
    with monkeypatch.context() as patch:
        prepare_ops = counting_preparation(engine, patch)
        with counting() as counted:
            outputs = engine.step()
    assert len(outputs) == batch and all(len(out.deltas[0].token_ids) == 1 for out in outputs)
    assert len(prepare_ops) == 3  # prepare, the upload, the views
    return counted["syncs"], counted["uploads"], sum(prepare_ops)


def test_a_decode_step_reads_the_device_once_and_prepares_in_as_many_ops_at_batch_1_as_at_32(tiny, make_engine,
                                                                                             monkeypatch):
    syncs, uploads, prepare_ops = decode_step(tiny, make_engine, monkeypatch, 1)
    assert syncs == 1  # the verdicts
    assert decode_step(tiny, make_engine, monkeypatch, 32) == (syncs, uploads, prepare_ops)


def verify_step(sharp_target, make_engine, monkeypatch, batch: int, buckets: bool) -> tuple[int, int, int, int]:
    """(syncs of the forward and verification, syncs and uploads of the whole step, its preparation's
    ops) of the first n-gram verify step (K = 4) over ``batch`` sequences (prompts that repeat, a
    model that repeats)."""
    model, tokenizer = sharp_target
    engine = make_engine(model, tokenizer, overlap=False, buckets=buckets,
                         spec={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    for i in range(batch):
        engine.add_request(str(i), [5 + i % 7, 6, 7, 8] * 4, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompts
    launch, launch_syncs = engine.execution.launch, []

    def counted_launch(scheduled, step, rows):
        with counting() as counted:
            pending = launch(scheduled, step, rows)  # overlap off: the forward and verification run here
        if any(item.num_draft for item in scheduled):
            launch_syncs.append(counted["syncs"])
        return pending

    engine.execution.launch = counted_launch
    for _ in range(20):
        with monkeypatch.context() as patch:
            prepare_ops = counting_preparation(engine, patch)
            with counting() as counted:
                engine.step()
        if launch_syncs:
            return launch_syncs[0], counted["syncs"], counted["uploads"], sum(prepare_ops)
    raise AssertionError("no step verified drafts")


@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "bucketed"])
def test_a_verify_step_reads_the_device_once_at_batch_1_as_at_32(sharp_target, make_engine, monkeypatch, buckets):
    """An n-gram verify step reads the device once in all: the verdicts, and with them the drafts of the
    next step, made from them on the device (its own drafts came with the previous step's verdicts).
    Bucketed, it writes to the device once too: the forward's, the verifier's and the proposer's inputs
    in one copy (with exact shapes the CPU attention path uploads its groups' own index tensors)."""
    launch_syncs, step_syncs, uploads, prepare_ops = verify_step(sharp_target, make_engine, monkeypatch, 1, buckets)
    assert (launch_syncs, step_syncs) == (1, 1)
    if buckets:
        assert uploads == 1
    assert verify_step(sharp_target, make_engine, monkeypatch, 32, buckets) == (launch_syncs, step_syncs, uploads,
                                                                               prepare_ops)
