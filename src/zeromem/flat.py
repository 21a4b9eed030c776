"""The flat parameter group: the one abstraction that carries every ZeRO stage.

A `FlatParamGroup` holds parameters of one dtype and one optimizer param group,
flattened into one contiguous buffer padded to a multiple of the data-parallel
world size N_d. Rank r owns the contiguous shard [r*S, (r+1)*S) of it. A group is
also the unit of gradient reduction (a bucket of at most `reduce_bucket_size`
elements), so a bucket's reduce-scatter is N equal chunks and lands exactly on
the owners' shards.

What a stage changes is only which of the group's buffers are whole and which
are sharded (ZeRO paper, section 5):

    stage  params   grads                                 master + optimizer
    0      whole    whole, all-reduced                    whole
    1      whole    whole, reduce-scattered at boundary   shard
    2      whole    shard, reduce-scattered every micro   shard
    3      shard    shard, reduce-scattered every micro   shard

That choice is data (`Sharding`, layout.py, with the arithmetic of padding and shard
ranges); nothing here branches on a stage number. The group is the one owner of its
buffers and of its `GroupState`: other modules change them only through its named
transitions.

Its gradient lives in one of three buffer kinds, a private part chosen once when the
group is built (offload/placement.py `build_grads`; llm.c style: data, not branches):

- `WholeAllReduced`  (stage 0): whole buffer, all-reduced at the boundary.
- `WholeScattered`   (stage 1): whole buffer, reduce-scattered at the boundary;
  the owned chunk of the whole buffer is the reduced shard.
- `ShardAccumulated` (stages 2, 3): only the shard persists, as a view into one
  contiguous buffer shared by all groups (`contiguous_gradients`); a temporary
  full bucket (`FullBucket`) is filled during each micro-step's backward,
  reduce-scattered, added into the shard and dropped.

The group's gradient transitions (`add_grad`, `fill_grads`, `launch_reduction`,
`reduced_grad`, `grad_square`, `zero_grad`) are the only way in. Whoever sees the
gradients come (the ZeRO optimizer's hooks at stages 0-2, the stage-3 unit) fills the
group and hands its `launch_reduction` to the shard group's `Comm`, which launches them
in order (`Comm.reduce_in_order`).
"""
from __future__ import annotations

import enum
from typing import Callable, Iterator, Protocol

import torch
from torch import nn
from torch._utils import _unflatten_dense_tensors

from zeromem.comm import AllReduction, Comm, Pending, Reduction, reduce_scatter_copies
from zeromem.ds_attributes import ZeroParamStatus, mark_partitioned
from zeromem.layout import ParamSlot, Sharding, ShardLayout, gather_chunks, padded_numel, slices_of

# A gradient that comes after its bucket left: each reentrant activation checkpoint runs
# a backward of its own, so a parameter used in several gets several gradients.
SECOND_GRADIENT = ("received a second gradient in one backward after its bucket was "
                   "reduced, as a parameter used in more than one reentrant activation "
                   "checkpoint does; checkpoint with use_reentrant=False (Hugging Face: "
                   "gradient_checkpointing_kwargs={'use_reentrant': False}) or zeromem.checkpoint")


def dense(grad: torch.Tensor) -> torch.Tensor:
    """`nn.Embedding(sparse=True)` gives a sparse gradient; the buckets are dense, and so is
    its reduction (DeepSpeed's `sparse_gradients` all-gathers the rows instead)."""
    return grad.to_dense() if grad.is_sparse else grad


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's squared L2 norm, accumulated in fp32 whatever its dtype (clipping's
    global norm is the square root of the ranks' summed shards')."""
    return torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2


class GroupState(enum.Enum):
    """What a group's parameters hold now; assigned in this file only (FSDP2's TrainingState).

    WHOLE: stages 0-2, the parameters are views into the whole `flat_param`, always.
    Stage 3: SHARDED (parameters empty, only the shard held) --begin_gather-->
    GATHERING (a whole buffer being all-gathered) --finish_gather--> GATHERED
    (parameters are views into it) --reshard--> SHARDED.
    """

    WHOLE = "whole"
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class FlatParamGroup:
    """Parameters of one optimizer param group flattened into one padded buffer.

    Owns: `flat_param` (compute dtype, whole; None at stage 3), `param_shard`, the
    master shard (`master_dtype`, fp32 unless bf16 masters are asked for; an alias of
    the parameter shard when the compute dtype already is it), a gradient buffer object
    that decides how gradients are held and reduced, and (stage 3) the gathered whole
    buffer. Other modules read these through properties and change them only through
    the named transitions below, each of which asserts the states it allows.

    `params` arrive in the user's dtype and are cast to `dtype` (the compute dtype)
    here, so that the master shard keeps the user's own fp32 values rather than
    their bf16/fp16 rounding (as FSDP2's mixed precision does).

    A group that does not `train` (stage 3: parameters frozen at `initialize`, sharded as
    DeepSpeed and FSDP2 shard them) has no fp32 master (the parameter shard is all it
    keeps), no gradient and no optimizer state.
    """

    def __init__(self, params: list[nn.Parameter], names: list[str], comm: Comm,
                 sharding: Sharding, param_group_index: int, dtype: torch.dtype | None = None,
                 trains: bool = True, master_dtype: torch.dtype = torch.float32):
        self.params = params
        self.trains = trains
        self.comm = comm
        self.param_group_index = param_group_index
        self.slots = [ParamSlot(name, offset, numel, p.shape) for p, name, (offset, numel)
                      in zip(params, names, slices_of(p.numel() for p in params))]
        self.numel = sum(slot.numel for slot in self.slots)
        self._shapes = [torch.empty(slot.shape, device="meta") for slot in self.slots]  # views
        world = comm.world_size
        # The optimizer's partition: one shard per rank, or (stage 0) the whole buffer,
        # still padded to a multiple of N_d so every stage has the same buffer length.
        self.layout = ShardLayout(self.numel, world, comm.rank) if sharding.optimizer \
            else ShardLayout(padded_numel(self.numel, world), 1, 0)

        p0 = params[0]
        dtype = dtype or p0.dtype
        # Read before the parameters are rounded to the compute dtype (issue 10, item 7).
        master = self._own_values(params, master_dtype) if dtype != master_dtype and trains \
            else None
        self._flat_param: torch.Tensor | None = torch.zeros(self.padded_numel, dtype=dtype,
                                                            device=p0.device)
        self._view_params(self._flat_param, copy_values=True)
        self._param_shard = self._flat_param[self.shard_offset:self.shard_offset + self.shard_numel]
        self._full: torch.Tensor | None = None  # stage 3: the whole buffer while gathered
        self._whole_storage: torch.Tensor | None = None  # stage 3: `_full`'s tensor, kept (below)
        self._whole_views: list[torch.Tensor] = []  # stage 3: parameter views of it, made once
        self._state = GroupState.WHOLE
        if sharding.params:
            # Stage 3: only the shard persists; `begin_gather` brings the whole on demand.
            # The parameters let go of the whole buffer now, so that memory matches the
            # SHARDED state from `initialize` on (issue 10, item 3).
            for p, slot in zip(params, self.slots):  # DeepSpeed's names (ZeroParamStatus)
                mark_partitioned(p, slot.shape, slot.numel,
                                 self.layout.owned_slice(slot.offset, slot.numel)[2])
            self._param_shard = self._param_shard.clone()
            self._flat_param = None
            self._empty_params()
            self._state = GroupState.SHARDED
        self._master = self._param_shard if master is None else master  # no second copy
        self._grads: GradBuffer | None = None  # set once by `attach_grads` (placement.build_grads)

    # -- read-only views of the owned state ---------------------------------
    @property
    def state(self) -> GroupState:
        return self._state

    @property
    def flat_param(self) -> torch.Tensor | None:
        return self._flat_param

    @property
    def param_shard(self) -> torch.Tensor:
        return self._param_shard

    @property
    def master(self) -> torch.Tensor:
        return self._master

    @property
    def full(self) -> torch.Tensor | None:
        """Stage 3: the whole buffer while GATHERING or GATHERED; None otherwise."""
        return self._full

    def _assert_in_states(self, *states: GroupState) -> None:
        if self._state not in states:
            raise AssertionError(f"flat group of {self.slots[0].name!r}...: expected state in "
                                 f"{[s.name for s in states]}, got {self._state.name}")

    # -- transitions of the buffers other modules place -----------------------
    def attach_grads(self, buffer: GradBuffer) -> None:
        """Hold gradients in `buffer` (a kind below, built knowing where its reduced gradient
        goes: offload/placement.py `build_grads`). Once: nothing wraps or replaces it later."""
        if self._grads is not None:
            raise AssertionError(f"flat group of {self.slots[0].name!r}...: its gradient buffer "
                                 "is set once, when it is built")
        self._grads = buffer

    # -- the gradient: held and reduced by the part `attach_grads` chose -------
    # Callers reach the gradient only through these (FSDP2's FSDPParam owns its sharded
    # gradient): what varies by stage and offload is the part, chosen once.
    @property
    def _gradient(self) -> GradBuffer:
        assert self._grads is not None, "placement.build_grads attaches every group's part"
        return self._grads

    @property
    def reduces_every_microstep(self) -> bool:
        """Whether each micro-step's gradient is reduced as it comes (stages 2, 3), or
        accumulated whole and reduced at the boundary (stages 0, 1)."""
        return self._gradient.reduces_every_microstep

    def add_grad(self, offset: int, grad: torch.Tensor) -> None:
        """Add one parameter's gradient (its slot starts at `offset`) into the bucket."""
        self._gradient.accumulate(offset, dense(grad))

    def fill_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Every parameter's gradient at once, in slot order (None: none came)."""
        self._gradient.fill([None if g is None else dense(g) for g in grads])

    def launch_reduction(self, comm: Reduction) -> Pending:
        """Reduce the bucket into this rank's gradient shard (async), as the part says."""
        return self._gradient.launch(comm)

    def reduced_grad(self) -> torch.Tensor:
        """This rank's reduced gradient (the shard; stage 0: the whole buffer)."""
        return self._gradient.reduced()

    def grad_square(self) -> torch.Tensor:
        """The squared L2 norm of `reduced_grad()` (fp32)."""
        return self._gradient.square()

    def zero_grad(self) -> None:
        self._gradient.zero()

    def grad_held(self) -> list[torch.Tensor]:
        """The gradient tensors this group keeps between steps."""
        return self._gradient.held()

    def place_master(self, master: torch.Tensor) -> None:
        """A new master tensor (offload: host memory, or a copy when params leave the device).

        Only before the optimizer is built: the optimizer's state is keyed by this tensor."""
        if master.shape != (self.shard_numel,):
            raise AssertionError(f"master of {tuple(master.shape)} for a shard of {self.shard_numel}")
        self._master = master

    def set_master_storage(self, values: torch.Tensor) -> None:
        """Give the master tensor new storage in place (NVMe swap: empty between steps)."""
        self._master.set_(values)  # type: ignore[call-overload]  # stubs lack set_(Tensor)

    def set_shard_storage(self, values: torch.Tensor) -> None:
        """Give the parameter shard new storage in place (offload_param: a device copy)."""
        self._assert_in_states(GroupState.SHARDED, GroupState.GATHERED, GroupState.WHOLE)
        self._param_shard.set_(values)  # type: ignore[call-overload]  # stubs lack set_(Tensor)

    def drop_shard_storage(self) -> None:
        """The shard gives up its memory (offload_param: the host or a file holds the values).

        Not while GATHERING: the all-gather in flight reads the shard."""
        self._assert_in_states(GroupState.SHARDED, GroupState.GATHERED, GroupState.WHOLE)
        shard = self._param_shard
        shard.set_(torch.empty(0, dtype=shard.dtype, device=shard.device))  # type: ignore[call-overload]  # stubs lack set_(Tensor)

    # -- stage 3: SHARDED -> GATHERING -> GATHERED -> SHARDED ------------------
    def begin_gather(self) -> torch.Tensor:
        """The whole buffer (padded_numel long) the caller all-gathers the shards into.

        It is the same tensor at every gather, its storage grown back to full size.
        Forward saves views of the gathered parameters for backward (a Linear's
        `weight.t()`); with a fresh buffer per gather, each old buffer would stay alive
        through those views until backward, i.e. the whole model gathered at the end of
        forward. `reshard` shrinks the storage to 0 bytes instead (FSDP's free_storage),
        so the saved views hold nothing, and the gather before backward refills the very
        storage they view. The caller keeps the version counter (the saved views check it).
        """
        self._assert_in_states(GroupState.SHARDED)
        shard = self._param_shard
        whole = self._whole_storage
        if whole is None or whole.dtype != shard.dtype or whole.device != shard.device:
            whole = torch.empty(self.padded_numel, dtype=shard.dtype, device=shard.device)
            self._whole_storage = whole
            self._whole_views = []  # views of the old tensor: made again at the next finish
        else:
            whole.untyped_storage().resize_(self.padded_numel * whole.element_size())
        self._full = whole
        self._state = GroupState.GATHERING
        return whole

    def finish_gather(self) -> None:
        """The all-gather into `full` completed: parameters become views of it."""
        self._assert_in_states(GroupState.GATHERING)
        assert self._full is not None  # set by begin_gather
        if not self._whole_views:
            # Views of the kept tensor stay valid while its storage shrinks and regrows (they
            # refer to the storage, not to its memory): one C++ call per buffer, not per gather.
            self._whole_views = list(_unflatten_dense_tensors(self._full[:self.numel],
                                                              self._shapes))
        for p, view in zip(self.params, self._whole_views):
            p.data = view
            p.ds_status = ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]
        self._state = GroupState.GATHERED

    def reshard(self, let_go: bool = False) -> None:
        """Drop the whole buffer; parameters become empty. The caller waited for its gather.

        `let_go`: the buffer is let go instead of shrunk in place, and the next gather makes
        a new one. For the end of `GatheredParameters`, whose user may keep tensors taken
        from the parameters inside (`p.data.cpu()` is `p.data` itself on a CPU): they keep
        their values, as with DeepSpeed, and their memory is theirs to free.
        """
        self._assert_in_states(GroupState.GATHERING, GroupState.GATHERED)
        self._empty_params()
        assert self._full is not None  # GATHERING and GATHERED hold the whole buffer
        if let_go:
            self._whole_storage, self._whole_views = None, []
        else:
            self._full.untyped_storage().resize_(0)  # views autograd saved now hold nothing
        self._full = None
        self._state = GroupState.SHARDED

    def adopt_whole(self) -> None:
        """Make the (edited) whole buffer the truth: this rank's part into shard and master
        (stage 3, GATHERED), or into the master (stages 0-2: the shard is a view of it)."""
        self._assert_in_states(GroupState.GATHERED, GroupState.WHOLE)
        whole = self._full if self._state is GroupState.GATHERED else self._flat_param
        assert whole is not None  # GATHERED and WHOLE hold the whole buffer
        part = whole[self.shard_offset:self.shard_offset + self.shard_numel]
        if not self.master_aliases_params():
            # Elements the modifier left alone keep the master's low bits (their
            # compute-dtype value is still the master's rounding): only edits are rounded.
            master = self._master.to(part.device)
            changed = part != master.to(part.dtype)
            self._master.copy_(torch.where(changed, part.to(master.dtype), master))
        if self._state is GroupState.GATHERED:  # WHOLE: the shard is a view of `part`
            self._param_shard.copy_(part)

    def whole_edited(self) -> bool:
        """Whether this rank's part of the gathered whole buffer differs from the shard it was
        gathered from: an edit (GATHERED). False where the shard is not in the same memory
        (offload_param), which the comparison would have to copy."""
        self._assert_in_states(GroupState.GATHERED)
        assert self._full is not None  # GATHERED holds the whole buffer
        part = self._full[self.shard_offset:self.shard_offset + self.shard_numel]
        shard = self._param_shard
        return part.shape == shard.shape and part.device == shard.device and \
            not torch.equal(part, shard)

    def check_editable(self) -> None:
        """An edit of the whole buffer can reach the master: refused before it is made where
        the master lives in a swap file (NVMe, 16-bit compute: empty here between steps),
        which `adopt_whole` cannot write."""
        if not self.master_aliases_params() and self._master.numel() != self.shard_numel:
            raise NotImplementedError(
                f"GatheredParameters(modifier_rank=...) on {self.slots[0].name}: its fp32 "
                "master lives in optimizer.swp (bf16/fp16 with offload_optimizer nvme), which "
                "the edit cannot reach; edit before initialize (under zeromem.Init), or load "
                "the weights with load_checkpoint")

    def _view_params(self, whole: torch.Tensor, copy_values: bool = False) -> None:
        # Slots lie end to end (layout.slices_of): one C++ call makes every view, ~4x
        # cheaper than a Python slice and view per parameter (stage 3 does this per gather).
        views = _unflatten_dense_tensors(whole[:self.numel], self._shapes)
        for p, view in zip(self.params, views):
            if copy_values:
                view.copy_(p.detach())
            p.data = view  # the module computes with views into the flat buffer

    def _empty_params(self) -> None:
        empty = self._param_shard.new_empty(0)
        for p in self.params:
            p.data = empty
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]

    def _own_values(self, params: list[nn.Parameter], dtype: torch.dtype) -> torch.Tensor:
        """This rank's master shard from the parameters' own values, in `dtype` (padding zero)."""
        master = torch.zeros(self.shard_numel, dtype=dtype, device=params[0].device)
        for p, slot in zip(params, self.slots):
            start, at, n = self.owned_slice(slot)
            if n:
                master[start:start + n].copy_(p.detach().reshape(-1)[at:at + n])
        return master

    # -- after the optimizer step -----------------------------------------
    def master_aliases_params(self) -> bool:
        """The master is the parameter shard itself (the compute dtype is the masters').
        Identity, not address: offload empties both storages between steps, and empty
        tensors share address 0."""
        return self._master is self._param_shard

    def unscale_into_master(self, multiplier: float) -> None:
        """Step phase 3, the master beside the parameters: its gradient is the reduced
        gradient x `multiplier`, in the master's dtype (the reduced shard itself when that is
        already it)."""
        assert self._grads is not None  # attached when the engine built the group
        grad = self._gradient.reduced()
        if grad.dtype == self._master.dtype and multiplier == 1.0:
            self._master.grad = grad  # no copy needed
        else:
            self._master.grad = grad.to(self._master.dtype).mul_(multiplier)

    def write_back(self) -> None:
        """Copy the updated master shard into this rank's parameter shard."""
        # GATHERED: a persistent stage-3 unit; the engine re-gathers it after the step
        self._assert_in_states(GroupState.WHOLE, GroupState.SHARDED, GroupState.GATHERED)
        if not self.master_aliases_params():
            self._param_shard.copy_(self._master)

    def launch_all_gather(self, bucket_numel: int) -> Iterator[Pending]:
        """All-gather the updated shards into `flat_param`, at most `bucket_numel` per collective.

        A generator: each chunk's buffer is allocated only when the caller asks for
        the next collective, so the caller bounds how many are in flight (CB).
        """
        if self.shard_world == 1 or self.flat_param is None:
            return  # nothing to gather: stage 0, or stage 3 (gathered when used)
        n, shard = self.shard_world, self.shard_numel
        chunks = gather_chunks(self.padded_numel, n, bucket_numel)  # the planner's sizes too
        if not chunks:
            # In place: this rank's shard already sits at its slot of the output (NCCL and gloo allow it).
            yield self.comm.all_gather(self.flat_param, self.param_shard, async_op=True)
            return
        full = self.flat_param.view(n, shard)
        for start, end in chunks:
            out = torch.empty(n, end - start, dtype=full.dtype, device=full.device)
            self.comm.note_buffer(out)

            pending = self.comm.all_gather(out.view(-1), self.param_shard[start:end], async_op=True)

            def scatter_back(out=out, start=start, end=end, inner=pending.finish) -> None:
                if inner is not None:  # the collective's own finishing step (comms_logger)
                    inner()
                full[:, start:end].copy_(out)
                self.comm.release_buffer(out)

            yield Pending(pending.work, scatter_back, forget=pending.forget)

    # -- layout (layout.py) -------------------------------------------------
    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    @property
    def shard_world(self) -> int:
        return self.layout.world

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def shard_offset(self) -> int:
        return self.layout.shard_offset

    def owned_slice(self, slot: ParamSlot) -> tuple[int, int, int]:
        """(start in the shard, start in the parameter, length) of `slot`'s owned part."""
        return self.layout.owned_slice(slot.offset, slot.numel)


# ---------------------------------------------------------------- the gradient buffer kinds

class HostCopies(Protocol):
    """Offload's fp32 host buffers for reduced gradients (offload/masters.py `HostGrads`),
    given to each gradient buffer when it is built (FSDP2's OffloadPolicy): the buffer then
    knows that its reduced shard goes there after each boundary reduction."""

    boundary: bool  # the backward now running ends a step

    def buffer_for(self, group: FlatParamGroup, reduced: torch.Tensor) -> torch.Tensor | None:
        """`group`'s host buffer; None where `reduced` already is one (fp32 in host memory)."""


def copied_to_host(pending: Pending, host: HostCopies | None, buffer: torch.Tensor | None,
                   reduced: Callable[[], torch.Tensor]) -> Pending:
    """`pending`, then (offload, boundary) the reduced shard copied into its host buffer,
    non-blocking: the copy overlaps the rest of backward (the step syncs before reading)."""
    if host is None or buffer is None:
        return pending  # the reduced shard stays where it is reduced, or already is on host
    if not host.boundary:
        return pending  # stage 2 accumulates on the device until the last micro-step

    def copy_to_host() -> None:
        pending.wait()
        buffer.copy_(reduced(), non_blocking=True)

    return Pending(None, copy_to_host)


class GradKind(Protocol):
    """What sizes a gradient kind's communication buffers (class attributes)."""

    temporary_buckets: int
    scatters: bool


class GradBuffer(GradKind, Protocol):
    """A gradient kind's instance: the part of one group that holds and reduces its gradient."""

    reduces_every_microstep: bool

    def accumulate(self, offset: int, grad: torch.Tensor) -> None: ...
    def fill(self, grads: list[torch.Tensor | None]) -> None: ...
    def launch(self, comm: Reduction) -> Pending: ...
    def reduced(self) -> torch.Tensor: ...
    def square(self) -> torch.Tensor: ...
    def zero(self) -> None: ...
    def held(self) -> list[torch.Tensor]: ...


def launch_copies(kind: GradKind, backend: str) -> int:
    """Full-size buffers (each as large as the group's bucket) that one launch of a group of
    gradient `kind` holds until it is waited on, all noted in Comm's CB figure: the bucket
    itself when it is a temporary, and the backend's receive buffer when it is
    reduce-scattered (`comm.reduce_scatter_copies`). The planner sizes CB with this."""
    return kind.temporary_buckets + (reduce_scatter_copies(backend) if kind.scatters else 0)


class WholeAllReduced:
    """Stage 0: every rank keeps the whole summed gradient.

    The whole buffer is reduced in place, once a step at the boundary backward. A
    second backward before the step (a GAN's discriminator takes two) must not reduce
    the first one's sum again: the sum is set aside, the buffer zeroed for the new
    gradients, and the sum added back once they are reduced (`_reduced_before`)."""

    reduces_every_microstep = False
    temporary_buckets = 0  # full-size buffers a launch holds besides the collective's own
    scatters = False  # all-reduced in place: no receive buffer

    def __init__(self, group: FlatParamGroup, dtype: torch.dtype, host: HostCopies | None = None):
        self.group = group
        self.whole = torch.zeros(group.padded_numel, dtype=dtype, device=group.param_shard.device)
        self.host = host  # offload: where the reduced shard is copied at the boundary
        self.host_buffer = host.buffer_for(group, self.reduced()) if host is not None else None
        self.launched = False  # reduced since the last `zero`: a new gradient sets it aside
        self.earlier: torch.Tensor | None = None  # set aside, added back after the reduction

    def accumulate(self, offset: int, grad: torch.Tensor) -> None:
        if self.launched:
            self._set_aside()
        self.whole[offset:offset + grad.numel()].add_(grad.reshape(-1))

    def fill(self, grads: list[torch.Tensor | None]) -> None:
        for slot, grad in zip(self.group.slots, grads):
            if grad is not None:
                self.accumulate(slot.offset, grad)

    def _set_aside(self) -> None:
        self.earlier = self.reduced().clone()
        self.whole.zero_()  # the other ranks' parts too (stage 1): they were reduced
        self.launched = False

    def launch(self, comm: Reduction) -> Pending:
        if not isinstance(comm, AllReduction):
            raise TypeError(f"stage 0 all-reduces its gradient; {type(comm).__name__} cannot")
        return self._reduced_before(comm.all_reduce(self.whole, async_op=True))

    def _reduced_before(self, pending: Pending) -> Pending:
        """`pending`, then what earlier backwards of this step reduced added back, then the
        host copy (offload)."""
        self.launched = True
        earlier, self.earlier = self.earlier, None
        if earlier is not None:
            reduction = pending

            def add_back() -> None:
                reduction.wait()
                self.reduced().add_(earlier)

            pending = Pending(None, add_back)
        return copied_to_host(pending, self.host, self.host_buffer, self.reduced)

    def reduced(self) -> torch.Tensor:
        return self.whole

    def square(self) -> torch.Tensor:
        return squared_norm(self.reduced())

    def zero(self) -> None:
        self.whole.zero_()
        self.launched = False

    def held(self) -> list[torch.Tensor]:
        return [self.whole]


class WholeScattered(WholeAllReduced):
    """Stage 1: the whole gradient accumulates locally; the boundary reduce-scatters it."""

    scatters = True

    def launch(self, comm: Reduction) -> Pending:
        return self._reduced_before(comm.reduce_scatter(self.reduced(), self.whole, async_op=True))

    def reduced(self) -> torch.Tensor:
        g = self.group
        return self.whole[g.shard_offset:g.shard_offset + g.shard_numel]


class ContiguousShards:
    """`contiguous_gradients`: every group's reduced shard is a view into one zeroed buffer.

    The buffer is allocated when a shard is first read, not at construction: where reduced
    shards go to a swap file instead (offload/grad_file.py `ShardToFile`, chosen when the
    gradient buffers are built), none is ever read, and no rank holds the model's gradient
    shard.
    """

    def __init__(self, numels: list[int], dtype: torch.dtype, device: torch.device):
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        self.numels = numels
        self.dtype, self.device = dtype, device
        self.views: list[torch.Tensor] = []  # one per group, always the same tensor

    def shard(self, index: int) -> torch.Tensor:
        if not self.views:
            flat = torch.zeros(sum(self.numels), dtype=self.dtype, device=self.device)
            self.views = [flat[start:start + n] for start, n in zip(self.offsets, self.numels)]
        return self.views[index]


class FullBucket:
    """One flat group's full-size gradient bucket, alive only while a reduction needs it:
    allocated zeroed at the first gradient, handed over whole at launch (a group no
    gradient reached reduces zeros), and started afresh by the next gradient."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self._buffer: torch.Tensor | None = None

    @property
    def filling(self) -> bool:
        """A bucket is alive: a gradient arrived since the last `take`."""
        return self._buffer is not None

    def add(self, offset: int, grad: torch.Tensor) -> None:
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self._buffer[offset:offset + grad.numel()].add_(grad.reshape(-1))

    def fill(self, grads: list[torch.Tensor | None], numels: list[int]) -> None:
        """Every gradient of the group at once, in slot order (None: none came), in one copy:
        a stage-3 unit fills its bucket when the last one is in (stage3/sharded_unit.py)."""
        like = next(g for g in grads if g is not None)
        parts = [like.new_zeros(n) if g is None else g.reshape(-1) for g, n in zip(grads, numels)]
        pad = self.numel - sum(numels)
        if pad:
            parts.append(like.new_zeros(pad))
        flat = torch.cat(parts).to(self.dtype)
        if self._buffer is None:
            self._buffer = flat
        else:
            self._buffer.add_(flat)

    def take(self) -> torch.Tensor:
        """The filled bucket; this object holds nothing until the next `add`."""
        buffer = self._buffer
        self._buffer = None
        if buffer is None:
            return torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return buffer


class ShardAccumulated:
    """Stage 2: only the reduced shard persists; full-size gradients live one bucket at a time."""

    reduces_every_microstep = True
    temporary_buckets = 1  # the full-size bucket, dropped once reduced
    scatters = True

    def __init__(self, group: FlatParamGroup, shards: ContiguousShards, index: int,
                 host: HostCopies | None = None):
        self.group = group
        self.shards, self.index = shards, index
        self.dtype, self.device = shards.dtype, shards.device  # the bucket's (reduce-scatter's)
        self.bucket = FullBucket(group.padded_numel, self.dtype, self.device)
        self.host = host  # offload: where the reduced shard is copied at the boundary
        self.host_buffer = host.buffer_for(group, self.shard) if host is not None else None

    @property
    def shard(self) -> torch.Tensor:
        return self.shards.shard(self.index)

    def accumulate(self, offset: int, grad: torch.Tensor) -> None:
        self.bucket.add(offset, grad)

    def fill(self, grads: list[torch.Tensor | None]) -> None:
        self.bucket.fill(grads, [slot.numel for slot in self.group.slots])

    def launch(self, comm: Reduction) -> Pending:
        bucket = self.bucket.take()
        comm.note_buffer(bucket)
        out = torch.empty(self.group.shard_numel, dtype=self.dtype, device=self.device)
        pending = comm.reduce_scatter(out, bucket, async_op=True)

        def add_into_shard() -> None:
            pending.wait()
            self.shard.add_(out)
            comm.release_buffer(bucket)

        return copied_to_host(Pending(None, add_into_shard), self.host, self.host_buffer,
                              self.reduced)

    def reduced(self) -> torch.Tensor:
        return self.shard

    def square(self) -> torch.Tensor:
        return squared_norm(self.reduced())

    def zero(self) -> None:
        self.shard.zero_()

    def held(self) -> list[torch.Tensor]:
        return [self.shard]
