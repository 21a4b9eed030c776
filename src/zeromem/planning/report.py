"""Turn saved run ledgers into a plot and a markdown table (`zeromem report`).

A run ledger is the JSON `examples/train.py` saves:

    {"config", "stage", "world_size", "steps", "final_loss",
     "memory": [one `MemoryReport.to_dict()` per rank], "comm": {...}}

`load_ledgers` accepts one ledger file, a file holding a list of ledgers, several
files, or a directory of them. `write_report` draws, for each run, rank 0's bytes
per category measured beside the paper's formula for that run (stacked bars,
stages side by side) and writes the same numbers as a markdown table.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from zeromem.memory import CATEGORIES

MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")
_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "master_params": "#55A868",
           "optimizer_states": "#C44E52", "comm_buffers": "#8172B3",
           "activation_checkpoints": "#937860"}


def _is_ledger(data: object) -> bool:
    return isinstance(data, dict) and "memory" in data and "stage" in data


def load_ledgers(paths: str | Path | Iterable[str | Path]) -> list[dict]:
    """Every ledger in `paths` (files, lists of ledgers, directories), sorted by stage and N_d."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    ledgers: list[dict] = []
    for path in map(Path, paths):
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        for file in files:
            data = json.loads(file.read_text(encoding="utf-8"))
            found = [d for d in (data if isinstance(data, list) else [data]) if _is_ledger(d)]
            if not found and not path.is_dir():
                raise ValueError(f"{file}: not a run ledger (needs 'stage' and 'memory' keys)")
            ledgers += [{**d, "_source": file.name} for d in found]
    if not ledgers:
        raise ValueError(f"no run ledgers found in {', '.join(map(str, paths))}")
    return sorted(ledgers, key=lambda d: (d["stage"], d["world_size"], d["_source"]))


def _label(ledger: dict) -> str:
    return f"stage {ledger['stage']}, N_d={ledger['world_size']}"


def _measured(rank_memory: dict) -> dict[str, float]:
    """Bytes per category summed over places (device, host, nvme)."""
    return {c: float(sum(rank_memory["held"].get(c, {}).values())) for c in CATEGORIES}


def _scale(ledgers: list[dict]) -> tuple[float, str]:
    peak = max(sum(_measured(d["memory"][0]).values()) for d in ledgers)
    return (1e9, "GB") if peak >= 1e9 else (1e6, "MB") if peak >= 1e6 else (1e3, "KB")


def plot_memory(ledgers: list[dict], path: Path) -> Path:
    """Stacked bars per run: rank 0's measured bytes (solid) beside the formula (hatched)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale, unit = _scale(ledgers)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(ledgers) + 2), 4.5))
    labelled: set[str] = set()
    for i, ledger in enumerate(ledgers):
        rank0 = ledger["memory"][0]
        bars = ((i - 0.2, _measured(rank0), None), (i + 0.2, rank0["formula"], "//"))
        for x, values, hatch in bars:
            bottom = 0.0
            for c in CATEGORIES:
                height = values.get(c, 0.0) / scale
                if height:
                    label = None if c in labelled else c
                    labelled.add(c)
                    ax.bar(x, height, 0.38, bottom=bottom, color=_COLORS[c], hatch=hatch,
                           edgecolor="white", label=label)
                    bottom += height
    ax.set_xticks(range(len(ledgers)),
                  [f"{_label(d)}\nmeasured | formula" for d in ledgers], fontsize=8)
    ax.set_ylabel(f"{unit} per rank (rank 0)")
    ax.set_title("zeromem: bytes held per category, measured beside the ZeRO formula")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def memory_table(ledgers: list[dict]) -> str:
    """Markdown: per run and category, rank 0's measured bytes, the formula, and their ratio."""
    scale, unit = _scale(ledgers)
    rows = [f"| run | category | measured {unit} | formula {unit} | measured / formula |",
            "|---|---|---:|---:|---:|"]
    for ledger in ledgers:
        rank0 = ledger["memory"][0]
        measured, formula = _measured(rank0), rank0["formula"]
        for c in CATEGORIES:
            if not measured[c] and c not in formula:
                continue
            f = formula.get(c)
            rows.append(f"| {_label(ledger)} | {c} | {measured[c] / scale:.3f} | "
                        + (f"{f / scale:.3f} | {measured[c] / f:.3f} |" if f else "- | - |"))
        held = sum(measured[c] for c in MODEL_STATES)
        total_formula = sum(formula.values())
        rows.append(f"| {_label(ledger)} | **model states** | **{held / scale:.3f}** | "
                    f"**{total_formula / scale:.3f}** | **{held / total_formula:.3f}** |")
    return "\n".join(rows)


def _rank_spread(ledger: dict) -> str:
    held = [r["model_state_bytes"] for r in ledger["memory"]]
    return f"{min(held) / max(held):.4f}" if max(held) else "-"


def summary_table(ledgers: list[dict]) -> str:
    """Markdown: one row per run with loss, steps, ranks' agreement and bytes moved per step."""
    rows = ["| run | source | steps | final loss | Ψ | min/max model states over ranks "
            "| bytes moved by rank 0, last step |", "|---|---|---:|---:|---:|---:|---|"]
    for d in ledgers:
        moved = d.get("comm", {}).get("last_step", {})
        comm = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(moved.items())) or "-"
        loss = d.get("final_loss")
        rows.append(f"| {_label(d)} | {d['_source']} | {d.get('steps', '-')} | "
                    f"{loss if loss is None else f'{loss:.4f}'} | {d['memory'][0]['psi']:,} | "
                    f"{_rank_spread(d)} | {comm} |")
    return "\n".join(rows)


def write_report(ledgers: list[dict], out_dir: str | Path) -> tuple[Path | None, Path]:
    """Write `memory.md` (and `memory.png` when matplotlib, the `plots` extra, is installed)
    into `out_dir`; return their paths (None for a plot not drawn)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        png: Path | None = plot_memory(ledgers, out / "memory.png")
    except ImportError:  # training never needs matplotlib: pip install 'zeromem[plots]'
        png = None
    picture = f"![memory per category]({png.name})\n\n" if png else ""
    md = out / "memory.md"
    md.write_text("# zeromem memory report\n\nRank 0's bytes held per category beside the ZeRO "
                  "paper's formula for the same Ψ, N_d and byte widths.\n\n"
                  f"{picture}{memory_table(ledgers)}\n\n"
                  f"## Runs\n\n{summary_table(ledgers)}\n", encoding="utf-8")
    return png, md
