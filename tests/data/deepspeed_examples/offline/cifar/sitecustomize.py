"""With `ZEROMEM_EXAMPLE_SEED` set, seed torch at interpreter start.

`cifar10_deepspeed.py` builds its model without seeding, so two runs (one
process, two ranks) would start from different weights and their losses could
not be compared. Python imports this module itself when the folder is on
PYTHONPATH; without the variable it does nothing.
"""
import os

if os.environ.get("ZEROMEM_EXAMPLE_SEED"):
    import torch

    torch.manual_seed(int(os.environ["ZEROMEM_EXAMPLE_SEED"]))
