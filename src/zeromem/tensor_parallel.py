"""Minimal Megatron-style tensor (model) parallel linear layers and 2-D process groups.

ZeRO-R's Pa (paper, section 6.1) partitions activation checkpoints across the
model-parallel group, so zeromem needs a model-parallel model to exercise it. These
two layers are the classic pair: a column-parallel linear splits the output features
(each rank computes a slice), a row-parallel linear splits the input features (each
rank computes a partial sum, all-reduced). Their collectives are autograd functions:

    copy_to_model_parallel      forward: identity    backward: all-reduce
    reduce_from_model_parallel  forward: all-reduce  backward: identity
    gather_from_model_parallel  forward: all-gather (last dim)  backward: keep own slice
    scatter_to_model_parallel   forward: keep own slice         backward: all-gather

Groups are passed in, never fetched; `group=None` means no model parallelism (one
rank, no communication). The collectives go through `comm.Comm` (one per layer),
which also counts the bytes they move. A layer built under the same seed as a dense `nn.Linear`
of the same shape draws the same full weight and keeps its slice, so a tensor
parallel model equals the dense model built from that seed.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zeromem.comm import Comm
from zeromem.flat import squared_norm


def model_parallel_comm(group: dist.ProcessGroup | None) -> Comm | None:
    """The `Comm` for `group`; None when there is nothing to communicate (no group, or one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return Comm(group)


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    # A fresh buffer: autograd may hand the same grad tensor to several consumers.
    out = x.contiguous().clone()
    comm.all_reduce(out)
    return out


def _gather_last_dim(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    # [*, d] on each rank -> [*, N*d], rank r's slice at columns r*d:(r+1)*d.
    n = comm.world_size
    flat = x.new_empty(n * x.numel())
    comm.all_gather(flat, x.contiguous().view(-1))
    return torch.cat(flat.view(n, *x.shape).unbind(0), dim=-1)


def _own_slice_last_dim(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x.chunk(comm.world_size, dim=-1)[comm.rank].contiguous()


class _CopyToModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _gather_last_dim(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_slice_last_dim(grad, ctx.comm), None


class _ScatterToModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _own_slice_last_dim(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_last_dim(grad, ctx.comm), None


def copy_to_model_parallel(x: torch.Tensor, comm: Comm | None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over `comm`'s group in backward."""
    return x if comm is None else _CopyToModelParallel.apply(x, comm)


def reduce_from_model_parallel(x: torch.Tensor, comm: Comm | None) -> torch.Tensor:
    """All-reduce (sum) over `comm`'s group forward; identity backward."""
    return x if comm is None else _ReduceFromModelParallel.apply(x, comm)


def gather_from_model_parallel(x: torch.Tensor, comm: Comm | None) -> torch.Tensor:
    """Concatenate the ranks' last-dim slices forward; keep this rank's slice of the grad."""
    return x if comm is None else _GatherFromModelParallel.apply(x, comm)


def scatter_to_model_parallel(x: torch.Tensor, comm: Comm | None) -> torch.Tensor:
    """Keep this rank's last-dim slice forward; all-gather the grad in backward."""
    return x if comm is None else _ScatterToModelParallel.apply(x, comm)


def _divide(features: int, size: int, what: str) -> int:
    if features % size:
        raise ValueError(f"{what}={features} is not divisible by the model-parallel size {size}")
    return features // size


class ColumnParallelLinear(nn.Module):
    """`y = x A^T + b` with A's rows (output features) split across `group`.

    Input `[*, in_features]` (replicated); output `[*, out_features / N]` on each rank,
    or `[*, out_features]` with `gather_output=True`.
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None,
                 gather_output: bool = False, bias: bool = True, *,
                 dense: nn.Linear | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        rank, size = _rank_and_size(group)
        self.group, self.gather_output = group, gather_output
        self.comm = model_parallel_comm(group)
        self.in_features, self.out_features = in_features, out_features
        rows = _divide(out_features, size, "out_features")
        # Draw the full dense weight exactly as nn.Linear would, then keep this rank's rows.
        dense = dense or nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        keep = slice(rank * rows, (rank + 1) * rows)
        self.weight = nn.Parameter(dense.weight.detach()[keep].clone())
        self.bias = nn.Parameter(dense.bias.detach()[keep].clone()) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: dist.ProcessGroup | None,
                   gather_output: bool = False) -> ColumnParallelLinear:
        """This rank's slice of an existing dense layer."""
        return cls(linear.in_features, linear.out_features, group, gather_output,
                   bias=linear.bias is not None, dense=linear)

    def sharded_parameters(self) -> list[nn.Parameter]:
        """Parameters split across the model-parallel group: the weight and the bias."""
        return [p for p in (self.weight, self.bias) if p is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_model_parallel(x, self.comm), self.weight, self.bias)
        return gather_from_model_parallel(y, self.comm) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """`y = x A^T + b` with A's columns (input features) split across `group`.

    Input `[*, in_features / N]` (already parallel, e.g. a column-parallel output) or
    `[*, in_features]` with `input_is_parallel=False`; output `[*, out_features]`,
    replicated. The bias is added once, after the all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None,
                 input_is_parallel: bool = True, bias: bool = True, *,
                 dense: nn.Linear | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        rank, size = _rank_and_size(group)
        self.group, self.input_is_parallel = group, input_is_parallel
        self.comm = model_parallel_comm(group)
        self.in_features, self.out_features = in_features, out_features
        cols = _divide(in_features, size, "in_features")
        dense = dense or nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = nn.Parameter(dense.weight.detach()[:, rank * cols:(rank + 1) * cols].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone()) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: dist.ProcessGroup | None,
                   input_is_parallel: bool = True) -> RowParallelLinear:
        """This rank's slice of an existing dense layer."""
        return cls(linear.in_features, linear.out_features, group, input_is_parallel,
                   bias=linear.bias is not None, dense=linear)

    def sharded_parameters(self) -> list[nn.Parameter]:
        """Parameters split across the model-parallel group: the weight (the bias is whole)."""
        return [self.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_model_parallel(x, self.comm)
        y = reduce_from_model_parallel(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


class ModelParallelNorm:
    """The squared gradient norm of the whole model, when its layers are split over `group`.

    Data-parallel reduction gives each model-parallel rank the squared norm of its
    own parameters; the model's norm also spans the model-parallel group. Sharded
    parameters (those a layer lists in `sharded_parameters()`) are disjoint slices,
    so their squares add up across the group. Replicated parameters (embeddings,
    layer norms, a row-parallel bias) carry the same gradient on every model-parallel
    rank, so each rank counts 1/N_mp of theirs: summed over the group, once. Every
    model-parallel rank then clips with the same coefficient, and replicated
    parameters stay identical.

    Built only with tensor parallelism (`model_parallel_norm`): without it, the step takes
    each group's own square and crosses nothing here.
    """

    def __init__(self, module: nn.Module, comm: Comm) -> None:
        self.comm = comm  # the model-parallel group, of more than one rank
        sharded = {id(p) for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                   for p in m.sharded_parameters()}
        self.replicated = {id(p) for p in module.parameters() if id(p) not in sharded}

    def square(self, group) -> torch.Tensor:
        """This rank's share of the squared norm of a flat group's reduced gradient."""
        sq = group.grad_square()  # this rank's shard (the whole buffer at stage 0)
        spans = [(start, length) for p, slot in zip(group.params, group.slots)
                 for start, _, length in [group.owned_slice(slot)]
                 if length and id(p) in self.replicated]
        if not spans:
            return sq
        grad = group.reduced_grad()  # read only here: a shard in grads.swp costs a read
        repeated = [grad[start:start + length] for start, length in spans]
        rep_sq = torch.stack([squared_norm(x) for x in repeated]).sum()
        return (sq - rep_sq) + rep_sq / self.comm.world_size

    def all_reduce(self, sq: torch.Tensor) -> None:
        """Sum the squared norm over the model-parallel group (in place)."""
        self.comm.all_reduce(sq, kind="all_reduce_norm")


def model_parallel_norm(module: nn.Module, group: dist.ProcessGroup | None) -> ModelParallelNorm | None:
    """The norm over `group` when the model is split over more than one rank; None otherwise
    (no tensor parallelism: each rank's square of its own gradients is the model's)."""
    comm = model_parallel_comm(group)
    return None if comm is None else ModelParallelNorm(module, comm)


def make_2d_groups(dp_size: int, mp_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(data-parallel group, model-parallel group) of this rank in a dp x mp grid.

    Ranks are laid out model-parallel fastest: ranks `d*mp .. d*mp + mp-1` form one
    model-parallel group, ranks `m, m+mp, m+2*mp, ...` one data-parallel group.
    Every rank creates every group, in the same order, as `new_group` requires.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if dp_size * mp_size != world:
        raise ValueError(f"dp_size={dp_size} x mp_size={mp_size} != world size {world}")
    mp_group = dp_group = None
    for d in range(dp_size):
        ranks = [d * mp_size + m for m in range(mp_size)]
        group = dist.new_group(ranks)
        if rank in ranks:
            mp_group = group
    for m in range(mp_size):
        ranks = [d * mp_size + m for d in range(dp_size)]
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    assert dp_group is not None and mp_group is not None  # every rank is in one of each
    return dp_group, mp_group
