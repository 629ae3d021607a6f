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
given). `entropy_floor` returns a lower bound on the achievable mean loss per masked position.
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
    """

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    tasks: np.ndarray


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

    def _body(self, task: int, rng: np.random.Generator) -> np.ndarray:
        n, length = self.num_symbols, self.body_len
        name = TASKS[task]
        if name == "progression":
            start, step = rng.integers(n), rng.integers(1, n)
            return (start + step * np.arange(length)) % n
        if name == "repeat":
            motif = rng.integers(n, size=rng.integers(MOTIF_LENGTHS[0], MOTIF_LENGTHS[1] + 1))
            return np.resize(motif, length)
        if name == "mirror":
            half = rng.integers(n, size=(length + 1) // 2)
            return np.concatenate([half, half[::-1]])[:length]
        body = np.empty(length, np.int64)
        body[0] = rng.integers(n)
        choices = rng.choice(MARKOV_SUCCESSORS, size=length, p=MARKOV_PROBS)
        for i in range(1, length):
            body[i] = self.successors[body[i - 1], choices[i]]
        return body

    def batch(self, batch_size: int, rng: np.random.Generator) -> Batch:
        """Draws `batch_size` sequences with tasks chosen uniformly."""
        seqs = np.empty((batch_size, self.seq_len + 1), np.int32)
        tasks = rng.integers(len(TASKS), size=batch_size)
        for b, task in enumerate(tasks):
            seqs[b, 0] = BOS
            seqs[b, 1] = 2 + task
            seqs[b, 2:] = self.first_symbol + self._body(int(task), rng)
        mask = np.ones((batch_size, self.seq_len), np.float32)
        mask[:, 0] = 0.0  # predicting the task token from BOS: not part of the language
        return Batch(inputs=seqs[:, :-1], targets=seqs[:, 1:], mask=mask,
                     tasks=tasks.astype(np.int32))

    def entropy_floor(self, task: str | None = None) -> float:
        """A lower bound on the mean loss per masked position (nats) of `task` (default: all).

        Counts only the symbols that are random given the rule (the repeat task's motif length
        is treated as known, hence a lower bound).
        """
        n, length = self.num_symbols, self.body_len
        log_n = math.log(n)
        chain = -sum(p * math.log(p) for p in MARKOV_PROBS)
        lo, hi = MOTIF_LENGTHS
        per_task = {
            "progression": min(2, length) * log_n,
            "repeat": sum(min(p, length) for p in range(lo, hi + 1)) / (hi - lo + 1) * log_n,
            "mirror": ((length + 1) // 2) * log_n,
            "markov": log_n + (length - 1) * chain,
        }
        if task is not None:
            return per_task[task] / length
        return sum(per_task.values()) / len(TASKS) / length
