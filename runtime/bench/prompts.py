"""The benchmark's prompt sets: the built-in one, the packaged data sets (``datasets.py``), a file.

A prompt is a chat: a list of ``{"role", "content"}`` messages. The built-in set is 16 varied
single-turn requests (8 code, 8 chat/prose) of different lengths, fixed so that runs compare.
"""
from __future__ import annotations

import json
from pathlib import Path

from specdecode.runtime.bench.datasets import PROMPT_SETS, Messages

PROMPT_SET_NAMES = ("builtin", *PROMPT_SETS)

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


def load_prompts(source: str, num_prompts: int) -> list[Messages]:
    """``source`` is ``builtin``, a packaged set (``PROMPT_SETS``), or a JSON file (a list) / JSONL
    file (one item a line) whose items are a string (one user turn), a list of messages, or an
    object with ``prompt`` or ``messages``. Raises ``datasets.MissingData`` for an uninstalled set."""
    if source in PROMPT_SETS:
        return PROMPT_SETS[source](num_prompts)
    if source == "builtin":
        prompts = builtin_prompts()
    else:
        text = Path(source).read_text(encoding="utf-8")
        items = [json.loads(line) for line in text.splitlines() if line.strip()] if source.endswith(".jsonl") else json.loads(text)
        prompts = [_as_messages(item) for item in items]
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
