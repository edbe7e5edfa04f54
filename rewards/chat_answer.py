"""An OpenAI-compatible chat answer (vLLM, SGLang) read as a judge needs it: the text that holds the verdict,
the tokens of its score among the generated tokens, and an error body's message.

Where the verdict is. Without a reasoning parser the whole answer is ``message.content``. With one (vLLM's or
SGLang's ``--reasoning-parser qwen3``) the text before ``</think>`` goes to the message's reasoning field and
the rest to ``content``; an answer without ``</think>`` goes to the reasoning field whole, ``content`` left
null (vLLM) or empty (SGLang). The field is ``reasoning`` in vLLM since its PR #27752 and ``reasoning_content``
in older vLLM and in SGLang; both are read. The verdict is read from ``content`` when it holds text (a draft
score in the reasoning is not the verdict), else from the reasoning field: the whole answer of a judge that does
not think, served with a reasoning parser.

The score's tokens. ``logprobs.content`` lists every generated token, the reasoning's and ``</think>``
included, so positions in it do not match offsets in ``content``. The score is found again in the text those
tokens spell: the last match of the pattern there is the verdict's (the verdict's text is the end of the
generated text, a trailing stop token aside), and its number's tokens are the ones that overlap its group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

REASONING_FIELDS = ("reasoning", "reasoning_content")  # vLLM's name, then older vLLM's and SGLang's
QUOTED = 100  # characters of an answer quoted in an error


def quoted(text: str) -> str:
    """The start of ``text``, its whitespace runs as single spaces, as an error quotes it."""
    return repr(" ".join(text.split())[:QUOTED])


@dataclass(frozen=True)
class Verdict:
    """The text a judge's verdict is read from, and where it was."""

    text: str
    where: str  # "" when it is the content and no reasoning came with it, else the fields read, for errors


def verdict_of(message: dict) -> Verdict:
    """The text of ``message`` (a chat answer's ``choices[0].message``) that holds the verdict (module docstring)."""
    content = message.get("content")
    field = next((name for name in REASONING_FIELDS if isinstance(message.get(name), str)), None)
    reasoning = str(message[field]) if field else ""
    if isinstance(content, str) and content.strip():
        where = f" in content ({field} held {len(reasoning)} characters, not read)" if reasoning.strip() else ""
        return Verdict(content, where)
    held = "null" if content is None else repr(content)
    if field and reasoning.strip():
        return Verdict(reasoning, f" in {field} (content was {held}: a reasoning parser took the whole answer)")
    fields = f"{field} was {reasoning!r}" if field else f"no {' or '.join(REASONING_FIELDS)}"
    return Verdict("", f" (content was {held}, {fields})")


def error_message(body: object) -> tuple[str, str | None, str] | None:
    """(type, param, message) of an error body, vLLM's ``{"error": {...}}`` or SGLang's top-level
    ``{"object": "error", ...}``; None for any other body."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = body if isinstance(body, dict) and body.get("object") == "error" else None
    if error is None or not isinstance(error.get("message"), str):
        return None
    param = error.get("param")
    return str(error.get("type") or "error"), str(param) if param else None, error["message"]


class TokensDoNotSpell(ValueError):
    """The logprobs' tokens do not spell the answer's score: one line to show."""


def score_tokens(tokens: list[object], pattern: re.Pattern[str], number: float) -> list[dict]:
    """The entries of ``tokens`` (``logprobs.content``: every generated token) that spell the number of the last
    match of ``pattern`` in their text, which must read ``number`` (the score read from the verdict's text)."""
    entries = [t for t in tokens if isinstance(t, dict) and isinstance(t.get("token"), str)]
    if len(entries) != len(tokens):
        raise TokensDoNotSpell("answered logprobs entries without a token string")
    ends, spelt = [], ""
    for entry in entries:
        spelt += entry["token"]
        ends.append(len(spelt))
    matches = list(pattern.finditer(spelt))
    if not matches or parsed_number(matches[-1].group(1)) != number:
        raise TokensDoNotSpell("answered logprobs whose tokens do not spell its score")
    start, end = matches[-1].span(1)
    return [entry for entry, stop in zip(entries, ends) if stop > start and stop - len(entry["token"]) < end]


def parsed_number(text: str) -> float | None:
    """The number ``text`` spells (spaces around it allowed), or None."""
    try:
        return float(text.strip())
    except ValueError:
        return None
