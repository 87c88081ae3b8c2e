"""A reduced draft vocabulary: MTP drafts take the argmax over the LM-head rows of a token subset only.

Drafting pays one LM head per MTP depth, and at serving sizes on CPU the head's weight traffic (V x H
floats per call) is most of what a depth costs beyond its decoder block. Drafts only decide how many
tokens a verify step accepts, never which tokens are emitted (verification is lossless and drafts are
one-hot), so a draft head restricted to the N most frequent tokens keeps the output exactly the same;
it only misses a draft whose best token lies outside the subset.

The subset is a model artifact: an optional `draft_vocab.json` in the model directory,
`{"token_ids": [most frequent first, ...], ...}` (other keys are provenance). Absent, drafts use the
full vocabulary, so checkpoints without it load unchanged.

Under tensor parallelism the head's rows are split by vocabulary range. Each rank keeps the subset's
columns it owns and zeros for the others, and the [N, subset] logits are all-reduced: every entry is
one rank's value plus exact zeros, so all ranks see the same logits as a single rank would.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle

from mtpserve.model.parallel import ParallelLMHead, ServingWeight, TensorParallel

DRAFT_VOCAB_FILE = "draft_vocab.json"


class DraftVocabError(ValueError):
    """draft_vocab.json is malformed or names ids outside the model's vocabulary."""


def read_draft_vocab(model_dir: str | Path, vocab_size: int) -> np.ndarray | None:
    """The subset's full-vocabulary ids [N] int64 from `model_dir/draft_vocab.json`, or None if absent."""
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    return read_draft_vocab_file(path, vocab_size) if path.exists() else None


def read_draft_vocab_file(path: str | Path, vocab_size: int) -> np.ndarray:
    """token_ids [N] int64 of a draft vocabulary file, checked against the model's vocabulary."""
    ids = np.asarray(json.loads(Path(path).read_text()).get("token_ids", []), dtype=np.int64)
    check_token_ids(ids, vocab_size, str(path))
    return ids


def check_token_ids(ids: np.ndarray, vocab_size: int, where: str = "draft vocabulary") -> None:
    if ids.ndim != 1 or ids.size == 0:
        raise DraftVocabError(f"{where}: token_ids must be a non-empty list")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise DraftVocabError(f"{where}: token ids must lie in [0, {vocab_size})")
    if np.unique(ids).size != ids.size:
        raise DraftVocabError(f"{where}: token ids must be distinct")


class DraftHead:
    """argmax over the LM head restricted to `token_ids`, returned as full-vocabulary ids.

    Eval mode serves from an [H, N] copy built by `freeze()` (this rank's columns, zeros elsewhere);
    without it (training) the subset is gathered from the live head weight on every call.
    """

    def __init__(self, token_ids: np.ndarray, head: ParallelLMHead, tp: TensorParallel):
        self.head, self.tp = head, tp
        self.ids = paddle.to_tensor(token_ids.astype(np.int64))  # [N] full-vocabulary ids
        rows = head._weight().shape[0]  # this rank's vocabulary rows
        local = token_ids - tp.rank * rows
        owned = (local >= 0) & (local < rows)
        self.local_rows = paddle.to_tensor(np.where(owned, local, 0).astype(np.int64))  # [N]
        self.owned = paddle.to_tensor(owned.astype(np.float32)).unsqueeze(-1)  # [N, 1]
        self.serving = ServingWeight()

    @property
    def size(self) -> int:
        return self.ids.shape[0]

    def freeze(self) -> None:
        with paddle.no_grad():
            self.serving.freeze(self._subset_weight())

    def thaw(self) -> None:
        self.serving.thaw()

    def __call__(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        """hidden_states: [M, H] -> [M] int64 full-vocabulary ids."""
        weight = None if self.serving.t is not None else self._subset_weight()
        logits = self.tp.all_reduce(self.serving.matmul(hidden_states, weight))  # [M, N]
        return paddle.gather(self.ids, paddle.argmax(logits, axis=-1))

    def _subset_weight(self) -> paddle.Tensor:
        """[N, H] in checkpoint layout: the head rows of the subset this rank owns, zeros for the rest."""
        weight = paddle.gather(self.head._weight(), self.local_rows)
        return weight if self.tp.size == 1 else weight * self.owned.astype(weight.dtype)
