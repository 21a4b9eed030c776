"""Setups real users have that once gave wrong results (issue 10, items 1, 3, 4 and 7).

- ranks seeded differently: `initialize` broadcasts rank 0's parameters and buffers;
- evaluation before the first step, on every rank (under torch.inference_mode too);
- stage 3 holds only shards right after `initialize` (bytes of live storages);
- weights loaded into `engine.module` take effect, at every stage and precision;
- bf16/fp16 masters start from the user's fp32 values, not their rounding;
- and later stops' setups: a second engine on one model, sparse embeddings, the user's own
  torch optimizer, a model loaded in 16 bits. Frozen parameters: test_frozen_weights.py;
  torch's modes (inference_mode, reentrant checkpoints): test_autograd_modes.py.

Spawning costs seconds, so one world of two ranks runs every case once (a
module-scoped fixture); each test reads the results it needs. Every rank reports
what it sees, and the tests compare all ranks, not rank 0 only.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

import zeromem
import zeromem.deepspeed as zeromem_deepspeed
from harness import run_distributed
from logs import ZeromemWarnings
from zeromem.param_states import MASTER
from models import TinyLM, micro_batch
from user_cases import PRECISIONS, SGD, STAGES, WORLD, batch, build, case, config, max_diff, mlp, \
    rounded, run_cases, tokens, train_step, whole_state


# ---------------------------------------------------------------- cases (run on every rank)

def seeded_differently(rank: int) -> dict:
    """Ranks build from different seeds; init state, eval output and trained params per rank."""
    out = {}
    for stage in STAGES:
        for precision in ("fp32", "bf16"):
            engine = zeromem.initialize(build(seed=1 + rank), config(stage, precision))
            init = whole_state(engine)
            engine.eval()  # evaluation before the first step, the modes switched on the engine
            # inference_mode (Lightning's validation): stage 3's gathers there make the
            # buffers the training steps then use
            with torch.inference_mode() if precision == "fp32" else torch.no_grad():
                evaluated = engine(batch(99, 0).to(engine.compute_dtype)).float()
            engine.train()
            for step in range(3):
                train_step(engine, step, rank)
            out[stage, precision] = {"init": init, "eval": evaluated, "trained": whole_state(engine)}
    return out


def storages_after_initialize(rank: int) -> dict:
    """Stage 3: elements of the live storages the module's parameters and the engine reach."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 5))
    numel = sum(p.numel() for p in model.parameters())
    engine = zeromem.initialize(model, config(3, "bf16"))

    def elements(tensors) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() // t.element_size()
                    for t in tensors if t is not None and t.untyped_storage().nbytes()}
        return sum(storages.values())

    params = list(engine.module.parameters())
    shards = [g.param_shard for g in engine.groups]
    return {"numel": numel, "param_elements": elements(params),
            "shard_elements": elements(shards), "all_elements": elements(params + shards),
            "states": sorted({u.state.value for u in engine.stage3.units}),
            "param_numels": sorted({p.numel() for p in params})}


def loads_into_module(rank: int) -> dict:
    """Load other weights into `engine.module`, then train one step; every stage and precision."""
    loaded = build(seed=7).state_dict()
    out = {}
    for stage in STAGES:
        for precision in PRECISIONS:
            engine = zeromem.initialize(build(seed=1), config(stage, precision, lr=1e-3))
            initial = engine.full_state_dict()  # masters before anything happens (rank 0)
            engine.module.load_state_dict(loaded)
            masters = engine.full_state_dict()
            seen = whole_state(engine)
            train_step(engine, 0, rank)
            out[stage, precision] = {"initial": initial, "masters": masters, "seen": seen,
                                     "trained": whole_state(engine)}
    try:  # assign=True would swap out the flat-buffer views: refused, not half done
        engine.module.load_state_dict(loaded, assign=True)
        out["assign"] = "accepted"
    except RuntimeError as error:
        out["assign"] = str(error)
    return out


def gathered_modifier(rank: int) -> dict:
    """Rank 0 edits one element inside GatheredParameters(modifier_rank=0), stages 0, 2, 3
    (at stages 0-2 the parameters are whole already: the edit must still reach the master)."""
    out = {}
    for stage in (0, 2, 3):
        for precision in ("bf16", "fp16"):
            engine = zeromem.initialize(build(seed=1), config(stage, precision))
            weight = engine.module.fc1.weight
            with zeromem.GatheredParameters(weight, modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        weight[0, 0] = 0.5
            out[stage, precision] = {  # each rank's own masters (stage 0: each holds them all)
                name: engine.param_states.full(p, MASTER)
                for name, p in engine.module.named_parameters()}
    return out


def drift_from_fp32(rank: int) -> dict:
    """L2(bf16 params - fp32 params) / L2(fp32 update) after 4 AdamW steps, per stage."""
    out = {}
    for stage in (0, 3):
        finals = {}
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            engine = zeromem.initialize(TinyLM(), {
                "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, **PRECISIONS[precision],
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage}})
            start = engine.full_state_dict()
            for step in range(4):
                tokens, targets = micro_batch(step, rank, 0)
                engine.backward(engine(tokens, targets))
                engine.step()
            finals[precision] = engine.full_state_dict()
        if rank == 0:
            keys = [k for k in start if k.endswith(("weight", "bias"))]
            flat = {p: torch.cat([finals[p][k].reshape(-1) for k in keys]) for p in finals}
            update = flat["fp32"] - torch.cat([start[k].reshape(-1) for k in keys])
            out[stage] = float((flat["bf16"] - flat["fp32"]).norm() / update.norm())
    return out


def evaluation_engines(rank: int) -> dict:
    """An engine given no optimizer (DeepSpeed's ZeRO-3 inference: HF's Trainer.evaluate()
    before training, DeepSpeed-Chat's reference model), beside a training engine in the same
    process, their calls interleaved; ranks seeded differently."""
    out = {}
    for precision in ("fp32", "bf16"):
        cfg = config(3, precision)
        del cfg["optimizer"]
        evaluator = zeromem.initialize(build(seed=1 + rank), cfg)
        # SGD: Adam would blow up fc1.bias's rounding noise (BatchNorm makes its gradient ~0)
        trainer = zeromem.initialize(build(seed=1 + rank), {**config(3, "fp32"), "optimizer": SGD})
        evaluator.module.eval()
        evaluated, held = [], []
        for step in range(2):
            with torch.no_grad():
                evaluated.append(evaluator(batch(50 + step, 0).to(evaluator.compute_dtype)).float())
            held.append(sum(p.numel() for p in evaluator.module.parameters()))
            train_step(trainer, step, rank)
        # an AdamW trainer's checkpoint loads into the evaluator as it is (weights only)
        adam = zeromem.initialize(build(seed=1 + rank), config(3, "fp32"))
        train_step(adam, 0, rank)
        path = [tempfile.mkdtemp() if rank == 0 else None]
        torch.distributed.broadcast_object_list(path)
        adam.save_checkpoint(path[0])
        evaluator.load_checkpoint(path[0])
        adam.module.eval()
        with torch.no_grad():
            x = batch(60, 0)
            loaded = [evaluator(x.to(evaluator.compute_dtype)).float(), adam(x).float()]
        refused = []
        x = batch(0, rank).to(evaluator.compute_dtype)
        for call in (lambda: evaluator.backward(evaluator(x).float().sum()),
                     evaluator.step):
            try:
                call()
                refused.append("accepted")
            except RuntimeError as error:
                refused.append(str(error))
        out[precision] = {"evaluated": evaluated, "held": held, "refused": refused, "loaded": loaded,
                          "trained": whole_state(trainer)}
    return out


def initialize_twice(rank: int) -> dict:
    """A second engine on a model a stage-3 engine partitioned: refused, naming a parameter
    (it failed deep inside with "shape '[2, -1]' is invalid for input of size 23")."""
    model = build(seed=1)
    zeromem.initialize(model, config(3, "fp32"))
    try:
        zeromem.initialize(model, config(3, "fp32"))
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": ""}


def embedder(sparse: bool) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Embedding(13, 5, sparse=sparse), nn.Tanh(), nn.Linear(5, 1))


def sparse_embedding(rank: int) -> dict:
    """nn.Embedding(sparse=True): a sparse gradient in each bucket (it failed with "reshape
    is not implemented for sparse tensors" at every stage)."""
    out = {}
    for stage in STAGES:
        model = embedder(sparse=True)
        engine = zeromem.initialize(model, {
            "train_batch_size": 8, "zero_optimization": {
                "stage": stage, "stage3_param_persistence_threshold": 0}},
            optimizer=lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9))
        for step in range(3):
            engine.backward(engine(tokens(step)[rank * 4:rank * 4 + 4]).pow(2).mean())
            engine.step()
        out[stage] = whole_state(engine)
    return out


# torch's optimizers beyond Adam and SGD, built by the user over the module (DeepSpeed's
# client optimizer): each updates an element from its own gradient and state only
CLIENT_OPTIMIZERS = {
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.1),
}


def param_groups(model: nn.Module) -> list[dict]:
    """HF's split: the weights in one group with an lr of their own, the biases in another."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")],
             "lr": 3e-2}, {"params": [p for n, p in model.named_parameters() if n.endswith("bias")]}]


def client_optimizers(rank: int) -> dict:
    """deepspeed.initialize(optimizer=torch.optim.X(model.parameters())): each elementwise
    optimizer trained 3 steps at stages 0, 2, 3; whole-parameter ones refused before the
    model is touched (Adafactor stepped flat shards, silently wrong; Muon and LBFGS failed
    inside torch)."""
    out: dict = {}
    for name, make in CLIENT_OPTIMIZERS.items():
        for stage in (0, 2, 3):
            model = mlp()
            engine, *_ = zeromem_deepspeed.initialize(
                model=model, optimizer=make(param_groups(model)), config=config(stage, "fp32"))
            for step in range(3):
                engine.backward(engine(batch(step, rank)).pow(2).mean())
                engine.step()
            out[name, stage] = whole_state(engine.engine)  # the zeromem engine inside
            # zeromem's own initialize takes it too, and an FSDP2 loop: the caller's
            # backward on the engine's output, the engine's step (the optimizer's refuses)
            model = mlp()
            client = make(param_groups(model))
            native = zeromem.initialize(model, config(stage, "fp32"), optimizer=client)
            for step in range(3):
                native(batch(step, rank)).pow(2).mean().backward()
                native.step()
            out[name, stage, "native"] = whole_state(native)
            try:
                client.step()
                out[name, stage, "client step"] = "accepted"
            except RuntimeError as error:
                out[name, stage, "client step"] = str(error)
    for name, make in {"Adafactor": torch.optim.Adafactor, "LBFGS": torch.optim.LBFGS,
                       "Muon": torch.optim.Muon}.items():
        model = mlp()
        matrices = [p for p in model.parameters() if p.ndim == 2]  # Muon takes nothing else
        try:
            zeromem_deepspeed.initialize(model=model, optimizer=make(matrices), config=config(3, "fp32"))
            out[name] = "accepted"
        except NotImplementedError as error:
            out[name] = {"error": str(error), "numels": [p.numel() for p in model.parameters()]}
    return out


def model_in_16_bits(rank: int) -> dict:
    """A model loaded in bf16 (fp16) with a config that turns on neither block (HF's
    `torch_dtype=torch.bfloat16` without `--bf16`): it was cast to fp32, twice the memory,
    and 16-bit inputs failed ("mat1 and mat2 must have the same dtype"). Per stage and
    dtype: its trained state and output dtype, and those of an engine given the block."""
    out = {}
    for stage in STAGES:
        for dtype, block in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            runs = []
            for cfg in (config(stage, "fp32"), {**config(stage, "fp32"), block: {"enabled": True}}):
                engine = zeromem.initialize(mlp().to(dtype), {**cfg, "optimizer": SGD})
                for step in range(2):
                    y = engine(batch(step, rank).to(dtype))
                    engine.backward(y.float().pow(2).mean())
                    engine.step()
                runs.append({"state": whole_state(engine), "output": str(y.dtype)})
            out[stage, block] = runs
        frozen = zeromem.initialize(mlp().to(torch.bfloat16).requires_grad_(False),
                                    config(stage, "fp32") | {"optimizer": None})
        with torch.no_grad():  # a frozen teacher in bf16 (no optimizer): its dtype kept too
            out[stage, "frozen"] = str(frozen(batch(0, rank).to(torch.bfloat16)).dtype)
    return out


SCHEDULE_FREE_RUNS = {"stage 0": (0, "fp32", {}), "stage 2": (2, "fp32", {}),
                      "stage 3": (3, "fp32", {}), "stage 3 bf16": (3, "bf16", {}),
                      "stage 2 cpu": (2, "fp32", {"offload_optimizer": {"device": "cpu"}})}


def schedule_free(rank: int) -> dict:
    """HF's Trainer with `--optim schedule_free_adamw`: Accelerate calls the optimizer's
    train() before training and eval() before evaluating. zeromem's had neither: the first
    step failed ("not in train mode"), and an evaluation ran at the training point y, not
    the average x (DeepSpeed 0.19.8 moves its masters only). Per run: the weights after 3
    steps, in eval mode, and after one more step in train mode."""
    import schedulefree

    out = {}
    for name, (stage, precision, offload) in SCHEDULE_FREE_RUNS.items():
        model = mlp()
        cfg = config(stage, precision)
        cfg["zero_optimization"].update(offload)
        engine, optimizer, *_ = zeromem_deepspeed.initialize(
            model=model, config={k: v for k, v in cfg.items() if k != "optimizer"},
            optimizer=schedulefree.AdamWScheduleFree(model.parameters(), lr=5e-2, warmup_steps=2))
        states = []
        for phase, steps in (("train", 3), ("eval", 0), ("train", 1)):
            getattr(optimizer, phase)()
            for step in range(steps):
                x = batch(step, rank).to(engine.engine.compute_dtype)
                engine.backward(engine(x).float().pow(2).mean())
                engine.step()
            states.append(whole_state(engine.engine))
        out[name] = states
    return out


def stage3_state_dict(rank: int) -> dict:
    """`engine.module.state_dict()` at stage 3 holds empty shards, as in DeepSpeed: saved, it
    would not be the model. Warned once; not inside GatheredParameters (whole there), and
    not by the engine's own checkpoint, which reads the module's keys."""
    out = {}
    with tempfile.TemporaryDirectory() as own:
        path = [own]
        torch.distributed.broadcast_object_list(path)  # rank 0's: a checkpoint is one directory
        engine = zeromem.initialize(mlp(), config(3, "fp32"))
        with ZeromemWarnings() as warned:
            engine.save_checkpoint(path[0])
            out["checkpoint"] = list(warned)
            params = list(engine.module.parameters())
            with zeromem.GatheredParameters(params):
                out["gathered"] = [tuple(v.shape) for v in engine.module.state_dict().values()]
            out["gathered warned"] = list(warned)
            out["sharded"] = [tuple(v.shape) for v in engine.module.state_dict().values()]
            engine.module.state_dict()
            out["warned"] = list(warned)
    return out


CASES = {"seeded": seeded_differently, "storages": storages_after_initialize,
         "loads": loads_into_module, "modifier": gathered_modifier, "drift": drift_from_fp32,
         "evaluators": evaluation_engines, "twice": initialize_twice,
         "sparse": sparse_embedding, "client_optimizers": client_optimizers,
         "16 bits": model_in_16_bits, "schedule_free": schedule_free,
         "stage3 state_dict": stage3_state_dict}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(run_cases, WORLD, CASES)


# ---------------------------------------------------------------- item 1: broadcast

def test_initialize_gives_every_rank_rank0_parameters_and_buffers(ranks):
    per_rank = case(ranks, "seeded")
    for stage, precision in per_rank[0]:
        expected = rounded(build(seed=1).state_dict(), precision)  # rank 0 built from seed 1
        for r, result in enumerate(per_rank):
            diff = max_diff(result[stage, precision]["init"], expected)
            assert diff == 0.0, f"stage {stage} {precision}: rank {r} differs by {diff}"


def test_evaluation_before_the_first_step_matches_rank0_model_on_every_rank(ranks):
    per_rank = case(ranks, "seeded")
    for stage, precision in per_rank[0]:
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        with torch.no_grad():
            expected = build(seed=1).eval().to(dtype)(batch(99, 0).to(dtype)).float()
        for r, result in enumerate(per_rank):
            got = result[stage, precision]["eval"]
            assert torch.allclose(got, expected, atol=1e-6 if dtype == torch.float32 else 2e-2), \
                f"stage {stage} {precision}: rank {r} evaluates another model"


def test_differently_seeded_ranks_keep_identical_parameters_while_training(ranks):
    per_rank = case(ranks, "seeded")
    for key in per_rank[0]:
        trained = [result[key]["trained"] for result in per_rank]
        params = [k for k in trained[0] if k.endswith(("weight", "bias"))]
        for r in range(1, WORLD):
            assert max_diff(trained[r], trained[0], params) == 0.0, f"{key}: rank {r} diverged"


# ---------------------------------------------------------------- item 3: stage-3 memory

def test_stage3_holds_only_shards_right_after_initialize(ranks):
    for r, held in enumerate(case(ranks, "storages")):
        assert held["states"] == ["sharded"]
        assert held["param_numels"] == [0], f"rank {r}: parameters still view whole buffers"
        assert held["param_elements"] == 0, f"rank {r}: {held['param_elements']} elements"
        # this rank's shards (1/N_d plus padding) are all that is held
        assert held["all_elements"] == held["shard_elements"] <= held["numel"] // WORLD + 16


# ---------------------------------------------------------------- an engine given no optimizer

def test_an_engine_given_no_optimizer_evaluates_sharded_beside_a_training_engine(ranks):
    reference = build(seed=1)  # rank 0's model, which initialize gives every rank
    opt = torch.optim.SGD(reference.parameters(), **SGD["params"])
    for step in range(2):
        for rank in range(WORLD):
            (reference(batch(step, rank)).pow(2).mean() / WORLD).backward()
        opt.step()
        opt.zero_grad()
    trained = {k: v.detach() for k, v in reference.named_parameters()}
    expected = rounded(build(seed=1).state_dict(), "fp32")
    for r, result in enumerate(case(ranks, "evaluators")):
        for precision, got in result.items():
            dtype = torch.float32 if precision == "fp32" else torch.bfloat16
            model = build(seed=1).eval().to(dtype)
            for step, output in enumerate(got["evaluated"]):
                with torch.no_grad():
                    want = model(batch(50 + step, 0).to(dtype)).float()
                assert torch.allclose(output, want, atol=1e-6 if precision == "fp32" else 2e-2), \
                    f"{precision}: rank {r} evaluates another model at step {step}"
            assert got["held"] == [0, 0], f"{precision}: rank {r} keeps whole parameters"
            # rank 0's AdamW trainer: its BatchNorm statistics are the ones checkpointed
            trainer_sees = case(ranks, "evaluators")[0][precision]["loaded"][1]
            assert torch.allclose(got["loaded"][0], trainer_sees, atol=1e-6 if precision == "fp32"
                                  else 2e-2), f"{precision}: rank {r} did not load the weights"
            for message in got["refused"]:
                assert "given no optimizer" in message and "evaluates only" in message, message
            assert max_diff(got["trained"], trained, list(trained)) < 1e-5, \
                f"{precision}: rank {r}'s training engine is off its reference"
        assert max_diff(result["fp32"]["trained"], expected, list(trained)) > 1e-3  # it trained


# ---------------------------------------------------------------- items 4 and 7: masters

def test_masters_start_from_the_users_fp32_values(ranks):
    original = build(seed=1).state_dict()
    params = [k for k in original if k.endswith(("weight", "bias"))]
    for key, result in case(ranks, "loads")[0].items():
        if key == "assign":
            continue
        stage, precision = key
        assert max_diff(result["initial"], original, params) == 0.0, f"stage {stage} {precision}"


def test_weights_loaded_into_the_module_reach_the_masters_at_full_precision(ranks):
    loaded = build(seed=7).state_dict()
    params = [k for k in loaded if k.endswith(("weight", "bias"))]
    results = dict(case(ranks, "loads")[0])
    assert "load without assign" in results.pop("assign")
    for (stage, precision), result in results.items():
        assert max_diff(result["masters"], loaded, params) == 0.0, f"stage {stage} {precision}"


def test_weights_loaded_into_the_module_are_used_and_trained_on_every_rank(ranks):
    loaded = build(seed=7).state_dict()
    reference = build(seed=7)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for rank in range(WORLD):  # the global batch: each rank's micro-batch, averaged
        (reference(batch(0, rank)).pow(2).mean() / WORLD).backward()
    opt.step()
    stepped = {k: v.detach() for k, v in reference.named_parameters()}
    per_rank = case(ranks, "loads")
    for key in [k for k in per_rank[0] if k != "assign"]:
        tol = 1e-4 if key[1] == "fp32" else 1e-2
        for r, result in enumerate(per_rank):
            assert max_diff(result[key]["seen"], rounded(loaded, key[1]), list(stepped)) == 0.0, \
                f"{key}: rank {r} does not compute with the loaded weights"
            diff = max_diff(result[key]["trained"], stepped, list(stepped))
            assert diff < tol, f"{key}: rank {r} is {diff} from one step on the loaded weights"


def test_gathered_parameters_modifier_keeps_the_masters_low_bits(ranks):
    original = build(seed=1).state_dict()
    for rank, per_rank in enumerate(case(ranks, "modifier")):
        for (stage, precision), full in per_rank.items():
            expected = dict(original)
            expected["fc1.weight"] = original["fc1.weight"].clone()
            expected["fc1.weight"][0, 0] = 0.5
            params = [k for k in original if k.endswith(("weight", "bias"))]
            assert max_diff(full, expected, params) == 0.0, (rank, stage, precision)


def test_bf16_drifts_from_fp32_no_more_than_its_own_rounding(ranks):
    for stage, drift in case(ranks, "drift")[0].items():
        assert drift < 0.1, f"stage {stage}: bf16 is {drift:.3f} update-norms from fp32"


def test_a_second_engine_on_a_partitioned_model_is_refused_by_name(ranks):
    for rank, got in enumerate(case(ranks, "twice")):
        assert "'fc1.weight' is partitioned by a stage-3 engine" in got["error"], (rank, got)


def test_sparse_embedding_gradients_train_like_dense_ones_in_one_process(ranks):
    model = embedder(sparse=False)  # the same gradients, dense: SGD with momentum takes them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        model(tokens(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    want = model.state_dict()
    for rank, got in enumerate(case(ranks, "sparse")):
        for stage, state in got.items():
            assert max_diff(state, want) < 1e-6, (rank, stage)


def test_torchs_elementwise_client_optimizers_match_one_process_on_every_rank(ranks):
    got = case(ranks, "client_optimizers")
    for name, make in CLIENT_OPTIMIZERS.items():
        model = mlp()
        optimizer = make(param_groups(model))
        for step in range(3):  # the global batch: both ranks' micro-batches
            model(torch.cat([batch(step, 0), batch(step, 1)])).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        want = model.state_dict()
        assert max_diff(want, mlp().state_dict()) > 1e-3, name  # it trained
        for rank, per_rank in enumerate(got):
            for stage in (0, 2, 3):
                assert max_diff(per_rank[name, stage], want) < 1e-6, (name, rank, stage)
                assert max_diff(per_rank[name, stage, "native"], want) < 1e-6, (name, rank, stage)
                assert "call engine.step()" in per_rank[name, stage, "client step"], (name, rank)


def test_whole_parameter_client_optimizers_are_refused_before_the_model_is_touched(ranks):
    numels = [p.numel() for p in mlp().parameters()]
    for rank, per_rank in enumerate(case(ranks, "client_optimizers")):
        for name, said in (("Adafactor", "row and column means"), ("LBFGS", "closure"),
                           ("Muon", "orthogonalises")):
            assert said in per_rank[name]["error"], (rank, name, per_rank[name])
            assert per_rank[name]["numels"] == numels, (rank, name)  # not partitioned


def test_a_model_loaded_in_16_bits_trains_in_them_as_with_the_block(ranks):
    for rank, got in enumerate(case(ranks, "16 bits")):
        for stage in STAGES:
            assert got.pop((stage, "frozen")) == "torch.bfloat16", (rank, stage)
        for (stage, block), (inferred, given) in got.items():
            assert inferred["output"] == given["output"] != "torch.float32", (rank, stage, block)
            assert max_diff(inferred["state"], given["state"]) == 0, (rank, stage, block)


def test_a_schedule_free_optimizer_switches_modes_as_in_one_process(ranks):
    import schedulefree

    model = mlp()
    optimizer = schedulefree.AdamWScheduleFree(model.parameters(), lr=5e-2, warmup_steps=2)
    want = []
    for phase, steps in (("train", 3), ("eval", 0), ("train", 1)):
        getattr(optimizer, phase)()
        for step in range(steps):
            model(torch.cat([batch(step, 0), batch(step, 1)])).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        want.append({k: v.clone() for k, v in model.state_dict().items()})
    assert max_diff(want[0], want[1]) > 1e-3  # eval mode moved the weights
    for rank, got in enumerate(case(ranks, "schedule_free")):
        for name, (stage, precision, _) in SCHEDULE_FREE_RUNS.items():
            tol = 3e-3 if precision == "bf16" else 1e-6  # (bf16: below the x - y gap, 5e-3)
            for phase, state, expected in zip(("trained", "eval", "train again"), got[name], want):
                assert max_diff(state, expected) < tol, (rank, name, phase)


def test_a_stage3_state_dict_of_empty_shards_is_warned_about_once(ranks):
    whole = [tuple(v.shape) for v in mlp().state_dict().values()]
    for rank, got in enumerate(case(ranks, "stage3 state_dict")):
        assert got["checkpoint"] == [] and got["gathered warned"] == [], rank
        assert got["gathered"] == whole and all(0 in shape for shape in got["sharded"]), rank
        assert len(got["warned"]) == 1 and "GatheredParameters" in got["warned"][0], got["warned"]
