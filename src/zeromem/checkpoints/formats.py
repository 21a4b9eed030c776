"""Which checkpoint format a directory holds, and what a directory in no known format looks like.

`load_checkpoint` reads zeromem's own format (`<tag>/manifest.json`), one torch file of an
FSDP2 / DCP run (`torch_import`), and imports
DeepSpeed's ZeRO format (`<tag>/mp_rank_00_model_states.pt` or, at stage 3,
`<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt`, beside
`[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, or, in a universal checkpoint,
beside `zero/`; see `deepspeed_import`). A directory in neither gets an error listing
what it holds, so that a wrong path, a Hugging Face model directory or a consolidated
weights file is recognised at once.

DeepSpeed's `ds_to_universal` writes the universal checkpoint of tag T as a sibling
tag (T_universal) and names it in `latest_universal`, leaving `latest` as it was;
DeepSpeed reads `latest_universal` where the config sets `checkpoint.load_universal`.
zeromem does the same, and reads the other pointer where the one asked for is absent.
"""
from __future__ import annotations

import os
from pathlib import Path

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
DEEPSPEED_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def deepspeed_location(load_dir: str | os.PathLike, tag: str | None,
                       universal: bool = False) -> tuple[Path, str] | None:
    """(root, tag) of the DeepSpeed checkpoint at `load_dir`, or None if it holds none.

    `load_dir` is either the directory DeepSpeed saved into (tag from `tag` or its
    pointer file: `latest_universal` first if `universal`, else `latest`) or one tag's
    directory itself.
    """
    root = Path(load_dir)
    if _has_deepspeed_files(root) and tag is None:
        return root.parent, root.name
    if tag is None:
        tag = _pointed_tag(root, universal)
        if tag is None:
            return None
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        return None
    return (root, tag) if _has_deepspeed_files(root / tag) else None


def _pointed_tag(root: Path, universal: bool) -> str | None:
    """The tag `root`'s pointer file names: the one `universal` asks for, else the other."""
    names = (LATEST_UNIVERSAL, LATEST) if universal else (LATEST, LATEST_UNIVERSAL)
    for name in names:
        if (root / name).is_file():
            try:
                return (root / name).read_text().strip()
            except (OSError, UnicodeDecodeError):
                return None
    return None


def holds_pointer(root: Path) -> bool:
    """Whether `root` has a `latest` or `latest_universal` file (a checkpoint to resume)."""
    return any((root / name).is_file() for name in (LATEST, LATEST_UNIVERSAL))


def is_universal(path: Path) -> bool:
    """Whether the DeepSpeed tag directory `path` is a universal checkpoint (`zero/`)."""
    return (path / "zero" / "optimizer_state.pt").is_file()


def _has_deepspeed_files(path: Path) -> bool:
    return any((path / name).is_file() for name in DEEPSPEED_MODEL_STATES)


def describe_directory(load_dir: str | os.PathLike, limit: int = 8) -> str:
    """What `load_dir` looks like, for an error saying it is in no checkpoint format we read."""
    root = Path(load_dir)
    if not root.exists():
        return f"{root} does not exist"
    if root.is_file():
        return f"{root} is a file, not a checkpoint directory{_file_hint(root.name)}"
    entries = sorted(root.iterdir())
    names = [p.name + ("/" if p.is_dir() else "") for p in entries]
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit
                                        else "")
    found = f"it holds {shown}" if names else "it is empty"
    return (f"{root} is neither a zeromem checkpoint (latest + <tag>/manifest.json) nor a "
            f"DeepSpeed one (latest + <tag>/mp_rank_00_model_states.pt and "
            f"*_optim_states.pt): {found}{_directory_hint(names, root)}")


def _directory_hint(names: list[str], root: Path) -> str:
    if "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names):
        return ("; it looks like a Hugging Face model directory: load it with from_pretrained "
                "before zeromem.initialize")
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return ("; it looks like a torch.distributed.checkpoint (DCP) directory: "
                "engine.load_checkpoint reads it (README, Coming from FSDP2)")
    dcp = [n for n in names if n.endswith("/") and (root / n / ".metadata").is_file()]
    if dcp:
        return (f"; it holds DCP checkpoints ({', '.join(dcp[-3:])}): pass one of them, or its "
                "name as tag, to engine.load_checkpoint")
    if "zero/" in names:
        return ("; it looks like a DeepSpeed universal checkpoint without its model states "
                "file (mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt, "
                "which ds_to_universal copies beside zero/)")
    for name in names:
        hint = _file_hint(name)
        if hint:
            return hint
    return ""


def _file_hint(name: str) -> str:
    if name.endswith((".bin", ".safetensors", ".pt", ".pth")):
        return (f"; {name} looks like a weights file: load it into the module "
                "(model.load_state_dict) before zeromem.initialize")
    return ""
