"""Rules of STYLE.md that a reader cannot see at one call site, checked on the source (no process).

- Distributed state is passed, never fetched: only the edges read the environment
  (`distributed.Runtime`, read once by `initialize`; the DeepSpeed-compatible API; the
  calibrator, which launches its own ranks).
- No process-wide mutable state: no `global`, no module-level instance of our classes
  except the named edges below, and no module-level or class-level container that code mutates.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import zeromem

SRC = Path(zeromem.__file__).parent  # the package imported (a mutated copy under tools/mutants.py)

# modules that may read os.environ, and why
ENVIRONMENT_EDGES = {
    "distributed.py": "Runtime and the process group: read once, by initialize",
    "planning/calibrate.py": "starts its own ranks (MASTER_ADDR, RANK, OMP_NUM_THREADS), as "
                             "`zeromem plan --calibrate` and `zeromem bench` ask",
    "deepspeed/comm.py": "DeepSpeed's API: get_local_rank()",
    "deepspeed/init.py": "DeepSpeed's init_distributed",
    "deepspeed/engine.py": "DeepSpeedEngine.local_rank, the loss log of the examples",
    "deepspeed/accelerator.py": "DeepSpeed's accelerator: device_count on CPU",
    "deepspeed/launcher.py": "DeepSpeed's launcher: CUDA_VISIBLE_DEVICES picks the slots",
    "deepspeed/launch_worker.py": "a launched rank: torchrun's variables in, DeepSpeed's out",
}
# module-level instances, and why each is one per process
PROCESS_WIDE = {
    ("distributed.py", "LIFECYCLE"): "interpreter exit and signals are per process",
    ("activations/recompute.py", "_DEFAULT"): "DeepSpeed's checkpointing.configure, at its edge",
    ("stage3/partitioned_init.py", "DEFAULT"): "zeromem.Init without an engine, at its edge",
}
MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem",
            "remove", "discard", "clear"}


@functools.lru_cache(maxsize=1)  # parsed once for every test here; nothing changes the trees
def modules() -> dict[str, ast.Module]:
    return {p.relative_to(SRC).as_posix(): ast.parse(p.read_text(), str(p))
            for p in sorted(SRC.rglob("*.py"))}


def reads_environment(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id == "os" and n.attr in ("environ", "getenv") for n in ast.walk(tree))


def test_only_the_edges_read_the_environment():
    readers = {name for name, tree in modules().items() if reads_environment(tree)}
    assert readers <= set(ENVIRONMENT_EDGES), (
        f"{sorted(readers - set(ENVIRONMENT_EDGES))} read os.environ: read it once in "
        "distributed.Runtime and pass the value in")


def test_no_global_statements():
    found = [f"{name}:{n.lineno}" for name, tree in modules().items() for n in ast.walk(tree)
             if isinstance(n, ast.Global)]
    assert not found, f"module state rebound through `global`: {found}"


def our_classes(all_modules: dict[str, ast.Module]) -> set[str]:
    return {n.name for tree in all_modules.values() for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef)}


def test_no_module_level_instances_but_the_process_wide_edges():
    all_modules = modules()
    classes = our_classes(all_modules)
    found = set()
    for name, tree in all_modules.items():
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call) \
                    and isinstance(node.value.func, ast.Name) and node.value.func.id in classes:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found |= {(name, t.id) for t in targets if isinstance(t, ast.Name)}
    assert found <= set(PROCESS_WIDE), (
        f"module-level instances {sorted(found - set(PROCESS_WIDE))}: shared by every engine "
        "in the process; let the object that uses one own it")


def containers(body: list[ast.stmt]) -> set[str]:
    """Names bound in `body` to a list, dict or set (a literal, a comprehension or a call)."""
    kinds = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    names = set()
    for node in body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        value = node.value
        call = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
            and value.func.id in ("list", "dict", "set", "defaultdict", "OrderedDict")
        if isinstance(value, kinds) or call:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def mutated(tree: ast.Module, names: set[str], owners: set[str]) -> set[str]:
    """Of `names`, those this module mutates: `X.append(..)`, `X[k] = ..`, `del X[k]`, or the
    same through one of `owners` (`self.X`, `cls.X`, `Class.X`)."""
    def named(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name) and not owners:
            return node.id
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in owners:
            return node.attr
        return None

    hits = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
            hits.add(named(n.func.value))
        elif isinstance(n, (ast.Assign, ast.AugAssign, ast.Delete)):
            for t in (n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]):
                if isinstance(t, ast.Subscript):
                    hits.add(named(t.value))
    return names & (hits - {None})  # type: ignore[operator]


# The one exception, and why: autograd's graph tasks belong to the process, and a backward
# one engine started may run through another engine's outputs (torch_backward.py).
SHARED_ALLOWED = {"torch_backward.py: ENGINE_TASKS"}


def test_no_shared_container_is_mutated():
    found = []
    for name, tree in modules().items():
        found += [f"{name}: {x}" for x in mutated(tree, containers(tree.body), set())]
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            # a class-level container is one object shared by every instance
            shared = containers(cls.body)
            found += [f"{name}: {cls.name}.{x}"
                      for x in mutated(tree, shared, {"self", "cls", cls.name})]
    found = sorted(set(found) - SHARED_ALLOWED)
    assert not found, f"module- or class-level containers mutated (process-wide state): {found}"


def imports_of(tree: ast.Module) -> set[str]:
    """Modules `tree` imports, type-only imports included."""
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            found |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
    return found


def test_nothing_below_the_engine_imports_it():
    """The parts the engine builds get what they use passed in: none reaches back into it."""
    importers = {name for name, tree in modules().items() if "zeromem.engine" in imports_of(tree)}
    assert importers <= {"__init__.py"}, f"{sorted(importers)} import zeromem.engine"


# the only importers of the ZeRO optimizer (zero_optimizer.py), and why
OPTIMIZER_IMPORTERS = {
    "engine.py": "builds it from the parts and drives backward and step",
}


def test_no_call_comes_back_to_the_optimizer():
    """The parts the optimizer steps over (flat groups and their gradient buffers, the
    reduction order, the stage-3 units and schedule, the offload placements) never reach
    it: a stage-3 unit fills its bucket and hands its reduce-scatter to its `Comm`,
    and the step reads the reduced shard from the group (issue 11's walk)."""
    importers = {name for name, tree in modules().items()
                 if "zeromem.zero_optimizer" in imports_of(tree)}
    assert importers <= set(OPTIMIZER_IMPORTERS), (
        f"{sorted(importers - set(OPTIMIZER_IMPORTERS))} import zeromem.zero_optimizer: pass "
        "what they need in (a Comm, a callback registered by the engine)")
    stage3 = {name for name, tree in modules().items() if name.startswith("stage3/")
              and {"zeromem.engine", "zeromem.zero_optimizer"} & imports_of(tree)}
    assert not stage3, f"{sorted(stage3)} reach back up from stage 3"


TESTS = Path(__file__).resolve().parents[1]


def test_unit_tests_start_no_process_group_and_tests_import_no_test_module():
    """tests/unit runs without a process group; tests share helpers (harness, models, setups,
    config_corpus), never each other."""
    for path in sorted(TESTS.rglob("test_*.py")):
        if "data" in path.relative_to(TESTS).parts:
            continue
        imported = imports_of(ast.parse(path.read_text(), str(path)))
        others = {m for m in imported if m.split(".")[0].startswith("test_")}
        assert not others, f"{path.name} imports test modules {sorted(others)}"
        if path.parent.name == "unit":
            spawning = imported & {"harness", "harness.run_distributed", "harness.run_together",
                                   "torch.distributed"}
            assert not spawning, f"unit/{path.name} uses {sorted(spawning)}: it belongs in distributed/"


# `Any` in a public signature, and why it stays: the value is unvalidated JSON or a user's
# object, or the module is an API edge (DeepSpeed's signatures) or is being reworked.
ANY_EDGES = {
    "deepspeed": "DeepSpeed's own signatures, which take and return anything",
    "config": "raw JSON before validation (pydantic `before` validators, key mapping)",
}
ANY_ALLOWED = {
    ("activations/recompute.py", "checkpoint"): "returns what the user's function returns",
    ("activations/recompute.py", "ActivationCheckpointing.checkpoint"): "the same",
    ("checkpoints/consolidate.py", "encode"): "JSON values",
    ("checkpoints/consolidate.py", "decode"): "JSON values",
    ("checkpoints/state.py", "scaler_state"): "JSON values",
    ("checkpoints/state.py", "scheduler_state"): "JSON values",
    ("checkpoints/hf_export.py", "output_dtype"): "a transformers config (an optional package)",
    ("checkpoints/deepspeed_pickles.py", "need"): "a value of an unpickled file: what DeepSpeed saved",
    ("offload/nvme_optimizer.py", "SwappedState.get"): "a dict's interface (torch's optimizer.state)",
}


def public_functions_with_bare_any() -> set[tuple[str, str]]:
    """(module, qualified name) of public functions with a parameter or result typed `Any`."""
    found = set()

    def bare(annotation: ast.expr | None) -> bool:
        return isinstance(annotation, ast.Name) and annotation.id == "Any"

    def visit(name: str, body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(name, node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef) and (node.name == "__init__"
                                                         or not node.name.startswith("_")):
                a = node.args
                annotations = [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs]
                if any(bare(x) for x in [*annotations, node.returns]):
                    found.add((name, prefix + node.name))

    for name, tree in modules().items():
        if not any(name == edge or name.startswith(edge + "/") for edge in ANY_EDGES):
            visit(name, tree.body, "")
    return found


def test_no_any_at_module_boundaries_but_the_named_ones():
    found = public_functions_with_bare_any()
    assert found <= set(ANY_ALLOWED), (
        f"public signatures typed Any: {sorted(found - set(ANY_ALLOWED))}; name the type "
        "(`object` for anything a caller may pass)")


# modules that assign an attribute of another package's module, and why
PATCHING = {
    "distributed.py": "sys.excepthook, chained to the previous hook: the process edge",
    "deepspeed/launch_worker.py": "sys.argv, as `python script args` sets it for the script "
                                  "this process then runs",
    "planning/activation_trace.py": "the planner's trace only, restored after: Hugging Face's mask "
                                    "checks answered as for the real run (issue 11: to replace)",
}


def assigns_imported_attributes(tree: ast.Module) -> bool:
    """Whether `tree` sets an attribute of a module it imports (`torch.x = ...`, setattr)."""
    aliases = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            aliases |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module \
                and not n.module.startswith("zeromem"):
            aliases |= {a.asname or a.name for a in n.names}

    def root(node: ast.expr) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, ast.Assign) else \
            [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Attribute) and root(t) in aliases for t in targets):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr" \
                and n.args and root(n.args[0]) in aliases:
            return True
    return False


def test_no_monkey_patching():
    patching = {name for name, tree in modules().items() if assigns_imported_attributes(tree)}
    assert patching <= set(PATCHING), f"{sorted(patching - set(PATCHING))} patch another package"


RUNTIME = {"torch", "pydantic", "safetensors", "numpy"}  # what training needs installed


def test_training_needs_only_the_runtime_dependencies():
    """Module-level imports are the standard library, zeromem and the runtime dependencies;
    optional packages (matplotlib for plots, transformers, tqdm, tensorboard, wandb) are
    imported where they are used, and the package metadata asks for nothing else."""
    import sys

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    third_party = set()
    for tree in modules().values():
        for node in tree.body:  # type-only imports sit under `if TYPE_CHECKING:`, not here
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 \
                and node.module else []
            third_party |= {n.split(".")[0] for n in names}
    third_party -= set(sys.stdlib_module_names) | {"zeromem", "pydantic_core"}
    assert third_party <= RUNTIME, f"imported at module level: {sorted(third_party - RUNTIME)}"
    project = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]
    required = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert required == RUNTIME, f"pyproject dependencies {sorted(required)}"


# modules that ask the default group for a rank or size (no group given), and why
DEFAULT_GROUP_READERS = {
    "__init__.py": "initialize: the world the node layout is built for",
    "distributed.py": "Runtime's global rank; the exit barrier",
    "comm.py": "Comm's own global rank (node layout, timeout diagnosis by the store's keys) "
               "and whether its group is the world (hybrid sharding, ZeRO++)",
    "tensor_parallel.py": "make_2d_groups lays the 2-D grid over every rank of the world",
}


def asks_default_group(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in ("get_rank", "get_world_size") and not n.args and not n.keywords
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "dist"
               for n in ast.walk(tree))


def test_no_rank_look_up_without_a_group_but_at_the_edges():
    readers = {name for name, tree in modules().items()
               if not name.startswith("deepspeed/") and asks_default_group(tree)}
    assert readers <= set(DEFAULT_GROUP_READERS), (
        f"{sorted(readers - set(DEFAULT_GROUP_READERS))} ask the default group: take the Comm "
        "(or Runtime) that is passed in")
    assert readers == set(DEFAULT_GROUP_READERS), (
        f"{sorted(set(DEFAULT_GROUP_READERS) - readers)} no longer ask: drop them from the allowlist")
