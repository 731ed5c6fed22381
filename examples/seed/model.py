"""A bigram model small enough to train in a blink (a sibling module of the training script)."""

import itertools
import math
from collections import Counter


class BigramModel:
    def __init__(self, tokens: list[str]) -> None:
        self.pairs = list(itertools.pairwise(tokens))
        self.counts: Counter[tuple[str, str]] = Counter()
        self.firsts: Counter[str] = Counter()
        self.vocab = len(set(tokens))
        self.seen = 0

    def train_step(self) -> float:
        """Learn from the next third of the pairs; return the mean negative log-likelihood."""
        batch = self.pairs[self.seen : self.seen + max(1, len(self.pairs) // 3)]
        self.seen += len(batch)
        self.counts.update(batch)
        self.firsts.update(a for a, _ in batch)
        nll = [-math.log((self.counts[p] + 1) / (self.firsts[p[0]] + self.vocab)) for p in self.pairs]
        return sum(nll) / len(nll)
