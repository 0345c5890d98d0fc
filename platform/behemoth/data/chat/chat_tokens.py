"""A conversation's stored tokens, without a process or a tokenizer object of its own: the flags stored above each
token's id, a conversation's shape checked, its cost bounded before rendering (`window_cut`), its assistant turns
found from the template's own renderings (`assistant_spans`) and its tokens flagged (`conversation_tokens`).
The same code runs in the rendering process (data/chat/chat_render.py) and in-process (tests, the reference); a
preference pair's tokens are built from it too (data/chat/pair_render.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

TRAIN, START = 1 << 30, 1 << 29  # the flags stored above a token's id (data/chat/chat.py)
REJECTED = 1 << 28  # a preference pair's rejected reply (data/chat/pair_render.py)
IDS = REJECTED - 1
MIN_TOKEN_CHARS = 128  # the cut's characters per token at least (an unknown token may cover a whole word)
ROLES = ("system", "user", "assistant", "tool")

Render = Callable[[list, bool], str]


class BadRecord(ValueError):
    """A record the template may render but that is not a sample (named): a bad record, not a template's failure."""


class RecordTooLong(BadRecord):
    """A record whose cost no window bounds (window_cut)."""


def conversation_problem(value, train_on: str = "assistant") -> str | None:
    """Why `value` is not a conversation (None: it is one)."""
    if not isinstance(value, list) or not value:
        return f"not a list of messages ({'an empty list' if value == [] else type(value).__name__})"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message:
            return f"message {i} is not a {{role, content}} mapping"
        if message["role"] not in ROLES:
            return f"message {i} has role {message['role']!r}, not one of {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {i} ({message['role']}) has content of type {type(message.get('content')).__name__}, not text"
    if train_on == "assistant" and not any(m["role"] == "assistant" for m in value):
        return "no assistant turn (nothing to train on with data.train_on: assistant)"
    return None


# ---------------------------------------------------------------------------------------------------------
# What a conversation costs, bounded: the same code in the child and in-process (tests, the reference)


def window_cut(messages: list[dict], max_chars: int) -> list[dict]:
    """The messages within the first `max_chars` characters of the conversation's text (roles, contents and
    any other fields), the last one kept with its content cut there; the rest dropped. Rendered, a cut
    conversation holds more than seq_len tokens (max_chars = seq_len x the longest token), so its first seq_len
    tokens are the whole conversation's (except where a word runs across the cut). ValueError where even the
    first message's fields besides its content are longer."""
    out, used = [], 0
    for i, message in enumerate(messages):
        room = max_chars - used - len(message["role"]) - _chars_besides(message, max_chars)
        if room < 0 and not out:
            raise RecordTooLong(f"message {i}'s fields besides its content hold more than {max_chars} characters, "
                                f"more than data.seq_len tokens can ever hold")
        content = message["content"]
        if room < len(content):
            if room > 0:
                out.append({**message, "content": content[:room]})
            return out
        used = max_chars - room + len(content)
        out.append(message)
    return out


def _chars_besides(message: dict, cap: int) -> int:
    """The characters of a message's fields other than role and content (keys, text, 8 per other scalar),
    counted without recursion, up to just past `cap`."""
    total, stack = 0, [v for k, v in message.items() if k not in ("role", "content")]
    total += sum(len(str(k)) for k in message if k not in ("role", "content"))
    while stack and total <= cap:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            total += sum(len(str(k)) for k in value)
            stack += value.values()
        elif isinstance(value, (list, tuple)):
            total += 1
            stack += value
        else:
            total += 8
    return total


def assistant_spans(render: Render, messages: list[dict], text: str, stop_at: int) -> list[tuple[int, int]]:
    """The character ranges of the assistant's turns in `text` (the whole rendering) but an opening one: turn i is
    the rendering of messages[:i+1] after that of messages[:i] with the generation prompt (its end-of-turn
    included). Turns that start at or past `stop_at` are not looked for (their tokens are never stored). Raises
    ValueError where the renderings are not prefixes of each other (the template rewrites earlier turns)."""
    spans = []
    for i, message in enumerate(messages):
        # A conversation's opening assistant turn is context, not trained: with no turn before it, nothing tells
        # the template's opening (a default system prompt, the turn's header) from the reply, and its span was
        # all of them
        if message["role"] != "assistant" or i == 0:
            continue
        prompt = render(messages[:i], True)
        if len(prompt) >= stop_at and text.startswith(prompt):
            break  # (this turn's tokens and every later one's come after the last stored token)
        through = render(messages[:i + 1], False)
        if not (through.startswith(prompt) and text.startswith(through)):
            raise ValueError(f"the chat template's rendering of the first {i} turns with the generation prompt is "
                             f"not the start of its rendering of the first {i + 1} (or of the whole conversation): "
                             f"it rewrites earlier turns, so the assistant's tokens cannot be told. Use a template "
                             f"that appends turns, or data.train_on: all")
        spans.append((len(prompt), len(through)))
    return spans


def flag_tokens(ids: Sequence[int], starts: Sequence[int], spans: list[tuple[int, int]]) -> np.ndarray:
    """Token ids with TRAIN on the tokens that start inside `spans` and START on the first, int32."""
    ids = np.asarray(ids, dtype=np.int64)
    if np.any(ids > IDS):
        raise ValueError(f"token ids above {IDS} do not fit beside the flags")
    starts = np.asarray(starts, dtype=np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    for begin, end in spans:
        trained |= (starts >= begin) & (starts < end)
    out = ids | np.where(trained, TRAIN, 0)
    if len(out):
        out[0] |= START
    return out.astype(np.int32)


def conversation_tokens(render: Render, encode, messages: list[dict], train_on: str, seq_len: int | None,
                        max_chars: int | None) -> np.ndarray:
    """A conversation's stored tokens (flags included), at most seq_len + 1 of them (one more than a block
    holds says it was longer): cut to `max_chars` of content, rendered once whole, encoded, then its assistant
    turns found up to the seq_len-th token. `encode(text)` -> a tokenizers Encoding."""
    if max_chars is not None:
        messages = window_cut(messages, max_chars)
    text = render(messages, False)
    encoding = encode(text)
    keep = len(encoding.ids) if seq_len is None else min(len(encoding.ids), seq_len + 1)
    starts = [start for start, _ in encoding.offsets[:keep]]
    if train_on == "all":
        spans = [(0, len(text))]
    else:
        stop_at = len(text) if seq_len is None or len(encoding.ids) <= seq_len else starts[seq_len]
        spans = assistant_spans(render, messages, text, stop_at)
    return flag_tokens(encoding.ids[:keep], starts, spans)
