"""The estimator against the paper's tables, the planner's recommendations, the CLI and reports
(no process group; the planner against real runs is in tests/distributed/test_planner.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest
from torch import nn

import zeromem
from zeromem.cli import main
from zeromem.memory import model_state_formula
from zeromem.planning.estimate import deepspeed_estimate, max_params, parse_bytes, parse_count
from zeromem.planning.shape_memory import (ModelShape, Widths, ZeroLayout, activation_memory,
                                           exact_model_states, paper_activation_bytes)
from zeromem.planning.planner import (Hardware, Setup, Workload, estimate, load_model,
                                      model_flops, plan, shape_of)
from zeromem.planning.report import load_ledgers, write_report

GB = 1e9

# ---------------------------------------------------------------- paper Table 1 and Table 2

# ZeRO paper Table 1: GB per device for stages 1, 2, 3 (P_os, P_os+g, P_os+g+p); stage 0 = DP 1 row.
TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
            64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128),
            64: (536, 284, 32), 256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000),
           64: (4187, 2218, 250), 256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}


def _table_1_cells():
    for psi, rows in TABLE_1.items():
        for dp, cells in rows.items():
            for stage, expected in zip((1, 2, 3), cells):
                yield psi, dp, stage, expected


@pytest.mark.parametrize("psi,dp,stage,expected", list(_table_1_cells()))
def test_estimate_reproduces_table_1(psi, dp, stage, expected):
    result = estimate(psi, dp)
    # The paper truncates (4187.5 -> 4187) and rounds (0.117 -> 0.12): 0.5 %, or the last digit.
    assert result.device_bytes[stage] / GB == pytest.approx(expected, rel=5e-3, abs=5e-3)
    assert result.device_bytes[0] / GB == pytest.approx(16 * psi / GB)


def test_estimate_figure_1_and_the_fits_flags():
    result = estimate("7.5B", 64, gpu_mem="32GB")
    assert [round(b / GB, 2) for b in result.device_bytes.values()] == [120, 31.41, 16.64, 1.88]
    assert result.fits == {0: False, 1: True, 2: True, 3: True}
    # Table 1's bold cells: the lowest stage that fits a 32 GB V100.
    assert estimate(7.5e9, 4, gpu_mem="32GB").fits == {0: False, 1: False, 2: False, 3: True}
    assert estimate(7.5e9, 16, gpu_mem="32GB").fits[2] is True
    assert estimate(7.5e9, 16, gpu_mem="32GB").fits[1] is False
    assert estimate(128e9, 64, gpu_mem="32GB").fits == {0: False, 1: False, 2: False, 3: True}
    assert estimate(1e12, 1024, gpu_mem="32GB").fits[3] is True


# Table 2: largest model (billions) per stage on 32 GB GPUs, N_d = 64 and MP in 1..16.
# The paper rounds 7.64B to 7.6B before scaling by MP, and writes 512B as 0.5T (T = 1024B here).
TABLE_2 = {1: (2, 7.6, 14.4, 128), 2: (4, 15.2, 28.8, 256), 4: (8, 30.4, 57.6, 512),
           8: (16, 60.8, 115.2, 1024), 16: (32, 121.6, 230.4, 2048)}


@pytest.mark.parametrize("mp", TABLE_2)
def test_max_model_size_reproduces_table_2(mp):
    for stage, expected in enumerate(TABLE_2[mp]):
        assert max_params(32 * GB, 64, stage, mp=mp) / GB == pytest.approx(expected, rel=6e-3)
    assert estimate(7.5e9, 64, gpu_mem=32 * GB, mp=mp).max_params()[3] == pytest.approx(128e9 * mp)


def test_offload_moves_optimizer_states_and_stage_3_params():
    psi, n = 7.5e9, 64
    result = estimate(psi, n, offload="cpu", offload_param="nvme")
    s1, s3 = result.stages[1], result.stages[3]
    assert s1.host_bytes == pytest.approx(12 * psi / n)
    assert s1.device_bytes == pytest.approx(4 * psi)
    assert "parameter offload needs stage 3" in s1.note
    assert (s3.host_bytes, s3.nvme_bytes) == pytest.approx((12 * psi / n, 2 * psi / n))
    assert s3.device_bytes == pytest.approx(2 * psi / n)  # only the gradient shard stays
    assert result.stages[0].host_bytes == 0 and "stage >= 1" in result.stages[0].note
    nvme = estimate(psi, n, offload="nvme").stages[2]
    assert (nvme.host_bytes, nvme.nvme_bytes) == pytest.approx((0, 12 * psi / n))


def test_deepspeed_estimator_reproduces_its_t5_3b_example():
    gib, psi, largest = 2 ** 30, 2.8516e9, 32_899_072  # t5-3b: 2851M params, 32M largest layer
    cases = {(3, True, True): (0.12, 71.7), (3, True, False): (0.79, 63.7),
             (2, True, False): (5.31, 127.5)}
    for (stage, opt, param), (gpu, cpu) in cases.items():
        ds = deepspeed_estimate(psi, largest, stage, 8, 1, opt, param)
        assert round(ds.gpu_bytes / gib, 2) == gpu
        assert ds.cpu_bytes / gib == pytest.approx(cpu, rel=5e-3)
    assert deepspeed_estimate(psi, largest, 3, 8).gpu_bytes / gib == pytest.approx(6.10, abs=5e-3)
    assert deepspeed_estimate(psi, largest, 2, 8).gpu_bytes / gib == pytest.approx(11.28, abs=1e-2)


def test_deepspeeds_estimator_functions_print_its_figures(capsys):
    """`estimate_zero3_model_states_mem_needs_all_live(model, ...)`, as HF's DeepSpeed guide
    runs it (and the cold and stage-2 forms): DeepSpeed's figures for every option row,
    parameters counted once where shared and whole where Init partitioned them."""
    from zeromem.deepspeed import estimators
    net = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.Linear(64, 1000))
    net[2].weight = net[0].weight  # tied: counted once
    total, largest = estimators.model_to_params(net)
    assert (total, largest) == (1000 * 64 + 64 * 64 + 64 + 1000, 1000 * 64 + 1000)
    net[1].weight.data = net[1].weight.data.new_empty(0)  # as partitioned under Init,
    net[1].weight.ds_numel = 64 * 64                       # which records the whole size
    assert estimators.model_to_params(net) == (total, largest)
    estimators.estimate_zero3_model_states_mem_needs_all_live(net, num_gpus_per_node=8)
    printed = capsys.readouterr().out.splitlines()
    rows = [line for line in printed if "offload_param=" in line]
    assert len(rows) == 6
    want = deepspeed_estimate(total, largest, 3, 8, 1, True, False, True)
    assert f"{want.gpu_bytes / 2 ** 30:.4f} GiB" in rows[2]  # offload_optimizer only, zero_init
    assert "offload_param=none, offload_optimizer=cpu, zero_init=1" in rows[2]
    estimators.estimate_zero2_model_states_mem_needs_all_cold(2.8516e9, num_gpus_per_node=8)
    printed = capsys.readouterr().out
    assert "5.31 GiB | offload_optimizer=cpu" in printed  # DeepSpeed's t5-3b example


def test_parsers():
    assert parse_count("7.5B") == parse_count("7.5e9") == 7.5e9
    assert parse_count("350M") == 3.5e8 and parse_count("1T") == 1e12
    assert parse_bytes("32GB") == 32e9 and parse_bytes("80GiB") == 80 * 2 ** 30
    assert parse_bytes("16", "GiB") == 16 * 2 ** 30
    with pytest.raises(ValueError):
        parse_bytes("32 furlongs")


# ---------------------------------------------------------------- exact from shapes

def _shape(numels: tuple[int, ...], units: tuple[int, ...] | None = None) -> ModelShape:
    return ModelShape("toy", numels, 0, units or numels, layers=2, hidden=64, heads=4, vocab=100,
                      intermediate=256)


def test_exact_equals_the_formula_when_nothing_pads():
    shape, n = _shape((4096, 1024, 512, 8)), 4  # every bucket a multiple of N_d: no padding
    widths = Widths(scalars_per_group=0)
    for stage in range(4):
        layout = ZeroLayout(stage, reduce_bucket_numel=2048, persistence_threshold=0)
        exact = exact_model_states(shape, n, widths, layout)
        assert exact.device == pytest.approx(model_state_formula(shape.psi, n, stage))


def test_exact_counts_padding_buckets_persistence_and_frozen():
    shape = ModelShape("toy", (1001, 7, 30), 500, (1001, 37), 1, 8, 2, 10, 32)
    n, widths = 4, Widths()
    s1 = exact_model_states(shape, n, widths, ZeroLayout(1, reduce_bucket_numel=40))
    # buckets in reverse order: [30, 7] = 37 -> 40, [1001] -> 1004; 2 groups
    assert s1.groups == 2
    assert s1.device["params"] == 2 * (40 + 1004 + 500)  # frozen: whole below stage 3
    assert s1.device["master_params"] == 4 * 1044 / n
    assert s1.device["optimizer_states"] == 8 * 1044 / n + 4 * 2
    s3 = exact_model_states(shape, n, widths, ZeroLayout(3, persistence_threshold=100,
                                                         prefetch_numel=0))
    # the 37-element unit stays whole; the frozen parameters are one unit, sharded
    assert s3.device["params"] == 2 * (1044 / n + 40 + 500 / n)
    small = dataclasses.replace(shape, frozen_numel=50)  # under the threshold: whole too
    assert exact_model_states(small, n, widths, ZeroLayout(3, persistence_threshold=100)
                              ).device["params"] == 2 * (1044 / n + 40 + 52 / n + 52)
    assert s3.gathered_params == 2 * 1004  # the largest unit, no prefetch
    fp32 = exact_model_states(shape, n, Widths(4, 4, 0, 8, 4), ZeroLayout(0))
    assert fp32.device["master_params"] == 0  # the master aliases fp32 parameters


def test_shapes_from_a_hugging_face_config(tmp_path):
    model, cfg = load_model("examples/configs/gpt2-small.json")
    assert next(model.parameters()).is_meta
    shape = shape_of(model, cfg)
    assert shape.psi == 124_439_808  # GPT-2 small, tied head
    assert (shape.layers, shape.hidden, shape.heads, shape.vocab) == (12, 768, 12, 50257)
    assert shape.largest_unit == 50257 * 768
    llama = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
             "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
             "max_position_embeddings": 4096, "hidden_act": "silu"}
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(llama))
    assert shape_of(*load_model(str(path))).psi == 6_738_415_616  # Llama-2-7B


def test_shapes_from_a_factory_on_the_meta_device():
    model, cfg = load_model("examples/gpt.py:GPT")
    shape = shape_of(model, cfg)
    assert next(model.parameters()).is_meta
    assert shape.psi == sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.hidden, shape.heads, shape.positions) == (6, 256, 4, 128)


def test_activation_model():
    shape = _shape((10,))
    full = activation_memory(shape, micro_batch=2, seq=32)
    sbh = 32 * 2 * 64
    assert full.per_layer == sbh * (34 + 5 * 4 * 32 / 64)  # Korthikanti et al., t = 1
    ckpt = activation_memory(shape, 2, 32, checkpointing=True)
    assert ckpt.checkpoints == 2 * sbh * 2 and ckpt.device < full.device
    assert activation_memory(shape, 2, 32, checkpointing=True, cpu=True).host == ckpt.checkpoints
    assert activation_memory(shape, 2, 32, flash=True).per_layer == 34 * sbh
    # The paper's example: GPT-2 1.5B (48 layers, hidden 1600), seq 1K, batch 32 -> ~60 GB.
    assert paper_activation_bytes(1600, 32, 1024, 48) / GB == pytest.approx(60, rel=0.01)


# ---------------------------------------------------------------- recommendations

def test_plan_prefers_low_stages_and_offloads_last():
    shape = shape_of(*load_model("examples/configs/gpt2-small.json"))
    work = Workload(micro_batch=4, seq=512)
    roomy = plan(shape, Hardware(8, 16 * GB), work)
    assert roomy.chosen.setup == Setup(1)
    assert roomy.config["zero_optimization"]["stage"] == 1
    need = {c.setup: c.device_bytes for c in roomy.candidates}

    def chosen_with_room_for(setup: Setup, gpus: int = 8) -> Setup:
        """What the planner picks when the GPU is just big enough for `setup`."""
        return plan(shape, Hardware(gpus, need[setup] / 0.9 * 1.001), work).chosen.setup

    # Each step down the preference order only when the previous one cannot fit.
    assert need[Setup(2)] > need[Setup(1, "gpu")]
    assert chosen_with_room_for(Setup(1, "gpu")) == Setup(1, "gpu")
    assert need[Setup(2, "gpu")] > need[Setup(3, "gpu")]
    assert chosen_with_room_for(Setup(3, "gpu")) == Setup(3, "gpu")
    assert chosen_with_room_for(Setup(3, "gpu", "cpu")) == Setup(3, "gpu", "cpu")
    config = plan(shape, Hardware(8, need[Setup(3, "gpu", "cpu")] / 0.9 * 1.001), work).config
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["activation_checkpointing"]["partition_activations"] is False
    hopeless = plan(shape, Hardware(8, 0.05 * GB), work)
    assert not hopeless.chosen.fits and "nothing fits" in str(hopeless)


# ---------------------------------------------------------------- command line and report

def test_cli_estimate(capsys):
    assert main(["estimate", "--params", "7.5e9", "--dp", "64", "--gpu-mem", "32GB"]) == 0
    out = capsys.readouterr().out
    for figure in ("120.00", "31.41", "16.64", "1.88", "128B"):
        assert figure in out
    assert main(["estimate", "--params", "7.5B", "--dp", "64", "--units", "GiB",
                 "--offload", "nvme", "--largest-layer", "1e8"]) == 0
    assert "nvme GiB" in capsys.readouterr().out
    assert main(["estimate", "--params", "lots", "--dp", "2"]) == 2


def test_cli_plan_writes_a_valid_config(capsys, tmp_path):
    out = tmp_path / "config.json"
    assert main(["plan", "examples/configs/gpt2-small.json", "--gpus", "8", "--gpu-mem", "16GB",
                 "--micro-batch", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommended: stage 1" in text and str(out) in text
    config = json.loads(out.read_text())
    assert zeromem.Config.load(config, world_size=8).zero_optimization.stage == 1


def _ledger(stage: int, n: int, psi: int = 1_000_000) -> dict:
    formula = model_state_formula(psi, n, stage)
    held = {c: {"device": int(b * 1.01)} for c, b in formula.items()}
    memory = {"held": held, "formula": formula, "psi": psi, "n_d": n, "stage": stage,
              "comm_buffer_peak": 0, "model_state_bytes": sum(h["device"] for h in held.values()),
              "formula_bytes": sum(formula.values()), "notes": []}
    return {"config": f"stage{stage}.json", "stage": stage, "world_size": n, "steps": 3,
            "final_loss": 2.5, "memory": [memory] * n,
            "comm": {"last_step": {"all_reduce": 4 * psi}, "total": {}, "steps": 3}}


def test_report_writes_a_png_and_a_table(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    for stage in (0, 1, 2):
        (runs / f"stage{stage}.json").write_text(json.dumps(_ledger(stage, 2)))
    (runs / "notes.json").write_text("{}")  # not a ledger: skipped inside a directory
    assert len(load_ledgers(runs)) == 3
    assert main(["report", str(runs), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    png, md = tmp_path / "out" / "memory.png", tmp_path / "out" / "memory.md"
    assert str(png) in printed and str(md) in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = md.read_text()
    assert "| stage 2, N_d=2 | **model states** |" in table and "1.010" in table
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([_ledger(1, 4), _ledger(2, 4)]))
    png, _ = write_report(load_ledgers(listed), tmp_path / "list")
    assert png.exists()


def test_a_mixture_of_experts_config_is_counted_whole_and_computes_with_its_top_k(tmp_path):
    """A config JSON is planned from the model transformers builds from it: the dense
    stand-in counted one MLP a layer, so Mixtral 8x7B came out as 7.24B parameters (46.7B).
    Compute counts the experts a token passes through: its top-k (2 of 8)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=100, hidden_size=16, intermediate_size=24,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2)
    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps({**config.to_dict(), "model_type": "mixtral"}))
    model, cfg = load_model(str(path))
    shape = shape_of(model, cfg)
    real = transformers.MixtralForCausalLM(config)
    assert shape.psi == sum(p.numel() for p in real.parameters())
    experts = sum(p.numel() for n, p in real.named_parameters() if ".experts." in n)
    assert experts == 2 * 8 * 3 * 16 * 24  # layers x experts x (gate, up, down) x h x inner
    assert shape.active_numel == shape.psi - experts * 6 // 8
    work = Workload(micro_batch=1, seq=8)
    assert model_flops(shape, work) == (6 * shape.active_numel + 12 * 2 * 16 * 8) * 8
    assert "of them active a token" in str(plan(shape, Hardware(2, 80 * GB), work))


def test_a_config_the_stand_in_cannot_count_is_refused_by_its_key(tmp_path):
    """Without a transformers model for its model_type, an expert or encoder-decoder config
    would be planned as a dense decoder: refused, naming the key."""
    dense = {"model_type": "not-a-model", "num_hidden_layers": 2, "hidden_size": 16,
             "num_attention_heads": 4, "vocab_size": 100}
    for extra, key in (({"num_local_experts": 8}, "num_local_experts"),
                       ({"is_encoder_decoder": True}, "is_encoder_decoder")):
        path = tmp_path / "model.json"
        path.write_text(json.dumps({**dense, **extra}))
        with pytest.raises(ValueError, match=key):
            load_model(str(path))
    path.write_text(json.dumps(dense))
    assert type(load_model(str(path))[0]).__name__ == "ConfigGPT"  # a dense one is stood in for
