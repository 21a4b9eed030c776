"""Every stored mutant still applies: its `old` text occurs exactly once in its file, and
the tests it names exist. An edit that changes a mutated line leaves the mutant unable to
apply, and `make mutants` (an hour and more) was the only place that said so."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
MUTANTS = sorted((ROOT / "tests" / "mutants").glob("*.json"))


@pytest.mark.parametrize("path", MUTANTS, ids=lambda p: p.name)
def test_every_stored_mutant_applies_once_and_names_tests_that_exist(path):
    for mutant in json.loads(path.read_text()):
        name = mutant["name"]
        count = (ROOT / mutant["file"]).read_text().count(mutant["old"])
        assert count == 1, f"{path.name}: {name}: its old text occurs {count} times in {mutant['file']}"
        for test in mutant["tests"]:
            assert (ROOT / test.split("::")[0]).exists(), f"{path.name}: {name}: no {test}"
