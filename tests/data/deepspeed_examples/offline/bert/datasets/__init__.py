"""Test stand-in for Hugging Face `datasets` (wikitext cannot be downloaded; not installed).

Only what `train_bert_ds.py` uses: `load_dataset("wikitext", ...)` returning a
small list-backed `arrow_dataset.Dataset` of deterministic synthetic sentences,
with `filter`, `map`, `len` and indexing. `ZEROMEM_WIKITEXT_LINES` sets the size.
"""
from __future__ import annotations

import os
import random

from . import arrow_dataset

_WORDS = ("the model trains on many small words while ranks share shards of every "
          "parameter gradient and optimizer state so memory falls as devices grow").split()


def load_dataset(path: str, name: str | None = None, split: str | None = None, **kwargs):
    rng = random.Random(0)
    lines = int(os.environ.get("ZEROMEM_WIKITEXT_LINES", 64))
    records = []
    for i in range(lines):
        # wikitext has empty lines and trailing newlines; the script filters and strips them
        text = "" if i % 8 == 7 else " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 20)))
        records.append({"text": text + "\n" if text else ""})
    return arrow_dataset.Dataset(records)


__all__ = ["load_dataset", "arrow_dataset"]
