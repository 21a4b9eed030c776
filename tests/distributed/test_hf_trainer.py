"""Hugging Face Trainer and Accelerate on zeromem through `install_as_deepspeed()`.

Two torchrun worlds of 2 gloo ranks run `hf_trainer_script.py`: a plain DDP Trainer
(the reference) and the same Trainer with HF's own ds_config_zero2.json /
ds_config_zero3.json (their "auto" values filled by HF; zero3 also with both offloads
on NVMe), `resume_from_checkpoint`, `save_model`, stage 3's `from_pretrained` under
`zero.Init`, Trainer checkpoints real DeepSpeed saved, resumed, and an Accelerate loop
with a DeepSpeed plugin. A third world runs the
DeepSpeed configs fine-tuning frameworks ship (tests/data/ds_config_corpus). Every run
accumulates gradients over several micro-batches, as Trainer users do. Tiny GPT-2 from a
config; nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")
import config_corpus  # noqa: E402
from launch import torchrun  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

SCRIPT = Path(__file__).parent / "hf_trainer_script.py"
HF_DEEPSPEED = Path(__file__).parent.parent / "data" / "hf_deepspeed_checkpoints"
TOLERANCE = 1e-5  # fp32; the step order differs (flat shards vs per-parameter tensors)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict, dict]:
    """(output directory, DDP results, zeromem results): both worlds run once."""
    out = tmp_path_factory.mktemp("hf")
    torchrun(SCRIPT, "ddp", out, reference_outputs=(out / "ddp.json",))
    torchrun(SCRIPT, "zeromem", out)
    return out, json.loads((out / "ddp.json").read_text()), \
        json.loads((out / "zeromem.json").read_text())


@pytest.fixture(scope="module")
def frameworks(runs) -> dict:
    """{config: its run} for the fine-tuning frameworks' configs (a third torchrun world)."""
    torchrun(SCRIPT, "frameworks", runs[0])
    return json.loads((runs[0] / "frameworks.json").read_text())


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, (a.keys(), b.keys())
    return max(abs(a[k] - b[k]) for k in a)


@pytest.mark.parametrize("stage", ["zero2", "zero3", "zero3_nvme"])
def test_trainer_losses_equal_ddp_trainer(runs, stage):
    ddp, zero = runs[1]["losses"], runs[2]
    assert len(ddp) == 6
    assert _max_difference(zero[stage], ddp) < TOLERANCE
    # the pre-clip norm the Trainer logs (gradient_clipping "auto": max_grad_norm 1.0)
    assert _max_difference(zero["grad_norms"][stage], runs[1]["grad_norms"]) < TOLERANCE


@pytest.mark.parametrize("name", ["zero2", "zero3_hf_optimizer", "zero1_hf_schedule",
                                  "zero0_hf_optimizer"])
def test_resume_from_a_checkpoint_deepspeed_itself_saved(runs, name):
    """A Trainer checkpoint-3 saved by real DeepSpeed 0.19.8 (tests/data/hf_deepspeed_checkpoints,
    `hf_trainer_script.py deepspeed`), resumed by the same Trainer on zeromem, as a user
    switching would: steps 4-6 give DeepSpeed's own losses, gradient norms and lrs. HF's
    ds_config_zero2.json (DeepSpeed's AdamW, offloaded to its CPU Adam, which saves its
    betas as a list) and ds_config_zero3.json without an optimizer block (HF's AdamW, which
    Accelerate swaps for DeepSpeed's CPU Adam, and HF's schedule) and ds_config_zero2.json
    at stage 1 without its scheduler block (HF's schedule over DeepSpeed's AdamW) were each
    refused until stop 52, on an option that differed from the engine's; at stage 0
    (DeepSpeed's default; HF's AdamW, whose states are numbered by position over its two
    param groups) as not a ZeRO checkpoint."""
    expected = json.loads((HF_DEEPSPEED / name / "expected.json").read_text())
    got = runs[2]["from_deepspeed"][name]
    for key in ("losses", "grad_norms", "lrs"):
        after = {step: value for step, value in expected[key].items() if int(step) > 3}
        if key == "grad_norms" and not after:  # DeepSpeed's stage 0 reports none to HF
            assert len(got[key]) == 3  # zeromem's does, at every stage
            continue
        assert got[key].keys() >= after.keys() and len(after) == 3, key
        assert _max_difference({s: got[key][s] for s in after}, after) < TOLERANCE, key


def test_peft_lora_checkpoint_deepspeed_saved_without_its_frozen_base_resumes(runs):
    """PEFT LoRA on GPT-2 at ZeRO-3, checkpoint-3 saved by real DeepSpeed
    (tests/data/hf_deepspeed_checkpoints/zero3_lora). HF saves PEFT runs with
    exclude_frozen_parameters: the frozen base is left out, its tied embedding too, but
    DeepSpeed keeps the tied lm_head's key, naming the embedding it dropped. Refused as
    damaged until stop 52; resumed, steps 4-6 are DeepSpeed's own."""
    expected = json.loads((HF_DEEPSPEED / "zero3_lora" / "expected.json").read_text())
    got = runs[2]["lora_from_deepspeed"]
    for key in ("losses", "grad_norms"):
        after = {step: value for step, value in expected[key].items() if int(step) > 3}
        assert len(after) == 3 and _max_difference({s: got[key][s] for s in after}, after) \
            < TOLERANCE, key


def test_accelerate_load_state_of_a_state_deepspeed_saved(runs):
    """An Accelerate loop's `save_state` under real DeepSpeed (stage 2, the script's AdamW
    and linear schedule; tests/data/hf_deepspeed_checkpoints/accelerate), `load_state` on
    zeromem: the micro-batches after it give DeepSpeed's losses."""
    expected = json.loads((HF_DEEPSPEED / "accelerate" / "expected.json").read_text())
    got = runs[2]["accelerate_from_deepspeed"]
    assert len(got) == len(expected["losses"]) == 6
    assert max(abs(a - b) for a, b in zip(got, expected["losses"])) < TOLERANCE


def test_hf_optimizer_and_schedule_built_before_initialize(runs):
    """A config without optimizer and scheduler: HF's AdamW (two param groups) and linear
    schedule, made before `initialize` and swapped by Accelerate for DeepSpeedCPUAdam,
    train as the DDP Trainer with the same: losses, gradient norms, and the lr of every step."""
    ddp, zero = runs[1]["hf_optimizer"], runs[2]["hf_optimizer"]
    assert sorted(set(ddp["lrs"].values())) == [0.0, 0.0025, 0.005, 0.0075, 0.01]  # it moved
    assert zero["lrs"] == ddp["lrs"]
    for key in ("losses", "grad_norms"):
        assert _max_difference(zero[key], ddp[key]) < TOLERANCE, key


def test_schedule_free_adamw_trains_and_evaluates_as_the_ddp_trainer(runs):
    """`--optim schedule_free_adamw` on HF's zero3 config (optimizer on the host, with
    `zero_force_ds_cpu_optimizer: false`): the losses, and the evaluation at the
    optimizer's average after training."""
    ddp, zero = runs[1]["schedule_free"], runs[2]["schedule_free"]
    assert len(ddp["losses"]) == 6
    assert _max_difference(zero["losses"], ddp["losses"]) < TOLERANCE
    assert abs(zero["eval_loss"] - ddp["eval_loss"]) < TOLERANCE


def test_load_best_model_at_end_reloads_the_best_checkpoint(runs):
    """`load_best_model_at_end` (evaluated and saved every 2 steps) on HF's zero3 config:
    when training ends HF loads the best checkpoint into the live engine; the evaluation
    after it is the best checkpoint's, as with the DDP Trainer, and not the last step's."""
    ddp, zero = runs[1]["best_model"], runs[2]["best_model"]
    assert ddp["best"] == zero["best"] == "checkpoint-2"
    assert _max_difference(zero["evaluated"], ddp["evaluated"]) < TOLERANCE
    assert abs(zero["eval_loss"] - ddp["evaluated"]["2"]) < TOLERANCE
    assert abs(ddp["evaluated"]["2"] - ddp["evaluated"]["6"]) > 100 * TOLERANCE  # it reloaded


def test_resume_from_checkpoint_continues_the_run(runs):
    ddp, zero = runs[1]["losses"], runs[2]
    resumed = {k: v for k, v in zero["zero2_resumed"].items() if int(k) > 3}  # steps 4-6 re-run
    assert len(resumed) == 3
    assert _max_difference(resumed, {k: ddp[k] for k in resumed}) < TOLERANCE


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_save_model_then_from_pretrained_gives_the_trained_weights(runs, stage):
    out = runs[0]
    model, info = transformers.GPT2LMHeadModel.from_pretrained(out / f"{stage}_model",
                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # no `module.` keys
    trained = torch.load(out / f"{stage}_trained.pt")
    start = transformers.GPT2LMHeadModel.from_pretrained(out / "init").state_dict()
    loaded = model.state_dict()
    assert trained.keys() == loaded.keys()
    for key, value in trained.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    assert any(not torch.equal(start[k], trained[k]) for k in trained)  # training moved them


def test_stage3_from_pretrained_builds_under_init(runs):
    """HF's `is_deepspeed_zero3_enabled` path: `from_pretrained` opened `zero.Init`, so each
    rank held only its partitions (none whole), and the loaded values trained as DDP's."""
    ddp, zero = runs[1]["losses"], runs[2]
    assert zero["zero3_held"] < zero["zero2_held"] / 2
    assert abs(zero["zero3"]["1"] - ddp["1"]) < TOLERANCE  # the first loss: loaded weights


def test_evaluate_before_any_training_runs_zero3_without_an_optimizer(runs):
    """HF's `Trainer.evaluate()` with no training before builds the engine with the config's
    optimizer removed; it evaluates the loaded weights as the DDP Trainer does."""
    assert abs(runs[2]["zero3_eval_loss"] - runs[1]["eval_loss"]) < TOLERANCE


def test_peft_lora_on_a_model_built_under_init(runs):
    """PEFT sizes its adapters from `ds_shape` on a partitioned parameter: zeromem's Init
    gave none until stop 34, and `get_peft_model` failed on GPT-2's Conv1D layers."""
    out, ddp, zero = runs
    for key in ("loss", "grad_norm"):
        assert len(ddp["lora"][key]) == 6
        assert _max_difference(zero["lora"][key], ddp["lora"][key]) < TOLERANCE, key
    want = load_file(out / "ddp_lora_adapter" / "adapter_model.safetensors")
    got = load_file(out / "zero3_lora_adapter" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and len(got) == 12  # A and B of 6 layers
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)


def test_peft_lora_resumes_from_its_checkpoint(runs):
    """The LoRA run saves a checkpoint at step 3 and a second run resumes from it. GPT-2's
    embedding and head are one frozen tensor: before stop 51 the checkpoint was written and
    then refused as damaged. Steps 4-6 re-run as the uninterrupted run took them, and the
    adapters end the same."""
    out, ddp, zero = runs
    logged = zero["lora_resumed"]["loss"]  # steps 1-3 from the checkpoint's trainer state
    resumed = {k: v for k, v in logged.items() if int(k) > 3}
    assert len(resumed) == 3
    assert _max_difference(resumed, {k: ddp["lora"]["loss"][k] for k in resumed}) < TOLERANCE
    want = load_file(out / "zero3_lora_adapter" / "adapter_model.safetensors")
    got = load_file(out / "zero3_lora_resumed_adapter" / "adapter_model.safetensors")
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)


def test_trl_generation_under_zero3_matches_one_process(runs):
    """TRL's `unwrap_model_for_generation` reaches DeepSpeed's hook owner through
    `engine.optimizer.parameter_offload`; without it (before stop 34) it raised
    AttributeError. TRL's `prepare_deepspeed` builds the frozen reference model from a config
    with dotted top-level keys, which zeromem refused until stop 34 (DeepSpeed ignores
    them). Each step's generated ids (greedy, both ranks), the mean loss trained on them
    and the reference model's loss equal one process's."""
    pytest.importorskip("trl")
    zero = runs[2]
    assert len(zero["trl"]) == 3
    for got, want in zip(zero["trl"], zero["trl_reference"]):
        assert got[0] == want[0]  # generated ids
        assert abs(got[1] - want[1]) < TOLERANCE  # the trained model's loss
        assert abs(got[2] - want[2]) < TOLERANCE  # the frozen reference model's


def test_trl_grpo_trainer_matches_ddp(runs):
    """GRPOTrainer under HF's zero3 config: its reference model is built by TRL before the
    Trainer fills the config's hidden-size "auto" values, which zeromem refused until stop
    34 (it now reads the hidden size from the model, as HF's Trainer does). Every step's
    loss, gradient norm, reward and KL equal the DDP GRPOTrainer's (its schedule: lr 0 for
    two steps, as DeepSpeed's WarmupLR with no warmup steps gives, then the KL moves)."""
    pytest.importorskip("trl")
    ddp, zero = runs[1]["grpo"], runs[2]["grpo"]
    assert len(ddp) == 4 and ddp[-1]["kl"] > 0
    for got, want in zip(zero, ddp):
        for key in ("loss", "grad_norm", "reward", "kl"):
            assert abs(got[key] - want[key]) < TOLERANCE, (key, got, want)


def test_padded_labels_average_over_tokens_as_ddp(runs):
    """Labels padded to different lengths: the Trainer averages the loss over the tokens of
    every rank and micro-batch (num_items_in_batch); zero3's losses and gradient norms
    equal DDP's."""
    ddp, zero = runs[1]["ragged"], runs[2]["ragged"]
    for key in ("losses", "grad_norms"):
        assert len(ddp[key]) == 6
        assert _max_difference(zero[key], ddp[key]) < TOLERANCE, key


def test_resize_token_embeddings_under_zero3_trains_as_ddp(runs):
    """`model.resize_token_embeddings` after `from_pretrained` under ZeRO-3 (SFT scripts
    adding special tokens): HF gathers the sharded embedding, builds the new one under
    `zero.Init`, copies the old rows and draws the new ones on rank 0 (GatheredParameters
    with modifier_rank 0); the tied head follows. Trained on the new tokens too, losses and
    gradient norms equal the DDP Trainer's."""
    ddp, zero = runs[1]["resized"], runs[2]["resized"]
    for key in ("losses", "grad_norms"):
        assert len(ddp[key]) == 6
        assert _max_difference(zero[key], ddp[key]) < TOLERANCE, key


def test_torch_compile_under_zero3_matches_ddp(runs):
    """`TrainingArguments(torch_compile=True)` makes Accelerate call DeepSpeed's
    `engine.compile(backend=, compile_kwargs=)`, which zeromem's engine lacked until stop
    34 (nn.Module.compile refused `compile_kwargs`). The model is compiled in place and
    trains as the compiled DDP Trainer does."""
    ddp, zero = runs[1], runs[2]
    assert zero["compiled_in_place"]
    assert _max_difference(zero["compiled"], ddp["compiled"]) < TOLERANCE


def test_seq2seq_trainer_predicts_with_generate_under_zero3_as_ddp(runs):
    ddp, zero = runs[1]["seq2seq"], runs[2]["seq2seq"]
    assert len(ddp["losses"]) == 6
    assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) < TOLERANCE
    assert zero["predicted"] == ddp["predicted"]  # greedy token ids, every sequence
    assert abs(zero["loss"] - ddp["loss"]) < TOLERANCE


def test_accelerate_multiple_deepspeed_plugins_train_each_model_as_alone(runs):
    """Accelerate's multiple-model API (a dict of DeepSpeed plugins, selected in turn): a
    student under ZeRO-2 with a frozen ZeRO-3 model in its loss trains as the same model
    under ZeRO-2 alone does (the frozen term carries no gradient), and the frozen model
    computes with its own weight; two models trained side by side, under ZeRO-2 and ZeRO-3
    with their own optimizers and schedules, take the same steps, the mark of two engines
    that share nothing."""
    got = runs[2]["accelerate_two_models"]
    assert len(got["zero2"]) == 6  # the script's STEPS
    assert _max_difference(dict(enumerate(got["zero2"])), dict(enumerate(got["zero3"]))) < TOLERANCE
    assert _max_difference(dict(enumerate(got["student"])), dict(enumerate(got["zero2"]))) < TOLERANCE
    assert all(abs(ratio - 0.1) < 1e-6 for ratio in got["frozen_term"]), got["frozen_term"]
    assert got["zero2"][-1] < got["zero2"][0]


def test_accelerate_deepspeed_plugin_matches_one_process(runs):
    zero = runs[2]
    assert len(zero["accelerate"]) == 12  # 6 steps of 2 micro-batches
    for got, want in zip(zero["accelerate"], zero["single_process"]):
        assert abs(got - want) < TOLERANCE


def test_install_answers_where_hf_looks_for_deepspeed(runs):
    assert runs[2]["deepspeed"] == {"version": "0.16.0+zeromem", "available": True,
                                    "engine": True}


def test_install_after_hf_decided_is_refused(runs):
    """Installed after transformers chose its DeepSpeed glue, HF would wrap zeromem's engine
    without recognising it (and save `module.` keys that load as random weights)."""
    assert "transformers.integrations.deepspeed" in runs[1]["late_install"]


# bf16 (Axolotl's configs that turn it on themselves) against the fp32 DDP Trainer: DeepSpeed
# 0.19.8 on the same runs is 1.5e-4 from it (losses) and 4.8e-4 (gradient norms, relative)
BF16_LOSS, BF16_NORM = 2e-3, 1e-2


def test_fine_tuning_frameworks_configs_train_as_the_ddp_trainer(runs, frameworks):
    """The DeepSpeed configs Axolotl, LLaMA-Factory, LLaVA, ms-swift, FastChat and InternVL
    ship (every one that loads), each through HF's Trainer as their users run it, train as
    the DDP Trainer with the same optimizer and schedule: HF's AdamW and schedule where the
    config has no optimizer block, else the config's AdamW over all parameters. Axolotl's
    ZeRO-3 configs (`sub_group_size: 0`) were refused before stop 47.

    Where the engine steps the schedule (the config's optimizer), HF logs each step's lr
    after that step, as it does with DeepSpeed (measured with DeepSpeed 0.19.8): the next
    step's lr of the DDP Trainer."""
    expected = {str(p.relative_to(config_corpus.CORPUS)) for p in config_corpus.framework_files()}
    assert set(frameworks) == expected - set(config_corpus.FRAMEWORKS_NOT_LOADING)
    kinds = [run["kind"] for run in frameworks.values()]  # InternVL's and LLaVA's offload one
    assert (kinds.count("config_adamw"), kinds.count("config_adamw_warmup")) == (10, 1)
    for name, run in frameworks.items():
        ddp = runs[1]["hf_optimizer" if run["kind"] == "hf" else run["kind"]]
        config = json.loads((config_corpus.CORPUS / name).read_text())
        bf16 = config.get("bf16", {}).get("enabled") is True
        assert len(run["losses"]) == 6, name
        assert _max_difference(run["losses"], ddp["losses"]) < (BF16_LOSS if bf16 else TOLERANCE), name
        norms = max(abs(run["grad_norms"][k] / ddp["grad_norms"][k] - 1) for k in ddp["grad_norms"])
        assert norms < (BF16_NORM if bf16 else TOLERANCE), name
        got, want = ([r["lrs"][str(step)] for step in range(1, 7)] for r in (run, ddp))
        if run["kind"] != "hf":
            got, want = got[:-1], want[1:]  # the last is past the DDP run's end
        assert got == want, name
