"""Write a tiny word-level tokenizer with RoBERTa's special-token ids to a folder.

`train_bert_ds.py --tokenizer <folder>` loads it with `AutoTokenizer.from_pretrained`
instead of downloading roberta-base. Ids: <s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=4,
as RoBERTa's (the script's model config hard-codes pad=1, bos=0, eos=2).
"""
from __future__ import annotations

import sys

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from datasets import _WORDS

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def make_tokenizer(folder: str) -> None:
    vocab = {w: i for i, w in enumerate(SPECIALS + sorted(set(_WORDS)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", pad_token="<pad>",
                                  eos_token="</s>", unk_token="<unk>", mask_token="<mask>")
    tok.save_pretrained(folder)


if __name__ == "__main__":
    make_tokenizer(sys.argv[1])
