"""``specdecode train-mtp``: train MTP head(s) for a model that has none, then measure them.

Phases, each with its progress bar: generate the model's own continuations of the training
prompts, recording its hidden states and greedy next tokens along them; train; write the head
(DeepSeek-V3-named safetensors + config.json, ``models/mtp_checkpoint.py``); then evaluate it by
running the engine with ``method: mtp`` on held-out prompts and print the per-position acceptance
it measured. The defaults fit 15 minutes on a 2-core CPU for SmolLM2-135M (the README has the
timings); ``train_report.json`` in the output folder records settings, timings and results.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from specdecode.runtime.serve_flags import add_model_arguments, engine_config

TRAIN_DEFAULTS = dict(num_prompts=320, max_tokens=96, epochs=5, num_layers=1, depth=2, seed=0, eval_prompts=16,
                      eval_max_tokens=96, eval_k=2, coverage=0.99, lr=3e-3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    d = TRAIN_DEFAULTS
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write the head to (created)")
    parser.add_argument("--prompts", default="sharegpt-followups",
                        help="training prompts: sharegpt-followups (later user turns of ShareGPT, half with code, "
                             "disjoint from every benchmark and evaluation prompt), or a JSON/JSONL file as "
                             "`specdecode bench --prompts` reads [%(default)s]")
    parser.add_argument("--num-prompts", type=int, default=d["num_prompts"], help="training prompts [%(default)s]")
    parser.add_argument("--max-tokens", type=int, default=d["max_tokens"],
                        help="tokens the model generates per training prompt [%(default)s]")
    parser.add_argument("--epochs", type=int, default=d["epochs"], help="passes over the data [%(default)s]")
    parser.add_argument("--num-layers", type=int, default=d["num_layers"],
                        help="MTP modules L (draft k uses module k mod L) [%(default)s]")
    parser.add_argument("--depth", type=int, default=d["depth"],
                        help="draft positions trained per chain (train for the K you will serve) [%(default)s]")
    parser.add_argument("--hidden-tap", choices=["post_norm", "pre_norm"], default="post_norm",
                        help="the target hidden state the head reads: after or before its final norm [%(default)s]")
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


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from specdecode.runtime.models.loader import load_model, served_name
    from specdecode.runtime.models.mtp import HiddenTap, MtpConfig, TargetFingerprint
    from specdecode.runtime.models.mtp_checkpoint import save_mtp_head
    from specdecode.runtime.training import distill, prompts, trainer

    positive = ("num_prompts", "max_tokens", "epochs", "num_layers", "depth", "eval_prompts", "eval_max_tokens", "eval_k")
    bad = [f"--{name.replace('_', '-')}" for name in positive if getattr(args, name) < 1]
    if bad or not 0 < args.draft_vocab_coverage <= 1:
        print(f"train-mtp: {', '.join(bad) or '--draft-vocab-coverage'} out of range (counts ≥ 1, coverage in (0, 1])",
              file=sys.stderr)
        return 2
    timings: dict[str, float] = {}
    started = time.monotonic()
    try:
        prompts.ensure_installed()
        chats = prompts.training_prompts(args.prompts, args.num_prompts)
        heldout = prompts.heldout_prompts(args.eval_prompts, args.eval_prompts_file)
        prompts.check_disjoint(chats, heldout)
    except (ValueError, OSError) as exc:
        print(f"train-mtp: {exc}", file=sys.stderr)
        return 2
    cfg = engine_config(args)
    loaded = load_model(cfg.load)
    model, tokenizer = loaded.model, loaded.tokenizer
    torch.manual_seed(args.seed)

    prompt_ids = [_chat_ids(tokenizer, chat) for chat in chats]
    tap = HiddenTap(args.hidden_tap)
    with tqdm(total=len(prompt_ids), desc="generate", unit="prompt") as bar:
        data = distill.generate(model, tokenizer, prompt_ids, args.max_tokens, tap, loaded.device, loaded.dtype,
                                bar.update)
    timings["generate_s"] = time.monotonic() - started

    vocab_ids, default_size = _draft_vocabulary(data, args.draft_vocab_coverage)
    mtp_cfg = MtpConfig(num_modules=args.num_layers, hidden_tap=tap, draft_vocab_size=default_size,
                        target=TargetFingerprint.of(model, served_name(args.model)))
    head = trainer.init_head(model, mtp_cfg, args.seed)
    train_cfg = trainer.TrainConfig(epochs=args.epochs, depth=args.depth, lr=args.lr, seed=args.seed)
    vocab = trainer.TrainVocabulary.of(vocab_ids.to(loaded.device), model.config.vocab_size)
    with tqdm(total=args.epochs * trainer.num_batches(data, train_cfg), desc="train", unit="step") as bar:
        losses = trainer.train(head, model, data, train_cfg,
                               lambda n, loss: (bar.update(n), bar.set_postfix(loss=f"{loss:.3f}")), vocab)
    head.draft_vocab_ids = vocab_ids
    out = Path(args.out)
    save_mtp_head(out, head, model)
    timings["train_s"] = time.monotonic() - started - sum(timings.values())

    evaluation = _evaluate(model, tokenizer, cfg, out, heldout, args.eval_k, args.eval_max_tokens)
    timings["evaluate_s"] = time.monotonic() - started - sum(timings.values())
    timings["total_s"] = time.monotonic() - started
    report = {"settings": {k: v for k, v in vars(args).items() if k != "run"}, "training_tokens": data.num_tokens,
              "epoch_losses": losses, "draft_vocab_size": default_size, "heldout": evaluation, "timings": timings}
    (out / "train_report.json").write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    _print_summary(out, data.num_tokens, losses, evaluation, timings, args.eval_k)
    return 0


def _chat_ids(tokenizer, chat) -> list[int]:
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


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


def _evaluate(model, tokenizer, cfg, head_dir: Path, chats, k: int, max_tokens: int) -> dict:
    """Greedy decoding of the held-out ``chats`` with the head in ``head_dir`` at K = ``k``: the
    engine's own acceptance counters."""
    from tqdm import tqdm

    from specdecode.runtime.config import SpeculativeConfig
    from specdecode.runtime.engine.llm_engine import LLMEngine
    from specdecode.runtime.engine.sequence import SamplingParams

    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=k, mtp_path=str(head_dir), verify="greedy")
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
