"""Chat templates rendered in a process of their own, bounded in time and memory.

A chat template is a program (Jinja) that comes with a model, often from the Hub, and runs over every record.
transformers runs it in Jinja's sandbox, which keeps it from Python's internals but bounds neither its time nor
its memory: nested `range(100000)` loops never end, `'x' * 2000000000` allocates gigabytes, and a record can
drive either. So behemoth renders in a child process (one per process that renders, started on first use and
kept): each conversation gets RENDER_CPU_S seconds of CPU (an interval timer in the child) and the child's
address space is capped RENDER_MEMORY_BYTES above what it started with (RLIMIT_AS: an allocation past it is a
MemoryError there, not here). A conversation that breaks either bound is a bad record naming the bound; a child
that dies anyway is replaced and the record it was on is the bad one.

The child renders exactly as `tokenizer.apply_chat_template(..., tokenize=False)` does (transformers' own
normalisation and `render_jinja_template`, the tokenizer's special tokens as the template's variables) and
encodes with the tokenizer's Rust core, as the tokenising tasks did in-process.

The cost a conversation can drive is bounded before rendering (data/chat/chat_tokens.py: `window_cut`,
`conversation_tokens`; a preference pair's, data/chat/pair_render.py, the same way): only the
first seq_len tokens of a conversation are ever stored, so its messages are cut where the rendering certainly
holds more than seq_len tokens (seq_len x the vocabulary's longest token, in characters), and the assistant
turns whose tokens are found (two renderings each: see data/chat/chat.py) stop at the first turn that starts past
the seq_len-th token. A conversation's cost is then bounded by seq_len whatever its length or number of turns.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from behemoth.data.chat.chat_tokens import (  # noqa: F401 - the flags and the bounded tokens, named here too
    IDS,
    MIN_TOKEN_CHARS,
    REJECTED,
    START,
    TRAIN,
    BadRecord,
    RecordTooLong,
    Render,
    assistant_spans,
    conversation_tokens,
    flag_tokens,
    window_cut,
)

RENDER_CPU_S = 20.0  # CPU seconds one conversation (or one prompt) may take to render and encode
RENDER_MEMORY_BYTES = 2 << 30  # the rendering process's address space above what it starts with
WATCHDOG_SLACK_S = 30.0  # wall seconds beyond RENDER_CPU_S before a silent child is ended (a loaded machine)

# ---------------------------------------------------------------------------------------------------------
# The parent's side


def window_chars(tok, seq_len: int | None) -> int | None:
    """The characters of a conversation that can hold its first seq_len tokens: seq_len x the vocabulary's
    longest token (at least MIN_TOKEN_CHARS)."""
    if seq_len is None:
        return None
    longest = max((len(t) for t in tok.backend_tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return seq_len * max(longest, MIN_TOKEN_CHARS)


@dataclass(frozen=True)
class Window:
    """How much of a conversation is tokenised: the tokens the loss is taken on (data.train_on), at most
    seq_len + 1 of them (None: all), its content cut at max_chars (window_chars)."""

    train_on: str = "assistant"
    seq_len: int | None = None
    max_chars: int | None = None

    @classmethod
    def of(cls, tok, train_on: str = "assistant", seq_len: int | None = None) -> Window:
        return cls(train_on, seq_len, window_chars(tok, seq_len))


@dataclass(frozen=True)
class RenderSpec:
    """What a rendering process is for: the template (text), the variables apply_chat_template gives it (the
    tokenizer's special tokens), the tokenizer's Rust core (JSON), and its bounds."""

    template: str
    variables_json: str  # the special tokens map, as JSON (hashable: one process serves one spec)
    tokenizer_json: str
    cpu_s: float = RENDER_CPU_S  # (tests set smaller bounds)
    memory_bytes: int = RENDER_MEMORY_BYTES

    @classmethod
    def of(cls, tok) -> RenderSpec:
        """The spec of `tok` (its template included), made once per tokenizer core and template: a large
        vocabulary's JSON takes a while to write, and a check renders the first records of every file."""
        core, template, variables = tok.backend_tokenizer, tok.get_chat_template(), json.dumps(
            tok.special_tokens_map, sort_keys=True)
        key = (id(core), template, variables)
        if key not in _SPECS:
            if len(_SPECS) >= 4:
                _SPECS.pop(next(iter(_SPECS)))
            _SPECS[key] = (core, cls(template, variables, core.to_str()))  # (the core kept: its id stays its own)
        return _SPECS[key][1]

    @property
    def variables(self) -> dict:
        return json.loads(self.variables_json)


@dataclass(frozen=True)
class Failed:
    """Why a conversation (or a prompt) has no rendering: `template` where the template failed on it (its own
    error, or a bound), not the record alone (a shape no window bounds)."""

    reason: str
    template: bool = True


@dataclass(frozen=True)
class Text:
    """A prompt's rendering."""

    text: str


class TemplateRefused(ValueError):
    """The template could not render a prompt (its own error, or a bound): the message says which."""


class TemplateProcess:
    """The child process that renders for `spec` (started on first use, replaced where it dies).
    `tokens(conversations, window)` -> each one's stored tokens, or why it has none (Failed); `render(messages)`
    -> the rendering, with the generation prompt by default (TemplateRefused where there is none)."""

    def __init__(self, spec: RenderSpec):
        self.spec = spec
        self._child: subprocess.Popen | None = None

    def tokens(self, conversations: list[list[dict]], window: Window) -> list[np.ndarray | Failed]:
        cut, results = [], {}
        for i, conversation in enumerate(conversations):  # (cut here too: the child is sent no more than it uses)
            try:
                cut.append((i, conversation if window.max_chars is None else window_cut(conversation, window.max_chars)))
            except RecordTooLong as e:
                results[i] = Failed(str(e), template=False)
        done: list[np.ndarray | Failed] = []
        while len(done) < len(cut):
            done += self._run("tokens", window, [c for _, c in cut[len(done):]])
        results.update((i, result) for (i, _), result in zip(cut, done))
        return [results[i] for i in range(len(conversations))]

    def pairs(self, pairs: list[tuple], window: Window) -> list[np.ndarray | Failed]:
        """Each (prompt, chosen, rejected)'s stored tokens (data/chat/pair_render.py), or why it has none."""
        done: list[np.ndarray | Failed] = []
        while len(done) < len(pairs):
            done += self._run("pair", window, pairs[len(done):])
        return done

    def render(self, messages: list[dict], generation_prompt: bool = True) -> str:
        (result,) = self._run("render", generation_prompt, [messages])
        if isinstance(result, Failed):
            raise TemplateRefused(result.reason)
        return result.text

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child.stdin.close()
            self._child.stdout.close()
            self._child = None

    def _run(self, op: str, argument, items: list) -> list:
        """Results for `items` in order, until the child dies or stalls on one: that one's result says so (the
        caller goes on with the rest, in a new child)."""
        child = self._started()
        try:
            _send(child.stdin, (op, argument, items))
        except BrokenPipeError:
            self.close()
            return [Failed("the chat template's process ended before rendering it")]
        out = []
        for _ in items:
            frame = _receive(child.stdout, self.spec.cpu_s + WATCHDOG_SLACK_S)
            if frame is None or isinstance(frame, str):  # (it ended, or stalled: "timeout")
                self.close()
                return [*out, Failed(f"the chat template took more than {self.spec.cpu_s + WATCHDOG_SLACK_S:.0f} s to "
                                     f"render it" if frame else "the chat template's process ended while rendering "
                                     "it (out of memory, or killed)")]
            out.append(frame)
        return out

    def _started(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            # the child imports what this process imports (a Ray worker's runtime environment included)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                   "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
            self._child = subprocess.Popen([sys.executable, "-m", "behemoth.data.chat.chat_render"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                           env=env)
            _send(self._child.stdin, ("init", self.spec, []))
            ready = _receive(self._child.stdout, 120.0)
            if not isinstance(ready, Text):
                self.close()
                raise RuntimeError(f"the chat template's rendering process did not start: "
                                   f"{ready.reason if isinstance(ready, Failed) else ready or 'it ended'}")
        return self._child

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter shutdown
            pass


_SPECS: dict[tuple, tuple] = {}
_PROCESSES: dict[RenderSpec, TemplateProcess] = {}


def process_for(spec: RenderSpec) -> TemplateProcess:
    """This process's rendering process for `spec` (one kept: a new spec ends the previous one's)."""
    if spec not in _PROCESSES:
        for old in _PROCESSES.values():
            old.close()
        _PROCESSES.clear()
        _PROCESSES[spec] = TemplateProcess(spec)
    return _PROCESSES[spec]


# Frames: parent -> child, a length-prefixed pickle of (op, payload) (this process's own data); child -> parent,
# a length-prefixed JSON header, then the int32 tokens it announces: nothing from the process that runs the
# template is unpickled.


def _send(pipe, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(struct.pack("<Q", len(data)) + data)
    pipe.flush()


def _receive(pipe, timeout_s: float) -> np.ndarray | Text | Failed | str | None:
    """One answer: tokens (int32), a rendering (Text), a failure (Failed); None where the child ended, "timeout"
    where it said nothing for `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    head = _read_exactly(pipe, 8, deadline)
    header = _read_exactly(pipe, struct.unpack("<Q", head)[0], deadline) if isinstance(head, bytes) else head
    if not isinstance(header, bytes):
        return header
    meta = json.loads(header)
    if "failed" in meta:
        return Failed(str(meta["failed"]), bool(meta["template"]))
    if "text" in meta:
        return Text(str(meta["text"]))
    body = _read_exactly(pipe, 4 * int(meta["tokens"]), deadline)
    return np.frombuffer(body, dtype="<i4").astype(np.int32) if isinstance(body, bytes) else body


def _read_exactly(pipe, n: int, deadline: float) -> bytes | str | None:
    parts, got, fd = [], 0, pipe.fileno()
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return "timeout"
        piece = os.read(fd, min(n - got, 1 << 20))
        if not piece:
            return None
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------------------
# The child's side


class _OverTime(Exception):
    pass


def _on_timer(signum, frame):
    raise _OverTime()


def _renderer(spec: RenderSpec) -> Render:
    """apply_chat_template(messages, tokenize=False, add_generation_prompt=...) without the tokenizer object:
    transformers' own steps (the messages normalised, render_jinja_template with the special tokens)."""
    variables = spec.variables
    try:
        from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template
    except ImportError:  # (transformers before 5: the compiled template rendered as apply_chat_template did)
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(spec.template)
        return lambda messages, gen: compiled.render(messages=messages, add_generation_prompt=gen, **variables)

    def render(messages: list, gen: bool) -> str:
        rendered, _ = render_jinja_template(conversations=[_normalize_chat_messages(messages)],
                                            chat_template=spec.template, add_generation_prompt=gen, **variables)
        return rendered[0]

    return render


def _answer(out, result: np.ndarray | Text | Failed) -> None:
    body = b""
    if isinstance(result, Failed):
        header = {"failed": result.reason, "template": result.template}
    elif isinstance(result, Text):
        header = {"text": result.text}
    else:
        header, body = {"tokens": int(result.size)}, result.astype("<i4").tobytes()
    data = json.dumps(header).encode()
    out.write(struct.pack("<Q", len(data)) + data + body)
    out.flush()


def _one(op: str, argument, item, render: Render, encode, spec: RenderSpec) -> np.ndarray | Text | Failed:
    """One conversation's tokens (`argument`: the Window), a preference pair's (op "pair") or a rendering
    (`argument`: with the generation prompt), within the bounds."""
    signal.setitimer(signal.ITIMER_VIRTUAL, spec.cpu_s)
    try:
        if op == "render":
            return Text(render(item, argument))
        if op == "pair":
            from behemoth.data.chat.pair_render import pair_tokens

            return pair_tokens(render, encode, *item, argument.seq_len, argument.max_chars)
        return conversation_tokens(render, encode, item, argument.train_on, argument.seq_len, argument.max_chars)
    except BadRecord as e:
        return Failed(str(e), template=False)
    except _OverTime:
        return Failed(f"the chat template took more than {spec.cpu_s:g} s of CPU to render it")
    except MemoryError:
        return Failed(f"the chat template needed more than {spec.memory_bytes / 2**30:g} GiB to render it")
    except RecursionError:
        return Failed("the chat template recursed too deeply rendering it")
    except Exception as e:  # noqa: BLE001 - a template's own errors (raise_exception, undefined names) are of many types
        return Failed(f"the chat template cannot render it: {' '.join(str(e).split())[:500]}")
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)


def serve() -> None:
    """The child's loop: an init frame (the spec; answered with an empty Text once ready), then (op, argument,
    items) frames, one answer per item; it ends at EOF."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    spec = render = encode = None
    while len(head := stdin.read(8)) == 8:
        op, argument, items = pickle.loads(stdin.read(struct.unpack("<Q", head)[0]))
        if op == "init":
            try:
                spec, render, encode = _start(argument)
            except Exception as e:  # noqa: BLE001 - said to the parent, which raises it
                _answer(stdout, Failed(f"{type(e).__name__}: {e}"))
                return
            _answer(stdout, Text(""))
            continue
        for item in items:
            _answer(stdout, _one(op, argument, item, render, encode, spec))


def _start(spec: RenderSpec):
    from tokenizers import Tokenizer

    render = _renderer(spec)
    core = Tokenizer.from_str(spec.tokenizer_json)

    def encode(text: str):
        return core.encode(text, add_special_tokens=False)

    signal.signal(signal.SIGVTALRM, _on_timer)
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + spec.memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    return spec, render, encode


if __name__ == "__main__":
    serve()
