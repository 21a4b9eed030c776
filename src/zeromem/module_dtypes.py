"""The dtypes a precision block gives the module's frozen parameters and its buffers.

The trained parameters become their flat groups' compute dtype wherever the groups are
built. What else the module holds, `cast_module` decides, at `initialize`:

- every floating parameter (frozen ones too) takes the compute dtype, as DeepSpeed's
  and FSDP2's parameters do;
- a floating buffer keeps the dtype it was built in (DeepSpeed 0.19.8, FSDP2, and a
  model loaded by HF with `dtype=torch.bfloat16`), except
  - one in a module that holds floating parameters of its own: it takes their dtype.
    Those are the module's own statistics, which torch requires in its weight's dtype
    (BatchNorm's running mean and variance). DeepSpeed 0.19.8 leaves them fp32 and
    BatchNorm's forward then fails ("expected scalar type BFloat16 but found Float");
  - `data_types.buffer_dtype`, when set: every floating buffer takes it (DeepSpeed's
    switch back to its old blanket `module.bfloat16()`);
  - the buffers `data_types.keep_in_fp32_modules` names stay (or become) fp32: by default
    those the model's own HF lists name (`_keep_in_fp32_modules_strict`, and under fp16
    `_keep_in_fp32_modules`), as HF's loader and DeepSpeed keep them (DeepSeek-V3's
    expert-routing bias `e_score_correction_bias`).

Why not the blanket cast zeromem did before stop 49: a rotary embedding's `inv_freq` (a
buffer of a module without parameters, fp32 in HF's models) rounded to bf16 gives cosines
that differ from HF's by 0.19 at position 1024 and by 0.71 at 4096 (tiny Llama, measured).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from zeromem.config.precision_blocks import KeepInFp32
from zeromem.config.schema import Config


def cast_module(module: nn.Module, config: Config) -> None:
    """Cast `module`'s frozen parameters and buffers as the docstring says.

    Without a precision block nothing is cast but the buffers `data_types.buffer_dtype`
    names a dtype for."""
    dtype = config.compute_dtype if config.casts_module else None
    buffer_dtype = config.buffer_dtype
    keep = _kept_in_fp32(module, config.data_types.keep_in_fp32_modules, dtype)
    for prefix, owner in module.named_modules():
        own_params = [p for p in owner.parameters(recurse=False) if p.is_floating_point()]
        if dtype is not None:
            for p in own_params:
                p.data = p.data.to(dtype)
        follows = buffer_dtype or (dtype if own_params else None)
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is None or not buffer.is_floating_point():
                continue
            full_name = f"{prefix}.{name}" if prefix else name
            wanted = torch.float32 if keep is not None and keep.search(full_name) else follows
            if wanted is not None and buffer.dtype != wanted:
                buffer.data = buffer.data.to(wanted)


def _kept_in_fp32(module: nn.Module, setting: KeepInFp32,
                  dtype: torch.dtype | None) -> re.Pattern | None:
    """Buffer names to keep in fp32: the listed patterns (`*`: any characters, matched
    anywhere in the name, as HF matches them), or with "auto" the model's HF lists, each
    under the prefix of the module that declares it."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if setting != "auto":
        patterns = {name.replace("*", ".*") for name in setting}
    else:
        patterns = set()
        for prefix, owner in module.named_modules():
            names = set(getattr(owner, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                names |= set(getattr(owner, "_keep_in_fp32_modules", None) or ())
            under = rf"^{re.escape(prefix)}\..*" if prefix else ""
            patterns |= {under + name.replace("*", ".*") for name in names}
    return re.compile("|".join(sorted(patterns))) if patterns else None
