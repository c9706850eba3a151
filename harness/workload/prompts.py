"""Workload prompts, all seeded.

  Corpus(model_dir)        words of the tiny model's vocabulary (one word = one token);
                           `text(n, rng)` is a prompt of exactly n tokens (+ BOS).
  shared_system_prompt     one system prompt, different questions
  common_prefix_tails      a common prefix (not block aligned) with different tails
  six_turn_session         sessions whose turns alternate replicas (the seed study's
                           setup), each turn's prompt = the whole conversation so far
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path


class Corpus:
    def __init__(self, model_dir: Path):
        vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"]
        self.words = sorted(w for w, i in vocab.items() if i >= 4)

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """A prompt that tokenizes to exactly n_tokens words (BOS comes on top)."""
        return " ".join(rng.choice(self.words) for _ in range(n_tokens))


@dataclasses.dataclass(frozen=True)
class Turn:
    session: str
    turn: int
    prompt: str


def shared_system_prompt(corpus: Corpus, rng: random.Random, system_tokens: int, questions: int,
                         question_tokens: int = 40) -> list[Turn]:
    system = corpus.text(system_tokens, rng)
    return [Turn(f"q{i}", 0, system + " " + corpus.text(question_tokens, rng)) for i in range(questions)]


def common_prefix_tails(corpus: Corpus, rng: random.Random, prefix_tokens: int, tails: int,
                        tail_tokens: int = 200) -> list[Turn]:
    prefix = corpus.text(prefix_tokens, rng)
    return [Turn(f"t{i}", 0, prefix + " " + corpus.text(tail_tokens, rng)) for i in range(tails)]


def six_turn_session(corpus: Corpus, rng: random.Random, context_tokens: int, user_tokens: int = 64,
                     turns: int = 6) -> tuple[str, list[str]]:
    """The initial context and the user messages of one session; the prompt of turn t is
    the context, then for each earlier turn its user message and the model's answer."""
    return corpus.text(context_tokens, rng), [corpus.text(user_tokens, rng) for _ in range(turns)]
