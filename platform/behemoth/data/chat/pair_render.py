"""A preference pair (data.kind: preference): a record read as (prompt, chosen, rejected) messages (`pair_of`), and
its tokens (`pair_tokens`): the prompt rendered with each reply by the chat template, as the rendering process
runs it (data/chat/chat_render.py: bounded in time and memory; this module imports only what that process does).

A pair is stored as two sequences, chosen then rejected, each with START on its first token (its own document:
positions restart, it never attends to the other), TRAIN on its reply's assistant tokens (the end of turn
included: DPO's log-probability sum covers the stop) and, on every token of the rejected one, REJECTED. The
prompt's tokens train nothing and must be the same token for token in both sequences: the template renders the
prompt with the generation prompt as the start of prompt + reply (else it rewrites turns), and no token runs
across the prompt's end (else the reply's first token is not the same event in both). A pair longer than a block
is dropped whole, never cut: a cut reply changes its log-probability sum.
"""

from __future__ import annotations

import numpy as np

from behemoth.data.chat.chat_tokens import (REJECTED, TRAIN, BadRecord, RecordTooLong, assistant_spans,
                                       conversation_problem, flag_tokens, window_cut)

TOO_LONG = "the pair is longer than data.seq_len"  # (a Failed's reason the packer counts, not a bad record)


def pair_tokens(render, encode, prompt: list[dict], chosen: list[dict], rejected: list[dict], seq_len: int,
                max_chars: int | None) -> np.ndarray:
    """The pair's stored tokens, chosen's then rejected's (the second START begins the rejected one), int32.
    RecordTooLong(TOO_LONG) where the two hold more than seq_len tokens; BadRecord where the record is not a
    pair this objective can score; ValueError where the template cannot render pairs this way (both named)."""
    prompt_text = render(prompt, True) if prompt else ""
    out, prompt_ids = [], None
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        messages = [*prompt, *reply]
        if max_chars is not None and window_cut(messages, max_chars) != messages:
            raise RecordTooLong(TOO_LONG)  # (its rendering certainly holds more than seq_len tokens)
        text = render(messages, False)
        if not text.startswith(prompt_text):
            raise ValueError(f"the chat template's rendering of the prompt with the generation prompt is not the "
                             f"start of its rendering of the prompt and the {name} reply: it rewrites turns, so "
                             f"the reply's tokens cannot be told")
        encoding = encode(text)
        starts = [start for start, _ in encoding.offsets]
        cut = sum(start < len(prompt_text) for start in starts)  # the prompt's tokens
        if cut and encoding.offsets[cut - 1][1] > len(prompt_text):
            raise BadRecord(f"a token runs across the end of the prompt into the {name} reply (the template's "
                            f"generation prompt and the reply's first characters encode as one token, e.g. a reply "
                            f"that starts with a newline): the replies would not start from the same prompt tokens")
        if prompt_ids is None:
            prompt_ids = encoding.ids[:cut]
        elif encoding.ids[:cut] != prompt_ids:
            raise BadRecord("the prompt encodes to different tokens before the chosen and the rejected reply")
        spans = [(b, e) for b, e in assistant_spans(render, messages, text, len(text)) if b >= len(prompt_text)]
        tokens = flag_tokens(encoding.ids, starts, spans)
        if not np.any(tokens & TRAIN):
            raise BadRecord(f"the {name} reply has no assistant turn: nothing to score")
        if name == "rejected":
            tokens |= np.int32(REJECTED)
        out.append(tokens)
    if sum(map(len, out)) > seq_len:
        raise RecordTooLong(TOO_LONG)
    return np.concatenate(out)


def pair_of(record: dict, fields: tuple[str, str, str]) -> tuple[str | None, tuple | None]:
    """(why `record` is not a preference pair or None, its (prompt, chosen, rejected) messages)."""
    prompt_field, chosen_field, rejected_field = fields
    missing = [f for f in (chosen_field, rejected_field) if f not in record]
    if missing:
        return (f"no field {' or '.join(map(repr, missing))} (data.chosen_field / data.rejected_field); the record "
                f"has {sorted(record)[:20]}"), None
    chosen, rejected, prompt = record[chosen_field], record[rejected_field], record.get(prompt_field)
    for name, value in ((chosen_field, chosen), (rejected_field, rejected)):
        problem = conversation_problem(value, "all")
        if problem:
            return f"{name}: {problem}", None
    if prompt is None:  # the implicit prompt: the messages both conversations open with
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt:
            return (f"{chosen_field} and {rejected_field} share no opening message (no {prompt_field!r} field "
                    f"either)"), None
    else:
        problem = conversation_problem(prompt, "all")
        if problem:
            return f"{prompt_field}: {problem}", None
    for name, reply in ((chosen_field, chosen), (rejected_field, rejected)):
        if not any(m["role"] == "assistant" for m in reply):
            return f"the {name} reply has no assistant message", None
        if reply[0]["role"] != "assistant":  # (the prompt is rendered with the generation prompt: the reply's turn)
            return (f"the {name} reply starts with a {reply[0]['role']} message, not the assistant's: the prompt "
                    f"must end where the replies begin"), None
    if chosen == rejected:
        return f"{chosen_field} and {rejected_field} are the same reply: nothing to prefer", None
    return None, (prompt, chosen, rejected)
