"""Every real DeepSpeed config of tests/data/ds_config_corpus loads or is refused with a reason.

The classification is tests/config_corpus.py's (`python tests/config_corpus.py` prints it).
"other" is allowed only for the configs listed here, each with the reason it fails: none
of them is a config DeepSpeed itself would run as given.
"""
from __future__ import annotations

import re

import pytest

import config_corpus

# path -> the words of its error. Not DeepSpeed features zeromem leaves out, but configs
# that are wrong for DeepSpeed too, or filled by another program first.
EXPECTED_OTHER = {
    # a key that is not DeepSpeed's (DeepSpeed ignores it; zeromem has the opt-out)
    **{f"DeepSpeedExamples/training/imagenet/config/{name}.json": "'cuda_visible_devices'"
       for name in ("ds_config", "ds_fp16_config", "ds_fp16_z1_config")},
    # old HF configs: the Trainer fills bf16.enabled, not its "bfloat16" alias, so DeepSpeed
    # would get "auto" here too
    **{f"transformers/tests/deepspeed/ds_config_zero{n}_bf16.json": 'bfloat16.enabled is "auto"'
       for n in (2, 3)},
    # LLaMA-Factory's fp8 example: two top-level keys DeepSpeed does not have (and ignores)
    "LLaMA-Factory/examples/deepspeed/ds_z3_fp8_config.json": "unknown key 'comms_config'",
}
COUNTS = {"loads": 65, "refused": 48, "other": 6}  # of 119; README "Config compatibility"


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[str, str]]:
    return config_corpus.classify_corpus()


def test_the_corpus_is_all_there(results):
    assert len(results) == 119
    assert sum(name.startswith("DeepSpeedExamples/") for name in results) == 75
    assert len(config_corpus.framework_files()) == 36


def test_every_config_loads_or_is_refused_with_a_named_reason(results):
    unexpected = {}
    for name, (kind, detail) in results.items():
        if kind == "other":
            words = EXPECTED_OTHER.get(name)
            if words is None or words not in detail:
                unexpected[name] = detail
        elif kind == "refused":
            # "<dotted key>[ = value] is not supported[ (feature)]: <why>"
            assert re.match(r"^[a-z_0-9.]+( = .+)? is not supported( \(.+?\))?: \S", detail), detail
    assert not unexpected, unexpected


def test_the_counts(results):
    counts = {kind: sum(k == kind for k, _ in results.values()) for kind in COUNTS}
    assert counts == COUNTS


def test_hugging_face_configs_load_once_hf_filled_them(results):
    for name in ("transformers/tests/deepspeed/ds_config_zero2.json",
                 "transformers/tests/deepspeed/ds_config_zero3.json",
                 "accelerate/tests/deepspeed/ds_config_zero2.json",
                 "accelerate/tests/deepspeed/ds_config_zero3.json"):
        assert results[name] == ("loads", ""), (name, results[name])


def test_the_fine_tuning_frameworks_configs_load_once_hf_filled_them(results):
    """Axolotl's ZeRO-3 configs (`sub_group_size: 0`) were refused before stop 47."""
    for path in config_corpus.framework_files():
        name = str(path.relative_to(config_corpus.CORPUS))
        kind, detail = results[name]
        assert kind == config_corpus.FRAMEWORKS_NOT_LOADING.get(name, "loads"), (name, detail)


def test_every_file_is_named_in_the_readme():
    readme = (config_corpus.CORPUS / "README.md").read_text()
    for path in config_corpus.corpus_files():
        assert f"`{path.relative_to(config_corpus.CORPUS)}`" in readme, path
