"""Host↔device traffic of a verify step, counted as ``bench/step.py`` counts it (a TorchFunctionMode):
one upload of everything the verifier and sampler need, and reads that do not grow with the batch."""
import torch
from torch.overrides import TorchFunctionMode

from specdecode.runtime.config import VerifyStrategy
from specdecode.runtime.engine.sampler import SamplerRow
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.engine.verifier import Verifier

SYNCS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"})
VOCAB = 32


class Transfers(TorchFunctionMode):
    """Uploads (``torch.tensor``/``as_tensor`` given a device, a non-blocking ``.to``) and syncs
    (Tensor→Python conversions, a blocking ``.to`` the CPU), as bench-step counts them."""

    def __init__(self):
        super().__init__()
        self.uploads = self.syncs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        blocking_to_cpu = name == "to" and not kwargs.get("non_blocking") and any(
            str(a).startswith("cpu") for a in (*args[1:], kwargs.get("device")))
        self.syncs += name in SYNCS or blocking_to_cpu
        self.uploads += (name in ("tensor", "as_tensor") and "device" in kwargs) or (
            name == "to" and bool(kwargs.get("non_blocking")))
        return func(*args, **kwargs)


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
    with Transfers() as counted:
        verdicts = verifier(logits, rows)
    assert len(verdicts) == batch and verdicts[0].logprobs
    return counted.uploads, counted.syncs


def test_a_verify_step_uploads_once_and_syncs_as_often_at_batch_1_as_at_batch_8():
    assert transfers(1) == transfers(8)
    assert transfers(8)[0] == 1
