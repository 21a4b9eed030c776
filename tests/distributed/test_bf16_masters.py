"""bf16 master weights and optimizer states (`bf16.bf16_master_weights_and_grads` with
`bf16.bf16_optimizer_states`, DeepSpeed's PR 7700 and DeepSpeedExamples'
training/bf16_master_weight/configs/bf16_full.json): the optimizer steps the bf16
parameters themselves, as one process stepping a bf16 model with torch's optimizer does.

- Exact: both ranks train on the same micro-batches, so the reduced gradient is each
  rank's own (a sum of two equal bf16 values is exact) and every rank's masters, parameter
  shards and whole parameters equal the one-process bf16 model bit for bit, with AdamW
  and with SGD + momentum, accumulation 2. fp32 masters (the default) on the same run do
  not: the test tells the two apart.
  The engine is built from other weights, then the user's are loaded into its module and
  it evaluates before the first step; `torch.compile`d (aot_eager), exact too.
- As users run it: ranks on different data, against the one-process bf16 model within
  bf16's rounding of the reduction.
- Checkpoints: saved and loaded back, training goes on as if never stopped; a bf16-master
  checkpoint loads into an fp32-master run too.
(Memory: test_memory_comm.py measures the bytes it saves.)
"""
from __future__ import annotations

import copy
import itertools
import tempfile
from pathlib import Path

import pytest
import torch

import zeromem
from harness import run_together
from models import TinyLM, micro_batch, own_view_diff

STEPS, GAS = 4, 2
MASTERS = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                    "bf16_optimizer_states": True}}
OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "sgd": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}}


# stage 3 with its parameter shards in host memory keeps bf16 masters on the device; with
# offload_optimizer they live in host memory, stepped there (DeepSpeed's CPU Adam, bf16 moments)
CPU = {"device": "cpu"}
# fp32 accumulation of bf16 gradients: a sum of two bf16 values is exact in fp32, so the
# bf16 master gradient rounds it as one process's bf16 accumulation does
FP32_GRADS = {"data_types": {"grad_accum_dtype": "fp32"}}
SETUPS = {"1": (1, {}, {}), "2": (2, {}, {}), "3": (3, {}, {}),
          "3 offload_param": (3, {"offload_param": CPU}, {}),
          "2 offload_optimizer": (2, {"offload_optimizer": CPU}, {}),
          "2 offload_optimizer fp32 grads": (2, {"offload_optimizer": CPU}, FP32_GRADS),
          "3 offload both": (3, {"offload_optimizer": CPU, "offload_param": CPU}, {})}


def config(stage: int, optimizer: str, masters: bool = True, clip: float = 0.0,
           extra: dict | None = None, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS,
            "gradient_clipping": clip, "optimizer": OPTIMIZERS[optimizer],
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                                  "stage3_param_persistence_threshold": 0, **zero},
            **(MASTERS if masters else {"bf16": {"enabled": True}}), **(extra or {})}


def one_process(model: torch.nn.Module, optimizer: str) -> torch.optim.Optimizer:
    """torch's optimizer on the bf16 model, with the kernel zeromem asks for (fused AdamW)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=True)


def reference_step(model, opt, step: int, ranks: list[int], clip: float = 0.0) -> None:
    """One step on the global batch: each (rank, micro-step) batch's loss / count, summed
    per micro-step over `ranks` first, as the engine accumulates then reduces."""
    for p in model.parameters():
        p.grad = None
    for micro in range(GAS):
        for rank in ranks:
            tokens, targets = micro_batch(step, rank, micro)
            (model(tokens, targets) / (GAS * len(ranks))).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
    opt.step()


def train(engine, step: int, rank: int) -> None:
    for micro in range(GAS):
        tokens, targets = micro_batch(step, rank, micro)
        engine.backward(engine(tokens, targets))
        engine.step()


def bf16_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().to(torch.bfloat16)


def state_dtypes(engine) -> set[str]:
    return {str(t.dtype) for s in engine.optimizer.state.values() for t in s.values()
            if torch.is_tensor(t) and t.dim()}


def loaded_and_evaluated(engine, rank: int) -> None:
    """As users start: the weights loaded into the module after `initialize` (the engine
    was built from other ones), then an evaluation before the first step."""
    torch.manual_seed(0)
    engine.module.load_state_dict(TinyLM().state_dict())
    engine.eval()
    with torch.no_grad():
        engine(*micro_batch(99, rank, 0))
    engine.train()


def same_batches(rank: int, world_size: int) -> dict:
    """Both ranks on rank 0's batches: each case's largest difference from one process."""
    out = {}
    for name, (stage, zero, extra) in SETUPS.items():
        for optimizer in OPTIMIZERS:
            for masters in (True, False):
                ref = bf16_model()
                opt = one_process(ref, optimizer)
                torch.manual_seed(7 + rank)  # not the weights it trains: those are loaded
                engine = zeromem.initialize(TinyLM(), config(stage, optimizer, masters, extra=extra,
                                                             **zero))
                loaded_and_evaluated(engine, rank)
                for step in range(STEPS):
                    train(engine, step, 0)
                    reference_step(ref, opt, step, [0])
                out[(name, optimizer, masters)] = (
                    own_view_diff(engine, ref), state_dtypes(engine),
                    {str(g.master.dtype) for g in engine.groups},
                    all(g.master_aliases_params() for g in engine.groups))
    return out


def compiled(rank: int, world_size: int) -> dict:
    """`torch.compile(model)` (aot_eager: torch's own kernels, traced) at stages 2 and 3,
    both ranks on rank 0's batches, against the eager one-process bf16 model."""
    out = {}
    for stage in (2, 3):
        torch._dynamo.reset()
        ref = bf16_model()
        opt = one_process(ref, "sgd")
        torch.manual_seed(0)
        engine = zeromem.initialize(torch.compile(TinyLM(), backend="aot_eager"),
                                    config(stage, "sgd"))
        for step in range(STEPS):
            train(engine, step, 0)
            reference_step(ref, opt, step, [0])
        out[stage] = own_view_diff(engine, ref)
    return out


def own_batches(rank: int, world_size: int) -> dict:
    """Each rank on its own batches, against one process on both ranks' batches; clipped
    too (the clip coefficient scales the bf16 gradient)."""
    out = {}
    for stage in (1, 2, 3):
        for optimizer, clip in itertools.product(OPTIMIZERS, (0.0, 0.5)):
            ref = bf16_model()
            initial = copy.deepcopy(ref)
            opt = one_process(ref, optimizer)
            torch.manual_seed(0)
            engine = zeromem.initialize(TinyLM(), config(stage, optimizer, clip=clip))
            for step in range(STEPS):
                train(engine, step, rank)
                reference_step(ref, opt, step, list(range(world_size)), clip)
            out[(stage, optimizer, clip)] = (own_view_diff(engine, ref),
                                             own_view_diff(engine, initial))
    return out


def held(engine) -> list[torch.Tensor]:
    """What this rank holds of every group, in fp32: master shard and parameter shard."""
    return [t.detach().float().clone() for g in engine.groups for t in (g.master, g.param_shard)]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def resumed(rank: int, world_size: int) -> dict:
    """Two steps, a checkpoint, two more; the same two more after loading it into a fresh
    engine (bf16 masters), and into one with fp32 masters. Compared on every rank."""
    out = {}
    for stage in (2, 3):
        with tempfile.TemporaryDirectory() as tmp:
            shared = [tmp]
            torch.distributed.broadcast_object_list(shared, src=0)
            torch.manual_seed(0)
            engine = zeromem.initialize(TinyLM(), config(stage, "adamw"))
            for step in range(2):
                train(engine, step, rank)
            engine.save_checkpoint(shared[0], tag="two")
            saved = held(engine)
            for step in range(2, 4):
                train(engine, step, rank)
            torch.manual_seed(1)
            again = zeromem.initialize(TinyLM(), config(stage, "adamw"))
            again.load_checkpoint(shared[0], tag="two")
            for step in range(2, 4):
                train(again, step, rank)
            torch.manual_seed(1)
            fp32 = zeromem.initialize(TinyLM(), config(stage, "adamw", masters=False))
            fp32.load_checkpoint(shared[0], tag="two")
            out[stage] = (max_diff(held(engine), held(again)), state_dtypes(again),
                          state_dtypes(fp32), max_diff(saved, held(fp32)))
            torch.distributed.barrier()
    return out


BF16_FULL = (Path(__file__).parents[1] / "data" / "ds_config_corpus" / "DeepSpeedExamples" /
             "training" / "bf16_master_weight" / "configs" / "bf16_full.json")


def transformer() -> torch.nn.Module:
    """A small transformer of the example's kind (attention, LayerNorm, GELU MLP)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 32),
        torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu",
                                         batch_first=True),
        torch.nn.Linear(32, 50))


def example_loss(model, step: int, rank: int) -> torch.Tensor:
    """The example's step: the forward and the loss under the caller's autocast too."""
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(10 * step + rank))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        return torch.nn.functional.cross_entropy(logits.view(-1, 50), ids.view(-1))


def deepspeed_example(rank: int, world_size: int) -> dict:
    """DeepSpeedExamples' bf16_full.json as its train.py runs it: the DeepSpeed API, the
    config file's path, PyTorch-style `loss.backward()`. Against one process stepping the
    bf16 model with torch's AdamW (its lr, betas, eps, weight decay), clipped at 1.0
    (DeepSpeed 0.19.8's default: the file has no gradient_clipping)."""
    import zeromem.deepspeed as deepspeed
    model = transformer()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=str(BF16_FULL))
    ref = transformer().to(torch.bfloat16)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01, fused=True)
    initial = copy.deepcopy(ref)
    for step in range(STEPS):
        example_loss(engine, step, rank).backward()
        engine.step()
        for r in range(world_size):
            (example_loss(ref, step, r) / world_size).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    got = {"flags": (engine.zero_optimization_stage(), engine.bfloat16_enabled(),
                     engine.bf16_master_weights_and_gradients(), engine.bf16_optimizer_states()),
           "diff": own_view_diff(engine.engine, ref), "moved": own_view_diff(engine.engine, initial),
           "states": state_dtypes(engine.engine)}
    engine.destroy()  # as the example ends
    return got


@pytest.fixture(scope="module")
def world() -> dict[str, list]:
    return run_together({"same": (same_batches, ()), "own": (own_batches, ()),
                         "compiled": (compiled, ()), "resumed": (resumed, ()),
                         "example": (deepspeed_example, ())}, 2)


def test_deepspeed_examples_bf16_full_config_runs_through_the_deepspeed_api(world):
    for rank, got in enumerate(world["example"]):
        assert got["flags"] == (3, True, True, True), rank
        assert got["states"] == {"torch.bfloat16"}, rank
        # lr 1e-4 x 4 steps moves the weights up to 2**-11 (many not at all: bf16 rounds the
        # update away); the two differ by the rounding of the ranks' sum, one small ulp
        assert got["moved"] >= 2 ** -11, (rank, got["moved"])
        assert got["diff"] <= 2 ** -12, (rank, got["diff"])


def test_bf16_masters_step_like_one_bf16_process_bit_for_bit(world):
    for rank, per_rank in enumerate(world["same"]):
        for (setup, optimizer, masters), (diff, dtypes, master, aliased) in per_rank.items():
            where = f"rank {rank} stage {setup} {optimizer}"
            if masters:
                assert diff == 0.0, f"{where}: {diff}"
                assert master == {"torch.bfloat16"}, f"{where}: masters {master}"
                # the parameter shard is the master, unless it left for host memory
                assert aliased == ("offload" not in setup), f"{where}: a second master copy"
                assert dtypes <= {"torch.bfloat16"}, f"{where}: states {dtypes}"
            else:  # fp32 masters keep what bf16 rounds away: the exact check sees it
                assert diff > 0.0, where
                assert master == dtypes == {"torch.float32"}, where
                assert not aliased, where


def test_bf16_masters_under_torch_compile_step_like_one_eager_process(world):
    for rank, per_rank in enumerate(world["compiled"]):
        assert per_rank == {2: 0.0, 3: 0.0}, (rank, per_rank)


def test_bf16_masters_on_each_ranks_own_data_track_one_process(world):
    for rank, per_rank in enumerate(world["own"]):
        for (stage, optimizer, clip), (diff, moved) in per_rank.items():
            # bf16 rounds the reduced sum of the ranks' gradients (one process sums them in
            # its backward): a few ulps where the weights end (2**-7 at magnitude 1-2). SGD
            # moves them by ~1.5, so a gradient twice too large would be ~0.7 off.
            tolerance = {"adamw": 2e-2, "sgd": 6e-2}[optimizer]
            where = f"rank {rank} stage {stage} {optimizer} clip {clip}"
            assert diff < tolerance, f"{where}: {diff}"
            assert moved > 5e-2, f"{where}: did not train"


def test_bf16_masters_resume_exactly_and_load_into_fp32_masters(world):
    for rank, per_rank in enumerate(world["resumed"]):
        for stage, (diff, dtypes, fp32_dtypes, loaded) in per_rank.items():
            assert diff == 0.0, f"rank {rank} stage {stage}: resumed run differs by {diff}"
            assert dtypes == {"torch.bfloat16"}, (rank, stage, dtypes)
            assert fp32_dtypes == {"torch.float32"}, (rank, stage, fp32_dtypes)
            assert loaded == 0.0, (rank, stage, loaded)
