"""A synthetic language with learnable structure, generated on the fly (no downloads).

Every sequence is `[BOS, TASK, body...]`. The task token says which rule wrote the body, so the
tasks are natural candidates for different experts:

- ``progression``: ``s_i = (start + i * step) mod N`` — predictable after two symbols.
- ``repeat``: a random motif of 2..8 symbols repeated — predictable after the first period
  (an induction-head task).
- ``mirror``: random first half, then the same symbols reversed — the second half is exact.
- ``markov``: a fixed sparse Markov chain (each symbol has a few successors) — predictable only
  up to the chain's entropy.

Targets are the next tokens; the loss mask covers body positions (BOS and the task token are
given). The reference a trained model is measured against is the loss of the rules themselves:
a predictor that knows each task's rule and the distribution of its random choices (the
progression's start and step, the mirror's first half, the Markov chain; for ``repeat`` also the
motif length, which a model must infer, so there it is optimistic). `Batch.rule_nats` is that
predictor's loss on the batch's own sequences, `expected_rule_loss` its expectation. Neither is
a bound on what a model scores on a finite sample: a model that has learned the rules scores
around the first and, for a few hundred sequences, up to a few hundredths of a nat on either
side of the second (the Markov chain's -log p per step has a standard deviation of 0.56 nats).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

PAD, BOS = 0, 1
TASKS = ("progression", "repeat", "mirror", "markov")
MOTIF_LENGTHS = (2, 8)  # inclusive range of the repeat task's motif length
MARKOV_SUCCESSORS = 3  # successors per symbol in the Markov chain
MARKOV_PROBS = (0.6, 0.3, 0.1)  # their probabilities


@dataclasses.dataclass(frozen=True)
class Batch:
    """One training batch.

    Attributes:
        inputs: `[B, S]` int32 token ids fed to the model.
        targets: `[B, S]` int32 next tokens (`inputs` shifted left by one).
        mask: `[B, S]` float32, 1 where `targets` counts in the loss.
        tasks: `[B]` int32 index into `TASKS` of each sequence.
        rule_nats: `[B]` float64, the rules' loss on each sequence: nats summed over its masked
            positions (module docstring).
    """

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    tasks: np.ndarray
    rule_nats: np.ndarray


class SyntheticLanguage:
    """Generator of the task mixture above.

    Args:
        seq_len: model context length S (each sequence has S + 1 tokens).
        num_symbols: alphabet size N of the bodies.
        seed: seeds the fixed Markov chain (the language itself); batches use their own seeds.
    """

    def __init__(self, seq_len: int, num_symbols: int = 32, seed: int = 0):
        if seq_len < 8:
            raise ValueError(f"seq_len must be >= 8, got {seq_len}")
        if num_symbols < MARKOV_SUCCESSORS:
            raise ValueError(f"num_symbols must be >= {MARKOV_SUCCESSORS}, got {num_symbols}")
        self.seq_len = seq_len
        self.num_symbols = num_symbols
        self.first_symbol = 2 + len(TASKS)
        self.vocab_size = self.first_symbol + num_symbols
        rng = np.random.default_rng(seed)
        self.successors = np.stack(
            [rng.choice(num_symbols, MARKOV_SUCCESSORS, replace=False) for _ in range(num_symbols)]
        )

    @property
    def body_len(self) -> int:
        return self.seq_len + 1 - 2

    def _body(self, task: int, rng: np.random.Generator) -> tuple[np.ndarray, float]:
        """One body of `task` and the rules' loss on it (nats summed over its symbols)."""
        n, length = self.num_symbols, self.body_len
        name = TASKS[task]
        if name == "progression":  # start: 1 of n, step: 1 of n - 1, then determined
            start, step = rng.integers(n), rng.integers(1, n)
            return (start + step * np.arange(length)) % n, math.log(n) + math.log(n - 1)
        if name == "repeat":  # the motif's symbols, each 1 of n (its length given)
            motif = rng.integers(n, size=rng.integers(MOTIF_LENGTHS[0], MOTIF_LENGTHS[1] + 1))
            return np.resize(motif, length), min(len(motif), length) * math.log(n)
        if name == "mirror":  # the first half, each 1 of n
            half = rng.integers(n, size=(length + 1) // 2)
            return np.concatenate([half, half[::-1]])[:length], len(half) * math.log(n)
        body = np.empty(length, np.int64)
        body[0] = rng.integers(n)
        choices = rng.choice(MARKOV_SUCCESSORS, size=length, p=MARKOV_PROBS)
        for i in range(1, length):
            body[i] = self.successors[body[i - 1], choices[i]]
        # The first symbol, 1 of n; then each step's successor, -log of its probability.
        return body, math.log(n) - float(np.log(np.asarray(MARKOV_PROBS))[choices[1:]].sum())

    def batch(self, batch_size: int, rng: np.random.Generator) -> Batch:
        """Draws `batch_size` sequences with tasks chosen uniformly."""
        seqs = np.empty((batch_size, self.seq_len + 1), np.int32)
        tasks = rng.integers(len(TASKS), size=batch_size)
        rule_nats = np.empty(batch_size, np.float64)
        for b, task in enumerate(tasks):
            seqs[b, 0] = BOS
            seqs[b, 1] = 2 + task
            body, rule_nats[b] = self._body(int(task), rng)
            seqs[b, 2:] = self.first_symbol + body
        mask = np.ones((batch_size, self.seq_len), np.float32)
        mask[:, 0] = 0.0  # predicting the task token from BOS: not part of the language
        return Batch(inputs=seqs[:, :-1], targets=seqs[:, 1:], mask=mask,
                     tasks=tasks.astype(np.int32), rule_nats=rule_nats)

    def expected_rule_loss(self, task: str | None = None) -> float:
        """The rules' expected loss per masked position (nats) of `task` (default: all tasks):
        the expectation of `Batch.rule_nats` per position, the entropy per symbol of the
        language (for ``repeat``, with the motif length given)."""
        n, length = self.num_symbols, self.body_len
        log_n = math.log(n)
        chain = -sum(p * math.log(p) for p in MARKOV_PROBS)  # nats per step of the chain
        lo, hi = MOTIF_LENGTHS
        per_task = {
            "progression": log_n + math.log(n - 1),
            "repeat": sum(min(p, length) for p in range(lo, hi + 1)) / (hi - lo + 1) * log_n,
            "mirror": ((length + 1) // 2) * log_n,
            "markov": log_n + (length - 1) * chain,
        }
        if task is not None:
            return per_task[task] / length
        return sum(per_task.values()) / len(TASKS) / length
