"""A learnable text corpus written as JSONL, for the language-model demo and tests (no download needed).

Why generated rather than text from an installed package: the corpus must be the same on every machine,
big enough to train on, free of licence questions, and *learnable at a known rate* so that "validation
perplexity falls" is a real signal. Each document is a short story from a small grammar: characters, places
and objects are drawn at random and then referred back to (a model must attend to earlier tokens to predict
a name or object the second time), sentence templates and word order are fixed (a model learns them within
a few hundred steps). Deterministic for a seed: document i of a split is drawn from Random((seed, split, i)).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from behemoth.errors import ConfigError

NAMES = ["Ada", "Boris", "Chloe", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Luca",
         "Mira", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sven", "Tara"]
PLACES = ["market", "harbour", "library", "forest", "bakery", "station", "garden", "museum", "river", "castle",
          "school", "village", "mountain", "beach", "workshop"]
OBJECTS = ["lantern", "map", "key", "book", "basket", "compass", "violin", "hat", "letter", "kite", "clock",
           "ring", "bottle", "feather", "stone", "drum", "mirror", "scarf", "candle", "shell"]
ADJECTIVES = ["old", "red", "tiny", "heavy", "shiny", "broken", "green", "strange", "wooden", "golden",
              "silver", "blue", "soft", "bright", "dusty"]
WEATHER = ["rain fell", "the sun was warm", "snow covered the roads", "a cold wind blew", "the sky was grey"]


def story(rng: random.Random) -> str:
    return " ".join(story_sentences(rng))


def story_sentences(rng: random.Random) -> list[str]:
    a, b = rng.sample(NAMES, 2)
    place, other_place = rng.sample(PLACES, 2)
    obj, adj = rng.choice(OBJECTS), rng.choice(ADJECTIVES)
    sentences = [
        f"One morning {a} went to the {place}.",
        f"At the {place} {a} found a {adj} {obj}.",
    ]
    for _ in range(rng.randint(1, 3)):
        sentences.append(rng.choice([
            f"Outside, {rng.choice(WEATHER)}.",
            f"{a} looked at the {obj} for a long time.",
            f"The {obj} was {rng.choice(ADJECTIVES)} and {rng.choice(ADJECTIVES)}.",
            f"{a} walked from the {place} to the {other_place}.",
        ]))
    sentences += [
        f"At the {other_place} {a} met {b}.",
        f"{a} gave the {adj} {obj} to {b}.",
        f'"Thank you, {a}," said {b}. "I will keep the {obj} safe."',
        f"Then {b} went home and {a} went back to the {place}.",
    ]
    return sentences


def write_synth_text(out: str | Path, train_documents: int = 4000, val_documents: int = 400,
                     seed: int = 0) -> dict[str, int]:
    """Write OUT/train.jsonl and OUT/val.jsonl, one {"text": story} per line. Returns documents per split."""
    return _write_jsonl(out, {"train": train_documents, "val": val_documents},
                        lambda split, i: {"text": story(random.Random(f"{seed}/{split}/{i}"))})


def _write_jsonl(out: str | Path, counts: dict[str, int], row) -> dict[str, int]:
    """OUT/<split>.jsonl with counts[split] rows, row i being row(split, i)."""
    out = Path(out)
    # every file checked before any is written: a user's corpus of the same name is never replaced
    held = [out / f"{split}.jsonl" for split in counts if (out / f"{split}.jsonl").exists()]
    if held:
        raise ConfigError(f"--out {out}: {held[0]} exists: give another --out (nothing is overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    for split, n in counts.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(json.dumps(row(split, i)) + "\n")
    return counts

# The labelled corpus (text classification): each story carries its label's mood in one or two sentences among
# the grammar's others, so a classifier must find them; the other moods' words never appear in it.
MOODS = {
    "joy": ["smiled", "laughed out loud", "sang a happy song", "danced in the street", "felt glad and warm"],
    "sadness": ["cried quietly", "sighed and looked away", "felt lonely", "wiped a tear",
                "walked slowly, head down"],
    "anger": ["shouted at the wall", "stamped on the floor", "slammed the door", "frowned darkly", "felt furious"],
    "fear": ["trembled", "hid behind a tree", "ran away in a panic", "felt afraid of the dark", "froze in terror"],
}


def labelled_story(rng: random.Random) -> tuple[str, str]:
    """A story's opening with its main character's mood in one or two sentences among the others, and that
    mood as its label."""
    label = rng.choice(sorted(MOODS))
    sentences = story_sentences(rng)[:3]  # its opening: short texts, so a mood is never cut off by truncation
    name = sentences[0].split()[2]  # "One morning NAME went to the PLACE."
    for _ in range(rng.randint(1, 2)):
        sentences.insert(rng.randint(1, len(sentences)), f"{name} {rng.choice(MOODS[label])}.")
    return " ".join(sentences), label


def write_synth_labelled_text(out: str | Path, train_documents: int = 2000, val_documents: int = 400,
                              seed: int = 0) -> dict[str, int]:
    """Write OUT/train.jsonl and OUT/val.jsonl, one {"text": story, "label": mood} per line (4 moods, drawn
    uniformly). Returns documents per split."""
    def row(split: str, i: int) -> dict:
        text, label = labelled_story(random.Random(f"{seed}/labelled/{split}/{i}"))
        return {"text": text, "label": label}

    return _write_jsonl(out, {"train": train_documents, "val": val_documents}, row)


# The chat corpus (chat fine-tuning): a user hands the assistant a story and asks about it; the answers are read
# from the story (a name, a place, an object), so a model must attend to the user's turn to learn them, and the
# user's story is text the loss should not be taken on (data.train_on: assistant).
QUESTIONS = [
    ("Who found the {obj}?", "{a} found the {obj}."),
    ("Where did {a} meet {b}?", "At the {other_place}."),
    ("What did {a} give to {b}?", "{a} gave {b} the {adj} {obj}."),
    ("Where did {a} go first?", "{a} went to the {place}."),
]


def conversation(rng: random.Random) -> list[dict]:
    """A system line (half the time), a story and one to three questions about it, each with its answer."""
    return _conversation(rng)[0]


def _conversation(rng: random.Random) -> tuple[list[dict], dict, list[tuple[str, str]]]:
    """(the conversation, the story's facts, the questions asked with their answer templates)."""
    state = rng.getstate()
    sentences = story_sentences(rng)
    rng.setstate(state)  # the same draws again, to know what the story holds
    a, b = rng.sample(NAMES, 2)
    place, other_place = rng.sample(PLACES, 2)
    obj, adj = rng.choice(OBJECTS), rng.choice(ADJECTIVES)
    facts = {"a": a, "b": b, "place": place, "other_place": other_place, "obj": obj, "adj": adj}
    messages = [{"role": "system", "content": "You answer questions about stories."}] if rng.random() < 0.5 else []
    asked = rng.sample(QUESTIONS, rng.randint(1, 3))
    question, answer = asked[0]
    messages += [{"role": "user", "content": f"{' '.join(sentences)}\n{question.format(**facts)}"},
                 {"role": "assistant", "content": answer.format(**facts)}]
    for question, answer in asked[1:]:
        messages += [{"role": "user", "content": question.format(**facts)},
                     {"role": "assistant", "content": answer.format(**facts)}]
    return messages, facts, asked


def preference_pair(rng: random.Random) -> dict:
    """A conversation's opening (the story and its first question) as the prompt, the answer the story gives
    (chosen) and one from the wrong facts (rejected: the two names, the two places swapped, another object and
    adjective), in TRL's conversational shape with an explicit prompt."""
    messages, facts, asked = _conversation(rng)
    opening = messages[:messages.index(next(m for m in messages if m["role"] == "assistant"))]
    wrong = {**facts, "a": facts["b"], "b": facts["a"], "place": facts["other_place"], "other_place": facts["place"],
             "obj": rng.choice([o for o in OBJECTS if o != facts["obj"]]),
             "adj": rng.choice([a for a in ADJECTIVES if a != facts["adj"]])}
    answer = asked[0][1]
    return {"prompt": opening, "chosen": [{"role": "assistant", "content": answer.format(**facts)}],
            "rejected": [{"role": "assistant", "content": answer.format(**wrong)}]}


def write_synth_preference(out: str | Path, train_documents: int = 4000, val_documents: int = 400,
                           seed: int = 0) -> dict[str, int]:
    """Write OUT/train.jsonl and OUT/val.jsonl, one {"prompt", "chosen", "rejected"} pair per line (the prompts
    are those of write_synth_chat's conversations for the same seed)."""
    return _write_jsonl(out, {"train": train_documents, "val": val_documents},
                        lambda split, i: preference_pair(random.Random(f"{seed}/chat/{split}/{i}")))


def write_synth_chat(out: str | Path, train_documents: int = 4000, val_documents: int = 400,
                     seed: int = 0) -> dict[str, int]:
    """Write OUT/train.jsonl and OUT/val.jsonl, one {"messages": [...]} conversation per line."""
    return _write_jsonl(out, {"train": train_documents, "val": val_documents},
                        lambda split, i: {"messages": conversation(random.Random(f"{seed}/chat/{split}/{i}"))})
