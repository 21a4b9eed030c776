"""The `optimizer` and `scheduler` blocks: a named optimizer or schedule and its keywords.

Each block names a class (case-insensitively, the DeepSpeed way) and checks `params`
against a strict pydantic model built from that class's signature, so a misspelt
keyword gets "did you mean ...?" and a wrong value names its key, before torch sees it.
"""

from __future__ import annotations

import builtins
import inspect
import logging
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, get_type_hints

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, \
    create_model, field_validator, model_validator

from zeromem.optim import muon, optimizers, schedulers
from zeromem.config.rules import ConfigError, Unsupported, humanise
from zeromem.config.types import Bool, Float, Int, _Beta, _Block, _pair

logger = logging.getLogger("zeromem")

# Rules for the torch optimizers' keywords, by name; a keyword not named here keeps its
# torch type check. DeepSpeed passes these straight to the constructor, whose own checks
# would surface as a torch traceback (or not at all: torch takes lr "0.01" until step()).
_OPTIMIZER_PARAM_RULES: dict[str, Any] = {
    "lr": Annotated[Float, Field(ge=0)], "eps": Annotated[Float, Field(gt=0)],
    "betas": Annotated[list[_Beta], BeforeValidator(_pair)],  # a list, as torch got it before
    "weight_decay": Annotated[Float, Field(ge=0)], "momentum": Annotated[Float, Field(ge=0)],
    "dampening": Annotated[Float, Field(ge=0)],
    **{name: Bool for name in ("amsgrad", "nesterov", "maximize", "capturable", "differentiable",
                               "decoupled_weight_decay")},
    "foreach": Bool | None, "fused": Bool | None,
    # DeepSpeed's own optimizers (zeromem.optim.optimizers) and Adagrad
    **{name: Bool for name in ("bias_correction", "eps_inside_sqrt", "adam_w_mode")},
    **{name: Annotated[Float, Field(ge=0)] for name in ("max_coeff", "min_coeff", "lr_decay",
                                                        "initial_accumulator_value")},
    # DeepSpeed's Muon (zeromem.optim.muon)
    **{name: Annotated[Float, Field(ge=0)] for name in ("muon_lr", "adam_lr")},
    "ns_method": Literal["gram", "standard"], "ns_steps": Annotated[Int, Field(ge=1)],
}


_ONE_BIT = ("it compresses the gradient all-reduce to 1-bit signs with error feedback over "
            "its own NCCL/MPI backends, and DeepSpeed runs it only without ZeRO; zeromem reduces "
            "full-precision gradients (use Adam, AdamW or Lamb)")
_MUP = ("mup's optimizers scale each parameter's update by its infshape, an attribute zeromem's "
        "flat fp32 master shards do not carry")
# DeepSpeed optimizer names (lower case, as DeepSpeed compares them) -> (feature, reason).
REFUSED_OPTIMIZERS: dict[str, tuple[str, str]] = {
    "onebitadam": ("1-bit Adam", _ONE_BIT), "zerooneadam": ("0/1 Adam", _ONE_BIT),
    "onebitlamb": ("1-bit Lamb", _ONE_BIT),
    "muadam": ("MuAdam (mup)", _MUP), "muadamw": ("MuAdamW (mup)", _MUP), "musgd": ("MuSGD (mup)", _MUP),
}


@cache
def _optimizer_params_model(torch_class: type[torch.optim.Optimizer]) -> type[BaseModel]:
    """A strict pydantic model of the optimizer's keyword arguments, built from its signature."""
    fields: dict[str, Any] = {}
    for arg, p in inspect.signature(torch_class).parameters.items():
        if arg != "params" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            fields[arg] = (_OPTIMIZER_PARAM_RULES.get(arg, Any), None)
    return create_model(f"{torch_class.__name__}Params",
                        __config__=ConfigDict(extra="forbid"), **fields)


class OptimizerConfig(_Block):
    """`optimizer`: a torch optimizer named the DeepSpeed way, with its constructor keywords."""

    _classes: ClassVar[dict[str, type[torch.optim.Optimizer]]] = {
        "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD,
        "Adagrad": torch.optim.Adagrad, "Lamb": optimizers.Lamb, "Lion": optimizers.Lion,
        "Muon": muon.ShardedMuon}

    type: Literal["Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion", "Muon"]  # any case in the file
    params: dict[str, Any] = Field(default_factory=dict)  # keywords of the optimizer's constructor
    # "bias_correction": false: DeepSpeed's FusedAdam math (zeromem.optim.optimizers.Adam), which
    # torch's Adam cannot do
    _uncorrected: bool = PrivateAttr(default=False)

    @field_validator("type", mode="before")
    @classmethod
    def _normalise_type(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in REFUSED_OPTIMIZERS:
            feature, reason = REFUSED_OPTIMIZERS[value.lower()]
            raise Unsupported("optimizer.type", feature, reason, value)
        names = {name.lower(): name for name in cls._classes}
        return names.get(value.lower(), value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_params(self) -> OptimizerConfig:
        params = dict(self.params)
        if self.type in ("Adam", "AdamW"):
            self._map_deepspeed_adam_keys(params)
        model = _optimizer_params_model(self.torch_class)  # type: ignore[arg-type]  # hashable
        try:
            checked = model.model_validate(params)
        except ValidationError as error:
            raise ConfigError(humanise(error, model, ("optimizer", "params"))) from None
        self.params = checked.model_dump(exclude_unset=True)
        return self

    def _map_deepspeed_adam_keys(self, params: dict[str, Any]) -> None:
        # zeromem runs torch.optim, so DeepSpeed's kernel switch has nothing to select.
        params.pop("torch_adam", None)
        # DeepSpeed 0.19.8 pops it for every Adam (its CPU Adam's moments in the masters'
        # dtype when false): zeromem's states always take the masters' dtype, the outcome
        # DeepSpeed reaches either way (it overrides true under bf16_optimizer_states).
        if not isinstance(params.pop("fp32_optimizer_states", False), bool):
            raise ConfigError("optimizer.params.fp32_optimizer_states must be true or false")
        adam_w_mode = params.pop("adam_w_mode", None)
        bias_correction = params.pop("bias_correction", True)
        if not isinstance(bias_correction, bool):
            raise ConfigError(f"optimizer.params.bias_correction must be true or false, got "
                              f"{bias_correction!r}")
        if self.type == "AdamW" and adam_w_mode is False:
            raise ConfigError("optimizer.params.adam_w_mode=false contradicts type 'AdamW'; "
                              "use type 'Adam'")
        # DeepSpeed's "Adam" decouples weight decay (adam_w_mode defaults to true).
        if self.type == "Adam" and adam_w_mode is not False and params.get("weight_decay", 0):
            logger.warning("optimizer type 'Adam' with weight_decay runs as AdamW, as in DeepSpeed "
                           "(adam_w_mode defaults to true); set adam_w_mode=false for L2 decay")
            self.type = "AdamW"
        if self.type == "AdamW":
            params.setdefault("weight_decay", 0.0)  # DeepSpeed's default; torch's AdamW uses 0.01
        if not bias_correction:  # torch's Adam always corrects: DeepSpeed's own math then
            self._uncorrected = True
            params.update(bias_correction=False, adam_w_mode=self.type == "AdamW")

    @property
    def torch_class(self) -> builtins.type[torch.optim.Optimizer]:  # `type` is a field here
        """The optimizer class this block names (a torch.optim one, or zeromem.optim.optimizers')."""
        return optimizers.Adam if self._uncorrected else self._classes[self.type]


@cache
def _scheduler_params_model(name: str) -> type[BaseModel]:
    """A strict pydantic model of the scheduler's keyword arguments, built from its signature."""
    cls = schedulers.SCHEDULERS[name]
    hints = get_type_hints(cls.__init__, include_extras=True)
    fields: dict[str, Any] = {}
    for arg, p in inspect.signature(cls.__init__).parameters.items():
        if arg in ("self", "optimizer", "last_batch_iteration"):  # resume via state_dict instead
            continue
        # every numeric keyword is a step count, a learning rate or a ratio: none is negative
        hint = {float: Annotated[Float, Field(ge=0)], float | None: Annotated[Float, Field(ge=0)] | None,
                int: Annotated[Int, Field(ge=0)]}.get(hints[arg], hints[arg])
        fields[arg] = (hint, ... if p.default is p.empty else p.default)
    return create_model(f"{name}Params", __config__=ConfigDict(extra="forbid"), **fields)


class SchedulerConfig(_Block):
    """`scheduler`: one of DeepSpeed's schedules (see zeromem.optim.schedulers)."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest", "OneCycle"]  # any case
    params: dict[str, Any] = Field(default_factory=dict)  # keywords of the schedule's constructor

    @field_validator("type", mode="before")
    @classmethod
    def _normalise_type(cls, value: Any) -> Any:
        names = {name.lower(): name for name in schedulers.SCHEDULERS}
        return names.get(value.lower(), value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_params(self) -> SchedulerConfig:
        model = _scheduler_params_model(self.type)
        try:
            checked = model.model_validate(self.params)
        except ValidationError as error:
            raise ConfigError(humanise(error, model, ("scheduler", "params"))) from None
        self.params = checked.model_dump(exclude_unset=True)
        return self
