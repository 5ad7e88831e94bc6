"""Regenerate shared/model/corpus.txt: the small English corpus the default model is
pre-trained on. Deterministic (fixed seed); written here so nothing is downloaded."""

from __future__ import annotations

import random
from pathlib import Path

SUBJECTS = ["the worker", "the gateway", "the trainer", "a client", "the model", "the cache", "the server",
            "a small cat", "the old farmer", "the river", "my friend", "the teacher", "a young girl",
            "the city", "the ship", "the baker", "the garden", "the little robot", "the bird", "the moon"]
VERBS = ["reads", "writes", "sends", "keeps", "learns", "finds", "opens", "carries", "watches", "builds",
         "follows", "remembers", "answers", "counts", "shares", "cleans", "paints", "fixes", "sings to", "visits"]
OBJECTS = ["a message", "the context", "the weights", "a new song", "the bread", "an old book", "the door",
           "the garden", "a letter", "the numbers", "the river", "a red apple", "the window", "the stars",
           "a long list", "the small box", "the answer", "the morning light", "a warm cup of tea", "the map"]
PLACES = ["in the morning", "at night", "after the rain", "near the sea", "in the kitchen", "on the hill",
          "before lunch", "every day", "in the quiet room", "under the tree", "at the station", "in winter"]
ADJS = ["happy", "quiet", "fast", "careful", "bright", "tired", "kind", "busy", "calm", "curious"]
QUESTIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What color is the sky?", "The sky is blue on a clear day."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What do cats like?", "Cats like to sleep in the sun and to play."),
    ("What does the gateway do?", "The gateway serves the model to many clients."),
    ("What does the trainer do?", "The trainer learns from new samples and sends weight deltas."),
    ("Where is the context kept?", "The context of each client is kept in Redis."),
    ("What is two plus two?", "Two plus two is four."),
    ("What is three plus four?", "Three plus four is seven."),
    ("Hello, who are you?", "Hello! I am a small model that learns online."),
    ("How are you today?", "I am fine, thank you. How can I help you?"),
    ("What is water made of?", "Water is made of hydrogen and oxygen."),
]


def sentence(rng: random.Random) -> str:
    s = rng.choice(SUBJECTS)
    form = rng.randrange(4)
    if form == 0:
        out = f"{s} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}."
    elif form == 1:
        out = f"{s} is {rng.choice(ADJS)} and {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
    elif form == 2:
        out = f"{rng.choice(PLACES)}, {s} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
    else:
        out = f"when {s} {rng.choice(VERBS)} {rng.choice(OBJECTS)}, {rng.choice(SUBJECTS)} is {rng.choice(ADJS)}."
    return out[0].upper() + out[1:]


def main() -> None:
    rng = random.Random(20260728)
    parts = []
    size = 0
    while size < 160_000:
        if rng.random() < 0.2:
            q, a = rng.choice(QUESTIONS)
            para = f"Q: {q}\nA: {a}"
        else:
            para = " ".join(sentence(rng) for _ in range(rng.randint(2, 5)))
        parts.append(para)
        size += len(para) + 2
    out = Path(__file__).resolve().parent.parent / "shared" / "model" / "corpus.txt"
    out.write_text("\n\n".join(parts) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
