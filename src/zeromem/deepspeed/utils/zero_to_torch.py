"""DeepSpeed's `deepspeed.utils.zero_to_torch`: `zero_to_fp32`'s command with `--dtype` required.

    python -m zeromem.deepspeed.utils.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR --dtype bf16
"""
from __future__ import annotations

from .zero_to_fp32 import main as _convert


def main(argv: list[str] | None = None) -> None:
    """DeepSpeed's `zero_to_torch.py` command line."""
    _convert(argv, dtype_required=True)


if __name__ == "__main__":
    main()
