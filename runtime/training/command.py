"""``specdecode train-mtp`` and ``specdecode train-eagle3``: train a head for a model that has none,
then measure it.

Phases, each with its progress bar: generate the model's own continuations of the training
prompts, then read text teacher-forced (one prefill a chat: about 1.6× the tokens per second of
generating), recording at every position what the head reads (MTP: the tapped hidden states;
EAGLE-3: the residual streams entering its aux layers) and the model's greedy next token
(``distill.py``); train (``trainer.py``, with ``mtp_head.py``'s or ``eagle3_head.py``'s loss);
write the head (MTP: DeepSeek-V3-named safetensors + config.json, ``models/mtp_checkpoint.py``;
EAGLE-3: speculators' format, ``models/eagle3_checkpoint.py``); then evaluate it by running the
engine with ``method: mtp`` or ``eagle3`` on held-out prompts and print the per-position
acceptance it measured. Where the device multiplies bfloat16 natively, the data is recorded by a
bfloat16 copy of the model and the head trains in mixed precision (``--precision``); the
evaluation runs the model as served. Both heads share the data, prompts, disjointness rules,
draft vocabulary and evaluation; a ``HeadKind`` holds what differs. The defaults fit 20 minutes
on a 2-core CPU for SmolLM2-135M (docs/mtp.md has the timings); ``train_report.json`` in the
output folder records settings, timings and results.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.runtime.config import DType
from specdecode.runtime.serve_flags import add_model_arguments, engine_config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from specdecode.runtime.models.decoder import DecoderLM
    from specdecode.runtime.training.distill import Distilled, HiddenRecorder
    from specdecode.runtime.training.trainer import BatchLoss

TRAIN_DEFAULTS = dict(num_prompts=320, max_tokens=96, text_tokens=500_000, epochs=2, num_layers=1, depth=2, seed=0,
                      eval_prompts=16, eval_max_tokens=96, eval_k=2, coverage=0.95, lr=3e-3)
TEXT_MAX_LEN = 512  # tokens of one --text chat read
POSITIVE = ("max_tokens", "epochs", "depth", "eval_prompts", "eval_max_tokens", "eval_k")


@dataclass(frozen=True)
class Trainee:
    """A fresh head, its loss per batch, and how it is written once trained."""

    head: nn.Module
    loss: BatchLoss
    save: Callable[[Path], None]


@dataclass(frozen=True)
class HeadKind:
    """What differs between the heads ``train-mtp`` and ``train-eagle3`` train: the recorder of what
    the head reads, the head and its loss over the draft vocabulary (ranked ids [V'], default size),
    and the ``--speculative-config`` that serves a head folder."""

    command: str
    check: Callable[[argparse.Namespace], str | None]  # a bad argument's message, before any work
    recorder: Callable[[argparse.Namespace, DecoderLM], HiddenRecorder]
    trainee: Callable[[argparse.Namespace, DecoderLM, Distilled, torch.Tensor, int], Trainee]
    spec: Callable[[Path], dict[str, str]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``train-mtp``'s arguments."""
    _add_shared(parser)
    parser.add_argument("--num-layers", type=int, default=TRAIN_DEFAULTS["num_layers"],
                        help="MTP modules L (draft k uses module k mod L) [%(default)s]")
    parser.add_argument("--hidden-tap", choices=["post_norm", "pre_norm"], default="post_norm",
                        help="the target hidden state the head reads: after or before its final norm [%(default)s]")


def add_eagle3_arguments(parser: argparse.ArgumentParser) -> None:
    """``train-eagle3``'s arguments."""
    _add_shared(parser)  # a step costs a little more than an MTP head's (0.22 s against 0.19 s): the same epochs
    parser.add_argument("--aux-layer-ids", type=_layer_ids, default=None, metavar="LOW,MID,HIGH",
                        help="the target layers whose entering residual streams the head fuses [vLLM's and "
                             "SGLang's default for L layers: 2, L // 2, L - 3]")


def _add_shared(parser: argparse.ArgumentParser) -> None:
    d = TRAIN_DEFAULTS
    add_model_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write the head to (created)")
    parser.add_argument("--prompts", default="sharegpt-followups",
                        help="training prompts: sharegpt-followups (later user turns of ShareGPT, half with code, "
                             "disjoint from every benchmark and evaluation prompt), or a JSON/JSONL file as "
                             "`specdecode bench --prompts` reads [%(default)s]")
    parser.add_argument("--num-prompts", type=int, default=d["num_prompts"], help="training prompts [%(default)s]")
    parser.add_argument("--max-tokens", type=int, default=d["max_tokens"],
                        help="tokens the model generates per training prompt [%(default)s]")
    parser.add_argument("--text", default="sharegpt-replies",
                        help="text read teacher-forced (one prefill a chat, no generation; the labels are still the "
                             "model's own greedy tokens): sharegpt-replies (the training prompts' kind of follow-up "
                             "turn with the assistant reply that followed it), or a JSON/JSONL file of chats "
                             "[%(default)s]")
    parser.add_argument("--text-tokens", type=int, default=d["text_tokens"],
                        help=f"tokens of --text to read, each chat cut at {TEXT_MAX_LEN}; 0 reads none [%(default)s]")
    parser.add_argument("--precision", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="dtype the data is recorded in (a bfloat16 copy of the model) and the head's matmuls "
                             "run in (mixed precision: its weights stay float32); auto: bfloat16 where the device "
                             "multiplies it natively (CUDA compute capability ≥ 8, a CPU with AVX512-BF16 or AMX). "
                             "A model served in half precision records and trains in its own dtype; the held-out "
                             "evaluation runs the model as served [%(default)s]")
    parser.add_argument("--epochs", type=int, default=d["epochs"], help="passes over the data [%(default)s]")
    parser.add_argument("--depth", type=int, default=d["depth"],
                        help="draft positions trained per chain (train for the K you will serve) [%(default)s]")
    parser.add_argument("--lr", type=float, default=d["lr"], help="AdamW learning rate [%(default)s]")
    parser.add_argument("--seed", type=int, default=d["seed"], help="initialisation and shuffling seed [%(default)s]")
    parser.add_argument("--draft-vocab-coverage", type=float, default=d["coverage"],
                        help="the head's default reduced draft vocabulary: the most frequent training labels "
                             "covering this share of them [%(default)s]")
    parser.add_argument("--eval-prompts", type=int, default=d["eval_prompts"],
                        help="held-out prompts (half sharegpt-chat, half humaneval) [%(default)s]")
    parser.add_argument("--eval-prompts-file", default=None, metavar="FILE",
                        help="take the held-out prompts from this JSON/JSONL file instead")
    parser.add_argument("--eval-max-tokens", type=int, default=d["eval_max_tokens"], help="[%(default)s]")
    parser.add_argument("--eval-k", type=int, default=d["eval_k"], help="K of the held-out run [%(default)s]")


def _layer_ids(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def run(args: argparse.Namespace) -> int:
    """``train-mtp``."""
    return _run(args, MTP)


def run_eagle3(args: argparse.Namespace) -> int:
    """``train-eagle3``."""
    return _run(args, EAGLE3)


def _run(args: argparse.Namespace, kind: HeadKind) -> int:
    import torch
    from tqdm import tqdm

    from specdecode.runtime.models.loader import load_model
    from specdecode.runtime.training import distill, prompts, trainer

    problem = kind.check(args) or _check_counts(args)
    if problem:
        print(f"{kind.command}: {problem}", file=sys.stderr)
        return 2
    timings: dict[str, float] = {}
    started = time.monotonic()
    try:
        prompts.ensure_installed()
        chats = prompts.training_prompts(args.prompts, args.num_prompts) if args.num_prompts else []
        texts = prompts.training_text(args.text) if args.text_tokens else []
        if args.text_tokens and not texts:
            raise ValueError(f"--text {args.text}: no chats to read")
        heldout = prompts.heldout_prompts(args.eval_prompts, args.eval_prompts_file)
        prompts.check_disjoint(chats + texts, heldout)
    except (ValueError, OSError) as exc:
        print(f"{kind.command}: {exc}", file=sys.stderr)
        return 2
    cfg = engine_config(args)
    loaded = load_model(cfg.load)
    model, tokenizer = loaded.model, loaded.tokenizer
    precision = _precision(args.precision, loaded.dtype, loaded.device)
    recording = model if precision == loaded.dtype else load_model(
        cfg.load.model_copy(update={"dtype": DType.BFLOAT16})).model
    try:
        recorder = kind.recorder(args, recording)
    except ValueError as exc:
        print(f"{kind.command}: {exc}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)

    def record(ids: list[list[int]], max_tokens: int, desc: str) -> Distilled:
        with tqdm(total=len(ids), desc=desc, unit="chat") as bar:
            return distill.generate(recording, tokenizer, ids, max_tokens, recorder, loaded.device, precision,
                                    bar.update)

    data = record([_chat_ids(tokenizer, chat) for chat in chats], args.max_tokens, "generate")
    timings["generate_s"] = time.monotonic() - started
    text_ids = _text_ids(tokenizer, texts, args.text_tokens)
    data += record(text_ids, 1, "read")  # prefill only
    timings["read_s"] = time.monotonic() - started - sum(timings.values())
    del recording, recorder  # a bfloat16 copy is not needed past here

    vocab_ids, default_size = _draft_vocabulary(data, args.draft_vocab_coverage)
    trainee = kind.trainee(args, model, data, vocab_ids.to(loaded.device), default_size)
    train_cfg = trainer.TrainConfig(epochs=args.epochs, depth=args.depth, lr=args.lr, seed=args.seed,
                                    autocast=None if precision == torch.float32 else precision)
    with tqdm(total=args.epochs * trainer.num_batches(data, train_cfg), desc="train", unit="step") as bar:
        losses = trainer.train(trainee.head, data, train_cfg, trainee.loss, loaded.device, loaded.dtype,
                               lambda n, loss: (bar.update(n), bar.set_postfix(loss=f"{loss:.3f}")))
    out = Path(args.out)
    trainee.save(out)
    timings["train_s"] = time.monotonic() - started - sum(timings.values())

    evaluation = _evaluate(model, tokenizer, cfg, kind.spec(out), heldout, args.eval_k, args.eval_max_tokens)
    timings["evaluate_s"] = time.monotonic() - started - sum(timings.values())
    timings["total_s"] = time.monotonic() - started
    report = {"settings": {k: v for k, v in vars(args).items() if k != "run"}, "precision": str(precision),
              "training_tokens": data.num_tokens, "generated_chats": len(chats),
              "read_chats": len(text_ids),
              "epoch_losses": losses, "draft_vocab_size": default_size, "heldout": evaluation, "timings": timings}
    (out / "train_report.json").write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    _print_summary(out, data.num_tokens, losses, evaluation, timings, args.eval_k)
    return 0


def _check_counts(args: argparse.Namespace) -> str | None:
    bad = [f"--{name.replace('_', '-')}" for name in POSITIVE + ("num_layers",) if getattr(args, name, 1) < 1]
    bad += [f"--{name.replace('_', '-')}" for name in ("num_prompts", "text_tokens") if getattr(args, name) < 0]
    if bad or not 0 < args.draft_vocab_coverage <= 1:
        return f"{', '.join(bad) or '--draft-vocab-coverage'} out of range (counts ≥ 1, --num-prompts and " \
               "--text-tokens ≥ 0, coverage in (0, 1])"
    if not args.num_prompts and not args.text_tokens:
        return "no training data: --num-prompts and --text-tokens are both 0"
    return None


def _precision(choice: str, served: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the data is recorded in and the head's matmuls run in: a model served in half precision
    keeps its own; ``auto`` is bfloat16 where the device multiplies it natively, else float32."""
    import torch

    from specdecode.runtime.device import has_native_bfloat16

    if served != torch.float32:
        return served
    if choice == "auto":
        return torch.bfloat16 if has_native_bfloat16(device) else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[choice]


def _mtp_recorder(args: argparse.Namespace, model: DecoderLM) -> HiddenRecorder:
    from specdecode.runtime.models.mtp import HiddenTap
    from specdecode.runtime.training.distill import HiddenRecorder

    tap = HiddenTap(args.hidden_tap)
    return HiddenRecorder(lambda rows: tap.apply(model, rows))  # what MtpHead.tap gives the head at run time


def _mtp_trainee(args: argparse.Namespace, model: DecoderLM, data: Distilled, vocab_ids: torch.Tensor,
                 default_size: int) -> Trainee:
    """The MTP head saves every training label ranked (``draft_vocab_ids``) and trains over the default share."""
    from specdecode.runtime.models.loader import served_name
    from specdecode.runtime.models.mtp import HiddenTap, MtpConfig, TargetFingerprint
    from specdecode.runtime.models.mtp_checkpoint import save_mtp_head
    from specdecode.runtime.training import mtp_head
    from specdecode.runtime.training.trainer import TrainVocabulary

    cfg = MtpConfig(num_modules=args.num_layers, hidden_tap=HiddenTap(args.hidden_tap), draft_vocab_size=default_size,
                    target=TargetFingerprint.of(model, served_name(args.model)))
    head = mtp_head.init_head(model, cfg, args.seed)
    head.draft_vocab_ids = vocab_ids.cpu()
    vocab = TrainVocabulary.of(vocab_ids, model.config.vocab_size)
    return Trainee(head, mtp_head.loss_of(head, model, args.depth, vocab), lambda out: save_mtp_head(out, head, model))


def _eagle3_check(args: argparse.Namespace) -> str | None:
    ids = args.aux_layer_ids
    if ids is not None and (len(ids) != 3 or list(ids) != sorted(set(ids))):
        return f"--aux-layer-ids {','.join(map(str, ids))}: three distinct target layers, ascending"
    return None


def _eagle3_recorder(args: argparse.Namespace, model: DecoderLM) -> HiddenRecorder:
    from specdecode.runtime.training.distill import HiddenRecorder

    return HiddenRecorder(lambda rows: rows, _aux_layer_ids(args, model))


def _aux_layer_ids(args: argparse.Namespace, model: DecoderLM) -> tuple[int, int, int]:
    """``--aux-layer-ids``, else vLLM's default (``get_eagle3_aux_hidden_state_layers`` in its llama
    model: 2, L // 2, L − 3; SGLang's ``set_eagle3_layers_to_capture`` takes the same), each the
    residual stream entering that layer, as both capture them. ValueError where they do not fit."""
    from specdecode.runtime.models.eagle3 import default_aux_layer_ids

    n = model.config.num_layers
    ids = args.aux_layer_ids or default_aux_layer_ids(n)
    if list(ids) != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < n:
        raise ValueError(f"aux layers {list(ids)} are not three distinct layers of the target's {n}: "
                         "give --aux-layer-ids")
    return ids


def _eagle3_trainee(args: argparse.Namespace, model: DecoderLM, data: Distilled, vocab_ids: torch.Tensor,
                    default_size: int) -> Trainee:
    """The head's LM head holds the ``default_size`` most frequent training labels, in target id order (``d2t``)."""
    from specdecode.runtime.models.eagle3_checkpoint import save_eagle3_head
    from specdecode.runtime.training import eagle3_head
    from specdecode.runtime.training.trainer import TrainVocabulary

    draft_ids = vocab_ids[:default_size].sort().values
    cfg = eagle3_head.head_config(model, _aux_layer_ids(args, model), default_size)
    head = eagle3_head.init_head(model, cfg, draft_ids, args.seed)
    vocab = TrainVocabulary.of(draft_ids, model.config.vocab_size)
    return Trainee(head, eagle3_head.loss_of(head, model, args.depth, vocab),
                   lambda out: save_eagle3_head(out, head, args.eval_k))


MTP = HeadKind("train-mtp", lambda args: None, _mtp_recorder, _mtp_trainee,
               lambda out: {"method": "mtp", "mtp_path": str(out)})
EAGLE3 = HeadKind("train-eagle3", _eagle3_check, _eagle3_recorder, _eagle3_trainee,
                  lambda out: {"method": "eagle3", "eagle3_path": str(out)})


def _chat_ids(tokenizer, chat) -> list[int]:
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _text_ids(tokenizer, texts, budget: int) -> list[list[int]]:
    """Chats of ``texts`` rendered whole (no generation prompt) and cut at ``TEXT_MAX_LEN`` tokens, in
    order, until ``budget`` tokens."""
    ids: list[list[int]] = []
    total = 0
    for chat in texts:
        if total >= budget:
            break
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=False)
        ids.append(tokenizer.encode(text, add_special_tokens=False)[: min(TEXT_MAX_LEN, budget - total)])
        total += len(ids[-1])
    return ids


def _draft_vocabulary(data, coverage: float):
    """Every training label by falling frequency (ties by id), and how many cover ``coverage`` of them."""
    import torch

    counts = Counter(int(t) for labels in data.labels for t in labels.tolist())
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    total, running = sum(counts.values()), 0
    size = len(ranked)
    for n, token in enumerate(ranked, start=1):
        running += counts[token]
        if running >= coverage * total:
            size = n
            break
    return torch.tensor(ranked, dtype=torch.long), size


def _evaluate(model, tokenizer, cfg, head: dict[str, str], chats, k: int, max_tokens: int) -> dict:
    """Greedy decoding of the held-out ``chats`` with the head ``head`` (its method and folder, as
    ``--speculative-config`` names them) at K = ``k``: the engine's own acceptance counters."""
    from tqdm import tqdm

    from specdecode.runtime.config import SpeculativeConfig
    from specdecode.runtime.engine.llm_engine import LLMEngine
    from specdecode.runtime.engine.sequence import SamplingParams

    spec = SpeculativeConfig(**head, num_speculative_tokens=k, verify="greedy")
    engine_cfg = cfg.model_copy(update={"speculative": spec})
    engine = LLMEngine(model, tokenizer, engine_cfg, model.config.max_position_embeddings,
                       model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, chat in enumerate(chats):
        engine.add_request(str(i), _chat_ids(tokenizer, chat), params)
    with tqdm(total=len(chats), desc="evaluate", unit="prompt") as bar:
        while engine.has_unfinished():
            bar.update(sum(out.finished for out in engine.step()))
    stats = engine.stats()
    drafts = max(stats.spec_decode_num_drafts, 1)
    per_position = [n / drafts for n in stats.spec_decode_num_accepted_tokens_per_pos]
    per_position += [0.0] * (k - len(per_position))
    return {"prompts": len(chats), "k": k, "drafts": stats.spec_decode_num_drafts,
            "per_position_acceptance": per_position,
            "mean_acceptance_length": 1 + stats.spec_decode_num_accepted_tokens / drafts}


def _print_summary(out: Path, tokens: int, losses: list[float], evaluation: dict, timings: dict, k: int) -> None:
    rows = " ".join(f"{p:.2f}" for p in evaluation["per_position_acceptance"][:k])
    print(f"\nwrote {out} ({tokens} training tokens; loss per epoch {', '.join(f'{x:.3f}' for x in losses)})")
    print(f"held-out acceptance per position (engine, greedy, K = {k}, {evaluation['prompts']} prompts): {rows}; "
          f"mean acceptance length {evaluation['mean_acceptance_length']:.2f}")
    print("time: " + ", ".join(f"{name.removesuffix('_s')} {seconds:.0f} s" for name, seconds in timings.items()))
