"""The `zeromem` command line: one subcommand per entry of `COMMANDS`.

    zeromem estimate --params 7.5e9 --dp 64 --gpu-mem 32GB
    zeromem plan examples/configs/gpt2-small.json --gpus 8 --gpu-mem 16GB --out config.json
    zeromem report runs/ --out runs/report
    zeromem consolidate checkpoints/ model.safetensors
    zeromem consolidate checkpoints/ step-1000.pt --optimizer
    zeromem consolidate checkpoints/ hf_model/ --hf gpt2_config/
    zeromem import-deepspeed deepspeed_checkpoints/ checkpoints/
    zeromem launch --num_gpus 8 train.py --deepspeed ds_config.json
    zeromem accelerate-launch --config_file deepspeed_zero3.yaml train.py
    zeromem bench examples/gpt.py:GPT --config examples/configs/stage2.json

A subcommand is a `Command`: its help line, a function adding its arguments to
its parser, and a function running it (returning the exit status). Adding one is
one entry in `COMMANDS`; heavy imports (torch) happen inside the run functions,
so `zeromem --help` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


@dataclass(frozen=True)
class Command:
    """One subcommand: help line, argument declaration, and the function that runs it.

    `passthrough`: the command's arguments are another program's (`accelerate launch`'s),
    handed over as they are in `args.passthrough`, unparsed.
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    passthrough: bool = False


# ---------------------------------------------------------------- estimate

def _estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", required=True, help="parameter count Ψ: 7.5e9 or 7.5B")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel degree N_d")
    parser.add_argument("--k", type=int, default=12,
                        help="master weights + optimizer state bytes per parameter (12: Adam)")
    parser.add_argument("--mp", type=int, default=1, help="model-parallel degree (default 1)")
    parser.add_argument("--gpu-mem", help="memory per GPU, e.g. 32GB or 80GiB; adds 'fits'")
    parser.add_argument("--units", choices=("GB", "GiB"), default="GB",
                        help="GB = 1e9 bytes as in the paper (default), GiB = 2^30")
    parser.add_argument("--offload", choices=("cpu", "nvme"),
                        help="put master weights and optimizer states there (stages >= 1)")
    parser.add_argument("--offload-param", choices=("cpu", "nvme"),
                        help="put stage 3's parameter shards there too")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="for per-node host figures")
    parser.add_argument("--largest-layer", help="parameters of the largest layer: also print "
                                                "DeepSpeed's estimator for stages 2 and 3")


def _run_estimate(args: argparse.Namespace) -> int:
    from zeromem.planning.estimate import deepspeed_estimate, estimate, format_bytes, parse_count

    result = estimate(args.params, args.dp, k=args.k, gpu_mem=args.gpu_mem, units=args.units,
                      offload=args.offload, offload_param=args.offload_param, mp=args.mp,
                      gpus_per_node=args.gpus_per_node)
    print(result)
    if args.largest_layer:
        node = args.gpus_per_node
        nodes = max(1, args.dp * args.mp // node)
        print(f"DeepSpeed's estimator ({nodes} node(s) x {node} GPUs, 20 bytes per parameter, "
              f"host x1.5), in {args.units}:")
        for stage in (2, 3):
            ds = deepspeed_estimate(result.params / args.mp, parse_count(args.largest_layer), stage,
                                    node, nodes, args.offload is not None,
                                    stage == 3 and args.offload_param is not None)
            print(f"  stage {stage}: {format_bytes(ds.gpu_bytes, args.units)} per GPU, "
                  f"{format_bytes(ds.cpu_bytes, args.units)} host per node")
    return 0


# ---------------------------------------------------------------- plan

def _calibrated(args: argparse.Namespace, shape, hardware):
    """`hardware` with this machine's measured figures (`planning/calibrate.py`)."""
    import dataclasses
    import functools

    from zeromem.planning.calibrate import calibrate
    from zeromem.planning.model_shapes import build_real
    seq = args.seq or shape.positions or 1024
    calibration = calibrate(functools.partial(build_real, args.model), shape, args.micro_batch,
                            seq, args.gpus, args.nvme_path)
    return dataclasses.replace(hardware, calibration=calibration)


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="package.module:factory (built on the meta device) or a Hugging "
                             "Face-style config .json")
    parser.add_argument("--gpus", type=int, help="GPUs in all (default: nodes x gpus per node)")
    parser.add_argument("--gpu-mem", required=True, help="memory per GPU, e.g. 16GB or 80GiB")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs per node: also plan hybrid sharding and ZeRO++ (hpZ, qwZ, qgZ)")
    parser.add_argument("--intra", default="300GB/s",
                        help="bandwidth within a node, per GPU (default 300GB/s)")
    parser.add_argument("--inter", default="25GB/s",
                        help="bandwidth between nodes, per GPU (default 25GB/s)")
    parser.add_argument("--interconnect", type=float, default=25.0,
                        help="GB/s per GPU for data-parallel collectives (default 25)")
    parser.add_argument("--pcie", type=float, default=16.0, help="GB/s host<->GPU (default 16)")
    parser.add_argument("--nvme", type=float, default=3.5, help="GB/s per node (default 3.5)")
    parser.add_argument("--tflops", type=float, default=100.0,
                        help="achieved TFLOPS per GPU (default 100)")
    parser.add_argument("--host-mem", help="host memory per node, e.g. 512GB (checked for offload)")
    parser.add_argument("--seq", type=int, default=0, help="sequence length (default: the "
                                                           "model's context, else 1024)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-step")
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--mp", type=int, default=1, help="model-parallel degree")
    parser.add_argument("--flash", action="store_true",
                        help="fused attention: no seq x seq score matrices stored")
    parser.add_argument("--headroom", type=float, default=0.9,
                        help="usable share of GPU memory (default 0.9)")
    parser.add_argument("--units", choices=("GB", "GiB"), default="GB")
    for dim in ("layers", "hidden", "heads", "vocab"):
        parser.add_argument(f"--{dim}", type=int, help=f"override the model's {dim}")
    parser.add_argument("--out", help="write the recommended DeepSpeed-style config here")
    parser.add_argument("--json", action="store_true",
                        help='print {"setups": [...], "recommended": NAME} as JSON instead')
    parser.add_argument("--nvme-path", help="directory on a local NVMe disk for swap files "
                                            "(required when an NVMe setup is recommended)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine on --gpus spawned gloo ranks (the model's "
                             "forward and backward, collectives, copies, disk, optimizer step) "
                             "and predict step times from it instead of the assumed speeds")


def _cluster_plan(args: argparse.Namespace, result):
    """Hybrid sharding and ZeRO++ for --nodes x --gpus-per-node (planning/cluster.py)."""
    from zeromem.planning.cluster import Cluster, plan_cluster
    from zeromem.planning.estimate import parse_bytes
    if args.nodes * args.gpus_per_node != args.gpus:
        raise ValueError(f"--gpus {args.gpus} is not --nodes {args.nodes} x --gpus-per-node "
                         f"{args.gpus_per_node}")
    rate = lambda text: parse_bytes(text.removesuffix("/s"), "GB")  # noqa: E731
    cluster = Cluster(args.nodes, args.gpus_per_node, rate(args.intra), rate(args.inter),
                      parse_bytes(args.gpu_mem, args.units) * args.headroom)
    return plan_cluster(result.shape.psi, cluster, result.chosen.time.compute,
                        frozen=result.shape.frozen_numel)


def _run_plan(args: argparse.Namespace) -> int:
    from zeromem.planning.estimate import parse_bytes
    from zeromem.planning.model_shapes import ConfigGPT
    from zeromem.planning.plan_json import needs_nvme_path, plan_json
    from zeromem.planning.planner import Hardware, Workload, load_model, plan, shape_of

    if args.gpus is None:
        if args.gpus_per_node is None:
            raise ValueError("give --gpus, or --nodes and --gpus-per-node")
        args.gpus = args.nodes * args.gpus_per_node
    model, cfg = load_model(args.model)
    name = Path(args.model).stem if args.model.endswith(".json") else args.model
    shape = shape_of(model, cfg, name=name, layers=args.layers, hidden=args.hidden,
                     heads=args.heads, vocab=args.vocab)
    hardware = Hardware(args.gpus, parse_bytes(args.gpu_mem, args.units), args.nodes,
                        args.interconnect * 1e9, args.pcie * 1e9, args.nvme * 1e9, args.tflops,
                        parse_bytes(args.host_mem, args.units) if args.host_mem else None,
                        args.headroom)
    workload = Workload(args.micro_batch, args.seq, args.gas, args.dtype, args.mp, args.flash)
    if args.calibrate:
        hardware = _calibrated(args, shape, hardware)
    traced = None if isinstance(model, ConfigGPT) else model  # the stand-in has no forward
    result = plan(shape, hardware, workload, units=args.units, nvme_path=args.nvme_path,
                  traced=traced)
    if needs_nvme_path(result):
        print(result if not args.json else json.dumps(plan_json(result), indent=2))
        raise ValueError(f"the recommended setup ({result.chosen.setup.label()}) swaps to NVMe: "
                         "give --nvme-path DIR so that its config names a directory that exists")
    cluster = _cluster_plan(args, result) if args.gpus_per_node else None
    note = None
    if cluster is not None:  # the recommended hybrid / ZeRO++ keys go into the written config
        zero = result.config.setdefault("zero_optimization", {})
        keys, note = cluster.zero_keys(zero.get("stage", 0))
        zero.update(keys)
    if args.json:
        data = plan_json(result)
        if cluster is not None:
            data["cluster"] = dataclasses.asdict(cluster)
        print(json.dumps(data, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(result.config, indent=2) + "\n", encoding="utf-8")
        return 0
    print(result)
    if cluster is not None:
        print(f"\n{cluster}" + (f"\n  ({note})" if note else ""))
    text = json.dumps(result.config, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(f"\nconfig written to {args.out}")
    else:
        print(f"\nconfig:\n{text}")
    return 0


# ---------------------------------------------------------------- report

def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="run ledger JSON(s) saved by examples/train.py, or directories")
    parser.add_argument("--out", help="output directory (default: beside the first ledger)")


def _run_report(args: argparse.Namespace) -> int:
    from zeromem.planning.report import load_ledgers, write_report

    first = Path(args.runs[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent)
    png, md = write_report(load_ledgers(args.runs), out)
    print(f"plot:  {png or 'not drawn: pip install zeromem[plots] for matplotlib'}\ntable: {md}")
    return 0


# ---------------------------------------------------------------- dispatch

def _consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="directory given to save_checkpoint "
                                                             "(with --hf, a DeepSpeed one too)")
    parser.add_argument("out", metavar="OUT", help="output file: .safetensors, else torch.save; "
                                                   "with --hf, a new directory")
    parser.add_argument("--tag", help="checkpoint tag (default: the one `latest` names)")
    parser.add_argument("--hf", metavar="MODEL_CONFIG_DIR",
                        help="write OUT as a Hugging Face model directory (config.json + "
                             "safetensors) for the model of this config, loadable with "
                             "from_pretrained")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                        help="with --hf: dtype written (default: the config's dtype, else the "
                             "checkpoint's training dtype)")
    parser.add_argument("--max-shard-size", help="with --hf: largest safetensors file before "
                                                 "splitting, e.g. 5GB or 2GiB (default 5GB)")
    parser.add_argument("--optimizer", action="store_true",
                        help="write OUT with torch.save as {model, optimizer} in the layout of "
                             "torch's get_state_dict, for FSDP2's set_state_dict (README, "
                             "Coming from FSDP2)")


def _run_consolidate(args: argparse.Namespace) -> int:
    if args.hf and args.optimizer:
        raise ValueError("--optimizer writes one torch file for FSDP2; --hf a Hugging Face "
                         "model directory, which holds no optimizer state: choose one")
    if args.hf:
        from zeromem.checkpoints.hf_export import DEFAULT_MAX_SHARD_SIZE, export_hf
        print(export_hf(args.ckpt_dir, args.hf, args.out, tag=args.tag, dtype=args.dtype,
                        max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE))
        return 0
    if args.dtype or args.max_shard_size:
        raise ValueError("--dtype and --max-shard-size go with --hf MODEL_CONFIG_DIR")
    if args.optimizer:
        from zeromem.checkpoints.torch_export import export_torch_state
        print(export_torch_state(args.ckpt_dir, args.out, tag=args.tag))
        return 0
    from zeromem.checkpoints.consolidate import consolidate
    print(consolidate(args.ckpt_dir, args.out, tag=args.tag))
    return 0


def _import_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="directory DeepSpeed's save_checkpoint wrote "
                                                   "(or one of its tag directories)")
    parser.add_argument("dst", metavar="DST", help="zeromem checkpoint directory to write")
    parser.add_argument("--tag", help="DeepSpeed tag, a universal one (`ds_to_universal`) too "
                                      "(default: the one `latest` names, else `latest_universal`)")


def _run_import_deepspeed(args: argparse.Namespace) -> int:
    from zeromem.checkpoints.deepspeed_import import import_deepspeed
    print(import_deepspeed(args.src, args.dst, tag=args.tag))
    return 0


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    from zeromem.deepspeed.launcher import add_arguments
    add_arguments(parser)


def _run_launch(args: argparse.Namespace) -> int:
    from zeromem.deepspeed.launcher import run
    return run(args)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="package.module:factory, or a Hugging "
                        "Face-style config .json (built with transformers)")
    parser.add_argument("--config", required=True, help="the DeepSpeed JSON config to run")
    parser.add_argument("--nproc", type=int, default=2, help="ranks on this machine (default 2)")
    parser.add_argument("--systems", default="ddp,fsdp2,zeromem,deepspeed",
                        help="comma-separated: ddp, fsdp2, zeromem, deepspeed; zeromem-S and "
                             "deepspeed-S run ZeRO stage S (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="round-robin repetitions")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per trial")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per trial")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _run_bench(args: argparse.Namespace) -> int:
    from zeromem.config.schema import Config
    from zeromem.planning.bench import Bench, as_json, run, table

    config, _ = Config.read(args.config)
    bench = Bench(args.model, config, args.nproc, tuple(s for s in args.systems.split(",") if s),
                  args.reps, args.warmup, args.steps, args.seq)
    results = run(bench, echo=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(as_json(bench, results), indent=2) if args.json else table(bench, results))
    return 1 if any(r.error is not None for r in results.values()) else 0


def _run_accelerate_launch(args: argparse.Namespace) -> int:
    from zeromem.deepspeed.accelerate_launch import run
    return run(args.passthrough)


COMMANDS: dict[str, Command] = {
    "estimate": Command("per-device model-state memory by ZeRO stage (paper formulas)",
                        _estimate_arguments, _run_estimate),
    "plan": Command("recommend a ZeRO configuration for a model on given hardware",
                    _plan_arguments, _run_plan),
    "report": Command("plot and tabulate saved run ledgers: measured bytes beside the formula",
                      _report_arguments, _run_report),
    "consolidate": Command("write a checkpoint's full fp32 state dict, or with --hf a Hugging Face "
                           "model directory (no GPU, no process group)",
                           _consolidate_arguments, _run_consolidate),
    "import-deepspeed": Command("convert a DeepSpeed ZeRO checkpoint (stages 1-3, or universal) "
                                "into a zeromem one, loadable at any world size and stage",
                                _import_deepspeed_arguments, _run_import_deepspeed),
    "launch": Command("start a training script's ranks as DeepSpeed's `deepspeed` launcher does "
                      "(same flags, --local_rank=N, `import deepspeed` gives zeromem), on torchrun",
                      _launch_arguments, _run_launch),
    "bench": Command("one model's training step under zeromem beside DDP, FSDP2 and DeepSpeed "
                     "on this machine: step time, its ratio to DDP's, peak memory",
                     _bench_arguments, _run_bench),
    "accelerate-launch": Command("`accelerate launch` (its options and config file) with zeromem "
                                 "as its DeepSpeed", lambda parser: None, _run_accelerate_launch,
                                 passthrough=True),
}


def build_parser() -> argparse.ArgumentParser:
    """The `zeromem` parser with one subparser per entry of COMMANDS."""
    parser = argparse.ArgumentParser(prog="zeromem", description="ZeRO memory tools.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(subparsers.add_parser(name, help=command.help,
                                                    description=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zeromem` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS and COMMANDS[argv[0]].passthrough:
        args = argparse.Namespace(command=argv[0], passthrough=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args) or 0
    except (ValueError, OSError, RuntimeError) as error:  # bad input: one line, no traceback
        print(f"zeromem {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
