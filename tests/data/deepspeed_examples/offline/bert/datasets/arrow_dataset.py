"""A list-backed `Dataset` with the `filter`/`map` calls `train_bert_ds.py` makes."""
from __future__ import annotations


class Dataset:
    def __init__(self, records: list[dict]):
        self.records = records

    def filter(self, function) -> Dataset:
        return Dataset([r for r in self.records if function(r)])

    def map(self, function) -> Dataset:
        return Dataset([{**r, **function(r)} for r in self.records])

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        return self.records[index]
