"""Configs and training loops that several test files share (models are in models.py)."""
from __future__ import annotations

import contextlib
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

import zeromem
from zeromem.comm import Pending, done
from models import TinyLM, micro_batch, uses_sometimes

# Checkpoint tests: G micro-batches per optimizer step whatever the world size, so runs of
# different world sizes train on exactly the same data.
G = 4
SAVE_BUCKET = 100

# Stage 3 keeps units under the threshold (default 100k elements: all of BufferedLM) whole;
# 0 partitions every unit, so stage-3 saves and loads really see parameter shards.
PARTITION_ALL = {"stage3_param_persistence_threshold": 0}


def parity_config(stage: int, gas: int, clip: float, world_size: int, overlap: bool | None = None,
                  **extra) -> dict:
    # stage 3: persistence threshold 0 so every parameter of this tiny model is partitioned;
    # overlap None: DeepSpeed's default (async buckets at stage 3 only)
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        # tiny buckets: several reduce buckets and chunked all-gathers on this tiny model
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                              "allgather_bucket_size": 50,
                              "stage3_param_persistence_threshold": 0,
                              "overlap_comm": overlap},
        **extra,
    }


def build_tiny_lm(use_init: bool) -> TinyLM:
    """TinyLM from seed 0, built whole or already partitioned under zeromem.Init."""
    torch.manual_seed(0)
    if not use_init:
        return TinyLM()
    with zeromem.Init():
        return TinyLM()


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, world_size: int,
                   **kwargs) -> list[float]:
    """One AdamW step on the global batch; unreached parameters get zero gradients, as in ZeRO."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    losses = []
    for r in range(world_size):
        loss = model(*micro_batch(step, r, 0), **kwargs)
        (loss / world_size).backward()
        losses.append(loss.item())
    opt.step()
    return losses  # per rank's micro-batch


def checkpoint_config(stage: int, world_size: int, bucket: int = SAVE_BUCKET, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": G // world_size,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 5,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                              "allgather_bucket_size": 50, **PARTITION_ALL},
        **extra,
    }


def train_global_batch(engine, rank: int, world_size: int, steps) -> None:
    """Rank r runs micro-batches r*gas .. r*gas+gas-1 of each global batch of G."""
    gas = G // world_size
    for step in steps:
        for micro in range(gas):
            j = rank * gas + micro
            tokens, targets = micro_batch(step, j, 0)
            # Same on every rank: stage 3 with partitioned units gathers each module collectively.
            engine.backward(engine(tokens, targets, uses_sometimes(step, j, 0, per_rank=False)))
            engine.step()


# DeepSpeed checkpoints (tests/data/deepspeed_checkpoints, made by tools/make_deepspeed_checkpoints.py):
# each case directory holds DeepSpeed's checkpoint and expected.json (its config and its loss curve
# after the save, one loss per micro-batch j of G per step).
DEEPSPEED_CHECKPOINTS = Path(__file__).parent / "data" / "deepspeed_checkpoints"


def deepspeed_case(name: str) -> tuple:
    """(checkpoint directory, expected.json contents) of one DeepSpeed checkpoint case."""
    path = DEEPSPEED_CHECKPOINTS / name
    return path, json.loads((path / "expected.json").read_text())


def deepspeed_param_groups(model, expected: dict, names: bool = False) -> list:
    """The param groups the DeepSpeed run trained `model` with (HF Trainer's two, in the
    cases that recorded them; else one), by parameter or, with `names`, by name."""
    named = dict(model.named_parameters())
    groups = expected.get("param_groups") or [{"params": [n for n, p in named.items()
                                                          if p.requires_grad]}]
    return groups if names else [{**g, "params": [named[n] for n in g["params"]]} for g in groups]


def deepspeed_engine(expected: dict):
    """What an engine built as the DeepSpeed run was tells the import (`LoadingEngine`): the
    order it gave its optimizer the parameters in (what a stage-0 checkpoint's states are
    numbered by) and that optimizer's kind (the script's own in client_optimizer cases)."""
    from zeromem.checkpoints.deepspeed_import import LoadingEngine

    model = TinyLM()
    if expected.get("frozen_tied"):
        model.embed.requires_grad_(False)
    order = [[(n, True) for n in g["params"]]
             for g in deepspeed_param_groups(model, expected, names=True)]
    block = expected["config"].get("optimizer")
    return LoadingEngine(order, block["type"].lower() if block else "sgd")


# zeromem's DynamicScaler state key -> DeepSpeed's DynamicLossScaler attribute
DEEPSPEED_SCALER = {"scale": "cur_scale", "hysteresis_left": "cur_hysteresis",
                    "iteration": "cur_iter", "last_overflow_iteration": "last_overflow_iter"}


def deepspeed_scaler(expected: dict) -> dict:
    """zeromem's loss scaler state right after loading the case ({} without fp16)."""
    fp16 = expected["config"].get("fp16") or {}
    if not fp16.get("enabled"):
        return {}
    if fp16.get("loss_scale"):  # static
        return {"scale": expected["scaler"]["cur_scale"]}
    # DeepSpeed's stage-0 FP16_Optimizer keeps no hysteresis: the run resumes with the config's
    saved = {"cur_hysteresis": fp16.get("hysteresis", 2), **expected["scaler"]}
    return {ours: saved[theirs] for ours, theirs in DEEPSPEED_SCALER.items()}


class Opens:
    """Pickled into a checkpoint, this would create a file if it were unpickled unchecked."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def inert(data):
    """`load_pt`'s stand-ins for DeepSpeed objects as plain dicts, so that torch.save can
    write them back loadable."""
    if type(data).__module__ == "zeromem.checkpoints.deepspeed_pickles":
        return dict(vars(data))
    if isinstance(data, dict):
        return type(data)((k, inert(v)) for k, v in data.items())
    if isinstance(data, (list, tuple)):
        return type(data)(inert(v) for v in data)
    return data


def deepspeed_resume_config(expected: dict, stage: int, world_size: int) -> dict:
    """The DeepSpeed run's config for a zeromem run at `stage` on `world_size` ranks."""
    config = copy.deepcopy(expected["config"])
    config["gradient_accumulation_steps"] = expected["micro_batches_per_step"] // world_size
    zero = config["zero_optimization"]
    zero["stage"] = stage
    for block in ("offload_optimizer", "offload_param"):
        if zero.get(block, {}).get("device") == "nvme":  # the DeepSpeed run's folder is gone
            zero[block]["nvme_path"] = tempfile.gettempdir()
    return config


def deepspeed_curve(engine, rank: int, world_size: int, expected: dict,
                    trace: list | None = None) -> list[list[float]]:
    """This rank's losses over the steps DeepSpeed recorded after its save: [step][micro].
    `trace` gets, per step, (loss scale, lr) it ran with and whether it was skipped."""
    gas = expected["micro_batches_per_step"] // world_size
    curve = []
    for i in range(len(expected["losses"])):
        step, losses = expected["save_at"] + i, []
        before = (engine.loss_scale, engine.get_lr()[0], engine.skipped_steps)
        for micro in range(gas):
            loss = engine(*micro_batch(step, rank * gas + micro, 0), True)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        curve.append(losses)
        if trace is not None:
            trace.append((before[0], before[1], engine.skipped_steps > before[2]))
    return curve


# ---------------------------------------------------------------- activations, measured

def hf_tiny_builders(vocab: int = 256, seq: int = 128) -> dict:
    """name -> builder of a tiny Hugging Face model (GPT-2, Llama, BERT, T5), dropout off."""
    import transformers as t
    small = dict(vocab_size=vocab, num_hidden_layers=2, num_attention_heads=2)
    return {
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(
            n_embd=64, n_layer=2, n_head=2, n_positions=seq, vocab_size=vocab, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(
            hidden_size=64, intermediate_size=160, num_key_value_heads=1,
            max_position_embeddings=seq, **small)),
        "bert": lambda: t.BertForMaskedLM(t.BertConfig(
            hidden_size=64, intermediate_size=128, max_position_embeddings=seq,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small)),
        "t5": lambda: t.T5ForConditionalGeneration(t.T5Config(
            d_model=64, d_ff=128, d_kv=32, num_layers=2, num_heads=2, vocab_size=vocab,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
    }


class ActivationCensus:
    """Measures a real forward + backward: bytes of what autograd saves plus what
    `zeromem.checkpoint` stores, once per storage, parameters excluded; `at_backward_start`
    and the `peak` over every op of forward and backward (recompute included)."""

    def __init__(self, model: nn.Module):
        from torch.multiprocessing.reductions import StorageWeakRef
        self._ref = StorageWeakRef
        self.excluded = {StorageWeakRef(t.untyped_storage()).cdata
                         for t in (*model.parameters(), *model.buffers())}
        self.saved: dict[int, tuple] = {}
        self.created: dict[int, tuple] = {}
        self.stored: dict[int, tuple] = {}
        self.peak = 0
        self.at_backward_start = 0

    def _track(self, table: dict, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ref = self._ref(storage)
        if ref.cdata not in self.excluded:
            table.setdefault(ref.cdata, (ref, storage.nbytes()))

    def held_bytes(self) -> int:
        alive = {k: n for table in (self.saved, self.stored) for k, (r, n) in table.items()
                 if not r.expired()}
        return sum(alive.values())

    def run(self, forward, backward=None) -> None:
        """forward() -> loss; then backward(loss) (default loss.backward())."""
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        census = self

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and not census.created_closed:
                        census._track(census.created, t)
                census.peak = max(census.peak, census.held_bytes())
                return out

        def pack(t):
            self._track(self.saved, t)
            return t

        self.created_closed = False
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with Watch():
                loss = forward()
            loss_key = self._ref(loss.untyped_storage()).cdata
            # What is alive after forward and neither saved by autograd nor the loss was
            # stored by zeromem.checkpoint (the checkpoints).
            self.stored = {k: v for k, v in self.created.items()
                           if not v[0].expired() and k not in self.saved and k != loss_key}
            self.created_closed = True
            self.at_backward_start = self.held_bytes()
            self.peak = max(self.peak, self.at_backward_start)
            with Watch():
                (backward or (lambda x: x.backward()))(loss)


class OneRank:
    """Collectives over one rank, for unit tests without a process group (a reduce-scatter or
    an all-reduce over one rank leaves its input as it is), recording each bucket reduced."""

    def __init__(self) -> None:
        self.buckets: list[torch.Tensor] = []

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       async_op: bool = False) -> Pending:
        self.buckets.append(input.clone())
        if output.data_ptr() != input.data_ptr():
            output.copy_(input[:output.numel()])
        return done()

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Pending:
        self.buckets.append(tensor.clone())
        return done()

    def note_buffer(self, tensor: torch.Tensor) -> None:
        pass

    def release_buffer(self, tensor: torch.Tensor) -> None:
        pass


def slow_writes(delay_s: Callable[[str], float]) -> contextlib.AbstractContextManager[None]:
    """Inside the block, every swap write request waits `delay_s(file name)` first: a slow
    disk, so that what waits for writes (or should not) is seen waiting."""
    return slow_disk(lambda op, name: delay_s(name) if op == "write" else 0.0)


@contextlib.contextmanager
def slow_disk(delay_s: Callable[[str, str], float]) -> Iterator[None]:
    """Inside the block, every swap request waits `delay_s("read" or "write", file name)`
    first."""
    import zeromem.offload.nvme as nvme
    transfer = nvme._transfer

    def slow(op, fd, view, offset, path):
        time.sleep(delay_s(op, Path(path).name))
        transfer(op, fd, view, offset, path)

    nvme._transfer = slow
    try:
        yield
    finally:
        nvme._transfer = transfer


@contextlib.contextmanager
def submitted_writes(name: str) -> Iterator[list[tuple[int, int]]]:
    """Inside the block, the [start, end) byte ranges of the writes of swap file `name`, in
    the order they were submitted (whatever order they land in)."""
    from zeromem.offload.nvme import SwapFile
    write, ranges = SwapFile.write, []

    def recorded(self, buffer, offset):
        if self.path.name == name:
            ranges.append((offset, offset + buffer.numel()))
        return write(self, buffer, offset)

    SwapFile.write = recorded  # type: ignore[method-assign]
    try:
        yield ranges
    finally:
        SwapFile.write = write  # type: ignore[method-assign]


def written_twice(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges two of `ranges` both write: their order of landing decides the bytes."""
    ordered = sorted(ranges)
    return [(b[0], min(a[1], b[1])) for a, b in zip(ordered, ordered[1:]) if b[0] < a[1]]
