"""The checkpoint manifest's schema, checked whole before a load touches the engine.

`manifest.json` is data from disk, perhaps damaged or tampered with: a missing
`counters` must not surface as a `KeyError` after the masters were overwritten,
nor `{"scale": "big"}` become the loss scale. `validate_manifest` checks every
field's presence and type (pydantic, strict: no coercion of "3" to 3, unknown
keys refused), plus the cross-field rules a load relies on (one file per saved
rank under its own name, every state_dict key accounted for), and raises one
`CheckpointError` naming the field. The opaque small states (optimizer options,
scheduler, scalar optimizer state) are `consolidate.encode` JSON; their encoding
is checked here and their fit to the engine in `checkpoint_state.check_like`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, field_validator, model_validator)

import torch

from zeromem.checkpoints.tensor_files import CheckpointError

Count = Annotated[StrictInt, Field(ge=0)]
Number = Union[StrictInt, StrictFloat]
Sha256 = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def _dtype_name(value: str) -> str:
    if not isinstance(getattr(torch, value, None), torch.dtype):
        raise ValueError(f"{value!r} is not a torch dtype")
    return value


DtypeName = Annotated[StrictStr, Field(min_length=1)]


def check_encoded(data: object, where: str = "value") -> None:
    """`data` must be what `consolidate.encode` writes: JSON, with well-formed tagged dicts."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return
    if isinstance(data, list):
        for i, v in enumerate(data):
            check_encoded(v, f"{where}[{i}]")
        return
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {type(data).__name__} is not JSON")
    if "__tensor__" in data:
        _check_encoded_tensor(data, where)
    elif "__tuple__" in data or "__items__" in data:
        key = next(iter(data))
        if len(data) != 1 or not isinstance(data[key], list):
            raise ValueError(f"{where}: {key} must be the only key and hold a list")
        if key == "__items__" and not all(isinstance(p, list) and len(p) == 2 for p in data[key]):
            raise ValueError(f"{where}: __items__ must be [key, value] pairs")
        check_encoded(data[key], where)
    else:
        for k, v in data.items():
            check_encoded(v, f"{where}.{k}")


def _check_encoded_tensor(data: dict, where: str) -> None:
    if set(data) != {"__tensor__", "dtype", "device"}:
        raise ValueError(f"{where}: an encoded tensor has exactly __tensor__, dtype and device")
    if not isinstance(data["dtype"], str) or not isinstance(data["device"], str):
        raise ValueError(f"{where}: dtype and device must be strings")
    _dtype_name(data["dtype"])

    def numbers(v: object) -> bool:  # bool is an int: bool tensors encode as true/false
        return all(numbers(x) for x in v) if isinstance(v, list) else isinstance(v, (int, float))
    if not numbers(data["__tensor__"]):
        raise ValueError(f"{where}: __tensor__ must hold numbers")


def _encoded(value: Any) -> Any:
    check_encoded(value)
    return value


class Dtypes(_Strict):
    compute: DtypeName
    master: Literal["float32"]
    optimizer: dict[StrictStr, DtypeName]

    @field_validator("compute")
    @classmethod
    def _compute(cls, v: str) -> str:
        return _dtype_name(v)

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: dict) -> dict:
        for name in v.values():
            _dtype_name(name)
        return v


class Counters(_Strict):
    global_steps: Count
    micro_steps: Count
    skipped_steps: Count
    global_samples: Count | None = None  # absent from checkpoints of zeromem before 2026-12


class Param(_Strict):
    shape: list[Count]
    param_group: Count
    scalar_state: dict[StrictStr, Any]  # Adam's step: a number or an encoded scalar tensor
    # its optimizer's tensor states where param groups keep different ones (Muon's matrices:
    # momentum; the others: Adam's moments); absent: all of optimizer.tensor_states
    tensor_states: list[StrictStr] | None = None

    @field_validator("scalar_state")
    @classmethod
    def _scalars(cls, v: dict) -> dict:
        for key, value in v.items():
            is_tensor = isinstance(value, dict) and "__tensor__" in value
            if not is_tensor and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{key}: a scalar optimizer state is a number or a tensor")
            check_encoded(value, key)
        return v


class FileEntry(_Strict):
    name: StrictStr
    rank: Count
    sha256: Sha256
    bytes: Count
    pieces: list[tuple[StrictStr, Count, Count]]


class ClientFile(_Strict):
    name: Literal["client_state.pt"]
    sha256: Sha256
    bytes: Count


class ModuleTensor(_Strict):
    shape: list[Count]
    dtype: DtypeName

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return _dtype_name(v)


class OptimizerInfo(_Strict):
    type: Annotated[StrictStr, Field(min_length=1)]
    tensor_states: list[StrictStr]
    param_groups: list[dict[StrictStr, Any]]

    @field_validator("param_groups")
    @classmethod
    def _groups(cls, v: list) -> list:
        return _encoded(v)


class NoScalerState(_Strict):
    pass


class StaticScalerState(_Strict):
    scale: Number


class DynamicScalerState(_Strict):
    scale: Number
    hysteresis_left: StrictInt
    iteration: Count
    last_overflow_iteration: StrictInt


ScalerState = Union[DynamicScalerState, StaticScalerState, NoScalerState]


class Manifest(_Strict):
    """Every field `checkpoints._build_manifest` writes, with its type."""

    format: Literal["zeromem-checkpoint"]
    version: Literal[1]
    tag: StrictStr
    world_size: Annotated[StrictInt, Field(ge=1)]
    zero_stage: Annotated[StrictInt, Field(ge=0, le=3)]
    gradient_accumulation_steps: Annotated[StrictInt, Field(ge=1)]
    dtypes: Dtypes
    counters: Counters
    params: dict[StrictStr, Param]
    files: list[FileEntry]
    state_dict_keys: list[StrictStr]
    aliases: dict[StrictStr, StrictStr]
    module_tensors: dict[StrictStr, ModuleTensor]
    frozen_parameters_excluded: StrictBool = False
    """Saved with exclude_frozen_parameters (or a DeepSpeed checkpoint that may have been):
    frozen parameters may be absent from module_tensors and state_dict_keys."""
    frozen_parameters: Optional[list[StrictStr]] = None
    """The module_tensors that are frozen parameters (the others are buffers); None in
    checkpoints written before zeromem recorded it."""
    optimizer: OptimizerInfo
    scaler: ScalerState
    lr_scheduler: Optional[dict[StrictStr, Any]]
    client_state: Optional[ClientFile]

    @field_validator("lr_scheduler")
    @classmethod
    def _scheduler(cls, v: dict | None) -> dict | None:
        return _encoded(v)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        _check_files(self)
        _check_keys(self)
        if set(self.dtypes.optimizer) != set(self.optimizer.tensor_states):
            raise ValueError(f"dtypes.optimizer {sorted(self.dtypes.optimizer)} must name "
                             f"exactly optimizer.tensor_states {self.optimizer.tensor_states}")
        for group in {p.param_group for p in self.params.values()}:
            scalar_keys = {tuple(sorted(p.scalar_state)) for p in self.params.values()
                           if p.param_group == group}
            if len(scalar_keys) > 1:
                raise ValueError(f"params: scalar_state keys differ between parameters of "
                                 f"param group {group} ({sorted(scalar_keys)})")
        for name, p in self.params.items():
            if p.tensor_states is not None and not set(p.tensor_states) <= set(self.dtypes.optimizer):
                raise ValueError(f"params.{name}.tensor_states {p.tensor_states} name states "
                                 f"that optimizer.tensor_states {self.optimizer.tensor_states} lack")
        return self


def _check_files(m: Manifest) -> None:
    """Rank r's file is files[r], named rank{r:05d}.safetensors: no other path is read."""
    if len(m.files) != m.world_size:
        raise ValueError(f"files: {len(m.files)} entries for world_size {m.world_size}")
    for i, entry in enumerate(m.files):
        if entry.rank != i or entry.name != f"rank{i:05d}.safetensors":
            raise ValueError(f"files[{i}]: rank {entry.rank}, name {entry.name!r}; expected rank "
                             f"{i}, name 'rank{i:05d}.safetensors'")


def _check_keys(m: Manifest) -> None:
    """Every state_dict key is a parameter, a module tensor or an alias of one (tied weights,
    trained or frozen); each frozen parameter is a module tensor."""
    keys = set(m.state_dict_keys)
    held = m.params.keys() | m.module_tensors.keys()
    for key in m.state_dict_keys:
        if key not in held and m.aliases.get(key) not in held:
            raise ValueError(f"state_dict_keys: {key!r} is neither a parameter, a module tensor "
                             "nor an alias of one")
    unlisted = sorted((set(m.params) | set(m.module_tensors) | set(m.aliases)) - keys)
    if unlisted:
        raise ValueError(f"state_dict_keys: {unlisted[:5]} are not listed")
    strays = sorted(set(m.frozen_parameters or ()) - set(m.module_tensors))
    if strays:
        raise ValueError(f"frozen_parameters: {strays[:5]} are not module_tensors")


def validate_manifest(text: str, file: object) -> None:
    """Check the manifest's JSON `text` whole; a CheckpointError naming the field if it fails."""
    try:
        Manifest.model_validate_json(text)
    except ValidationError as error:
        raise CheckpointError(f"{file} is damaged: {_describe(error)}") from None


def _describe(error: ValidationError) -> str:
    problems = []
    for e in error.errors()[:3]:
        field = ".".join(str(part) for part in e["loc"]) or "(top level)"
        problems.append(f"field {field}: {e['msg']}")
    more = error.error_count() - len(problems)
    return "; ".join(problems) + (f" (and {more} more)" if more > 0 else "")
