"""The NVMe-offloaded optimizer step of ZeRO-Infinity (arXiv 2104.07857, section 5).

The rank's shard is cut into sub-groups of at most `sub_group_size` elements,
each within one param group (`sub_groups.plan_sub_groups`, which also sizes the pool and
file for the planner). The swap file holds one record
per sub-group,

    [master] [state 1] [state 2] ...      each field ALIGN-aligned, fp32

where the master field is on disk only when the master is not the parameter
shard itself (in fp32 training the engine steps the parameter shard, wherever
its placement is: device memory, host memory, or a swap file at stage 3). A pool buffer holds one
field of one sub-group, so `depth = buffer_count // (1 + states)` sub-groups
are in flight:

    read  i+1 .. i+depth-1   NVMe -> pool   (offload_optimizer.pipeline_read)
    step  i                  torch's functional Adam/AdamW/SGD, fused CPU kernel,
                             on pool views and the host gradient shards
    write i-1 ...            pool -> NVMe   (offload_optimizer.pipeline_write)

In fp32 the master pieces are read from and written to the parameter shards' place
(`ParamPlacement.read_piece` / `write_piece`: for params.swp, straight from the
master buffer), so the step holds no parameter buffer. The I/O reaches beyond
`step()` on both sides: the boundary backward starts reading the first `depth`
sub-groups' fields and masters (`read_before_step`), and each one's gradients as
soon as backward has stored all of them in grads.swp (`_read_grads_early`); the last
sub-groups' writes are left in flight when `step()` returns, waited for when their
slot or record is next used, or by `settle()` (which `all_in_memory` and the engine's
close call before the files are used whole).

Where nothing needs the whole gradient first (fp32 or bf16, parameters on NVMe, no
loss scale, no clipping expected), the step itself begins in the boundary backward, each
sub-group as its gradient is reduced (`StepInBackward`, offload/backward_step.py); the
records then have two copies (`two_copies`: the step writes the other one, current once
`step()` takes the step, `_commit`), so that a skipped step leaves them as they were.
In bf16 the new 16-bit values then go to params.swp's other copy as pieces too
(`write_piece`, from the slot's gradient buffer, used up by then), not into the shards
in memory, which are the current copy.

Buffer lifetimes: the pool lives as long as the optimizer; a sub-group holds its
buffers from the launch of its read until its write has completed, and only then
is the slot reused. Fresh states (step 0 of a param group) are zero-filled, not
read (DeepSpeed's `fast_init`, always on). Host memory for optimizer state is
therefore the pool, buffer_count x sub_group_size x 4 bytes plus alignment,
whatever the model size. The step counter is kept per param group.

A failed read or write (`OffloadError`) leaves the step half done, so the
optimizer refuses every later step rather than train on inconsistent state.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch

from zeromem.flat import FlatParamGroup
from zeromem.offload.backward_step import StepInBackward
from zeromem.offload.grad_file import GradFile
from zeromem.offload.nvme import (BufferPool, IOHandle, OffloadError, SwapSpace,
                                  piece_bytes, piece_view)
from zeromem.offload.staged_masters import StagedMasters
from zeromem.offload.sub_groups import SubGroup, layout_optimizer
from zeromem.offload.updates import state_fields, update_for

if TYPE_CHECKING:  # placement.py builds this optimizer
    from zeromem.offload.params import ParamPlacement
    from zeromem.offload.placement import OffloadPolicy

Slot = dict[str, torch.Tensor]  # field name -> one pool buffer (aligned uint8), a sub-group's while in flight

class SwappedState(dict):
    """`SwappedOptimizer.state`: filled only inside `all_in_memory()`; a lookup outside raises.

    Iterating it outside (the memory ledger does) sees nothing: the states are on
    disk. Looking a master up outside raises instead of answering "no state", so a
    checkpoint can never be written without its optimizer states by mistake.
    """

    in_memory = False

    def _check(self) -> None:
        if not self.in_memory:
            raise OffloadError("the optimizer states are in NVMe swap files; read or write them "
                               "inside `with engine.offload.all_in_memory():`")

    def get(self, key: Any, default: Any = None) -> Any:
        self._check()
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._check()
        return super().__getitem__(key)


class SwappedOptimizer(torch.optim.Optimizer):
    """Adam, AdamW or SGD whose states (and master shard) live in a swap file.

    `param_groups` are those of the optimizer it replaces (LR schedulers work as usual);
    `state` is empty except inside `all_in_memory()`. `step()` runs the sub-group
    pipeline described in the module docstring.
    """

    state: SwappedState  # type: ignore[assignment]  # a dict that refuses lookups on disk

    def __init__(self, template: torch.optim.Optimizer, groups: list[FlatParamGroup],
                 space: SwapSpace, host_grads: dict[int, torch.Tensor] | GradFile,
                 params: ParamPlacement, policy: OffloadPolicy,
                 staged: StagedMasters | None = None):
        """`staged`: where `initialize` wrote the masters as it built the groups (else they
        are in memory), copied into this optimizer's file here. The step may run in the
        boundary backward (`step_in_backward`) when the policy allows it, the masters are
        the shards and params.swp keeps two copies of them (`ParamsOnNvme.copies`)."""
        # the template's own group dicts: a scheduler built over it (a client's optimizer,
        # zeromem.deepspeed) sets the lr this optimizer steps with
        super().__init__(template.param_groups, template.defaults)
        self.update = update_for(template)
        self.states = state_fields(template)
        self.master_in_file = not all(g.master_aliases_params() for g in groups)
        self.file_fields = (("master",) if self.master_in_file else ()) + self.states
        # gradients come from a file (stage 2/3) into a slot of their own, else from host memory
        self.grad_file = host_grads if isinstance(host_grads, GradFile) else None
        self.grad_multiplier = 1.0  # unscale and clip, applied as the gradients are read
        self.slot_fields = ("master",) + self.states + (("grad",) if self.grad_file else ())
        if policy.optimizer_buffers is not None:
            self._check_depth(policy.optimizer_buffers)
        self.layout = layout_optimizer(
            groups, len(self.states), self.master_in_file, self.grad_file is not None,
            policy.host_budget_bytes, params.pool_bytes(), policy.sub_group_size,
            policy.optimizer_buffers)
        self.size = self.layout.size
        self.sub_groups = self.layout.sub_groups
        # two copies of every record: the step reads the current one and writes the other,
        # which becomes current when the step is taken (`_commit`): a step begun in backward
        # can still be skipped, the states as they were (module docstring)
        self.two_copies = (policy.step_in_backward and self.grad_file is not None
                           and params.copies == 2)
        self.copy = 0  # the current copy of the records (two copies: 0 or 1)
        self.file = space.file("optimizer.swp", self.layout.file_bytes * (1 + self.two_copies))
        self.host_grads, self.params = host_grads, params
        # the step begun in the boundary backward, where nothing needs the whole gradient first
        self.in_backward = StepInBackward(self) if self.two_copies else None
        config = policy.optimizer_offload
        self.read_ahead, self.write_behind = config.pipeline_read, config.pipeline_write
        self.depth = self.size.depth
        self.pool = BufferPool(self.depth * len(self.slot_fields), self.layout.slot_bytes,
                               policy.optimizer_pin)
        self.slots = [{name: self.pool.take() for name in self.slot_fields}
                      for _ in range(self.depth)]
        self.steps = [0] * len(self.param_groups)  # optimizer steps taken, per param group
        self.failed: BaseException | None = None
        # sub-groups whose I/O overlapped other work in the last step: read ahead, written
        # behind, read in backward (`read_before_step`), their gradients too
        # (`_read_grads_early`), still written after `step()` returned
        self.overlapped = {"read_ahead": 0, "write_behind": 0, "before_step": 0,
                           "grads_before_step": 0, "after_step": 0, "in_backward": 0}
        # sub-group index -> (the slot it was written from, the writes) until waited for
        self.writes: dict[int, tuple[Slot, list[IOHandle]]] = {}
        # sub-group index -> (slot, reads) started by `read_before_step`, taken by the step
        self.early: dict[int, tuple[Slot, list[IOHandle]]] = {}
        # the groups the boundary backward has put in grads.swp since `read_before_step`, and
        # the early sub-groups whose gradient reads have started (`_read_grads_early`)
        self.put_in_backward: set[int] = set()
        self.grads_early: set[int] = set()
        if self.grad_file is not None:
            self.grad_file.on_put = self._read_grads_early
            self.grad_file.take = self._take
        self.state = SwappedState()
        if self.master_in_file:
            self._write_masters(groups, staged)

    def state_dict(self) -> dict:
        """torch's state dict; only inside `all_in_memory()` (outside, the states are on disk)."""
        self.state._check()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load inside `all_in_memory()`; the states reach the swap file when the block ends."""
        self.state._check()
        super().load_state_dict(state_dict)

    def _check_depth(self, buffer_count: int) -> int:
        per = len(self.slot_fields)
        if buffer_count < per:
            raise OffloadError(f"zero_optimization.offload_optimizer.buffer_count = {buffer_count} "
                               f"< {per} buffers one sub-group needs "
                               f"({' + '.join(self.slot_fields)})")
        return buffer_count // per

    def _write_masters(self, groups: list[FlatParamGroup], staged: StagedMasters | None) -> None:
        """Initial master values to the file (from `staged`, one group in memory at a time),
        then the masters give up their memory."""
        slot = self.slots[0]
        source: tuple[Any, torch.Tensor] | None = None  # the group whose master is in memory
        for sg in self.sub_groups:
            master = self._views(sg, slot)["master"]
            for p in sg.pieces:
                if staged is None:
                    values = p.group.master
                else:  # sub-groups walk the groups in order: each is read once
                    if source is None or source[0] is not p.group:
                        source = (p.group, staged.read(p.group))
                    values = source[1]
                master[p.at:p.at + p.numel].copy_(values[p.start:p.start + p.numel])
            self.file.write(slot["master"][:sg.field_bytes], sg.offset).wait()
        for g in groups:
            g.set_master_storage(torch.empty(0))
        if staged is not None:
            staged.discard()

    @staticmethod
    def _views(sg: SubGroup, slot: Slot) -> dict[str, torch.Tensor]:
        return {name: buf[:sg.numel * 4].view(torch.float32) for name, buf in slot.items()}

    # -- one sub-group ------------------------------------------------------------
    def _start_reads(self, i: int, slot: Slot) -> list[IOHandle]:
        """Start reading sub-group `i` into `slot`: fields, fp32 master pieces and gradients."""
        return self._start_state_reads(i, slot) + self._start_grad_reads(i, slot)

    def _start_state_reads(self, i: int, slot: Slot, chained: bool = False) -> list[IOHandle]:
        """Its fields and (fp32: the master is the parameter shard) its pieces of the shards,
        once the writes still in flight from `slot` and to `i`'s records have finished
        (`chained`: the reads start at once, and wait for the slot's writes in the I/O
        threads, not here)."""
        # a read into a buffer a write still reads would be stored (those finished are not
        # waited for: each piece's read asks whether all of `after` are done)
        after = [h for s, hs in self.writes.values() if s is slot for h in hs
                 if not h.done()] if chained else []
        if not chained:
            self._settle_slot(slot)
        self._settle(i)  # a read before the record's last write lands would miss it
        sg = self.sub_groups[i]
        if after and self.steps[sg.param_group] == 0:  # fresh states are zero-filled here
            self._settle_slot(slot)
            after = []
        handles = self._read_fields_async(sg, slot, after)
        if not self.master_in_file:
            for p, at in zip(sg.pieces, self._grad_places(sg)):
                handle = self.params.read_piece(p.group, p.start, p.numel, slot["master"][at:],
                                                after)
                if handle is not None:
                    handles.append(handle)
        return handles

    def _start_grad_reads(self, i: int, slot: Slot) -> list[IOHandle]:
        """Its gradient pieces from grads.swp (none to read: host gradients, stage 1)."""
        if self.grad_file is None:
            return []
        sg, handles = self.sub_groups[i], []
        for p, at in zip(sg.pieces, self._grad_places(sg)):
            _, handle = self.grad_file.read_piece(p.group, p.start, p.numel, slot["grad"][at:])
            if handle is not None:
                handles.append(handle)
        return handles

    def _masters(self, sg: SubGroup, slot: Slot) -> list[torch.Tensor]:
        """The master pieces in `slot`: cut from the field, or (fp32) as `read_piece` put them."""
        if self.master_in_file:
            master = self._views(sg, slot)["master"]
            return [master[p.at:p.at + p.numel] for p in sg.pieces]
        return [piece_view(p.start, p.numel, slot["master"][at:])
                for p, at in zip(sg.pieces, self._grad_places(sg))]

    def _compute(self, sg: SubGroup, slot: Slot) -> None:
        """Step the sub-group on its views (16-bit: then the new values, rounded, into the
        shards; with two copies, into the gradient buffer for `_start_writes`: the
        gradient is used up, and the shards in memory are the current copy)."""
        views = self._views(sg, slot)

        def cut(t: torch.Tensor) -> list[torch.Tensor]:
            return [t[p.at:p.at + p.numel] for p in sg.pieces]

        masters = self._masters(sg, slot)
        grads = self._grads(sg, slot)
        states = {name: cut(views[name]) for name in self.states}
        self.update(self.param_groups[sg.param_group], masters, grads, states,
                    self.steps[sg.param_group])
        if not self.master_in_file:
            return  # fp32: the masters are the shards' pieces, written in `_start_writes`
        for p, at, m in zip(sg.pieces, self._grad_places(sg), masters):
            if self.two_copies:
                piece_view(p.start, p.numel, slot["grad"][at:], p.group.param_shard.dtype).copy_(m)
            else:
                self.params.store(p.group, p.start, m)

    @staticmethod
    def _grad_places(sg: SubGroup) -> list[int]:
        """Byte position of each piece's aligned read in a sub-group's grad (or fp32 master)
        buffer."""
        places, at = [], 0
        for p in sg.pieces:
            places.append(at)
            at += piece_bytes(p.numel)
        return places

    def _grads(self, sg: SubGroup, slot: Slot) -> list[torch.Tensor]:
        """The sub-group's gradient pieces: read from the file (scaled here) or host buffers."""
        if not isinstance(self.host_grads, GradFile):
            return [self.host_grads[id(p.group)][p.start:p.start + p.numel] for p in sg.pieces]
        grads = [piece_view(p.start, p.numel, slot["grad"][at:])
                 for p, at in zip(sg.pieces, self._grad_places(sg))]
        if self.grad_multiplier != 1.0:
            torch._foreach_mul_(grads, self.grad_multiplier)
        return grads

    def _record(self, sg: SubGroup, copy: int) -> int:
        """File offset of `sg`'s record in copy `copy` (two copies: 0 or 1)."""
        return sg.offset + copy * self.layout.file_bytes

    def _write_fields(self, sg: SubGroup, slot: Slot, copy: int) -> list[IOHandle]:
        at = self._record(sg, copy)
        return [self.file.write(slot[name][:sg.field_bytes], at + k * sg.field_bytes)
                for k, name in enumerate(self.file_fields)]

    def _start_writes(self, i: int, slot: Slot) -> None:
        """Write sub-group `i`'s fields and (fp32, or two copies) its shard pieces from `slot`;
        recorded in `writes` until waited for (`_settle`), which may be after `step()`
        returns."""
        sg = self.sub_groups[i]
        handles = self._write_fields(sg, slot, 1 - self.copy if self.two_copies else self.copy)
        if not self.master_in_file or self.two_copies:
            pieces = slot["grad" if self.master_in_file else "master"]  # `_compute` put them there
            for p, at in zip(sg.pieces, self._grad_places(sg)):
                handles += self.params.write_piece(p.group, p.start, p.numel, pieces[at:])
        self.writes[i] = (slot, handles)

    def _settle(self, i: int) -> None:
        """Wait for sub-group `i`'s writes: its records are whole on disk, its slot reusable."""
        entry = self.writes.pop(i, None)
        for handle in entry[1] if entry is not None else ():
            handle.wait()

    def _settle_slot(self, slot: Slot) -> None:
        for i in [i for i, (s, _) in self.writes.items() if s is slot]:
            self._settle(i)

    def _settle_grad_buffer(self, slot: Slot) -> None:
        """Wait for the writes still reading `slot`'s gradient buffer, before a gradient goes
        into it: with two copies, 16-bit shards are written from there (`_compute`). fp32
        writes its shards from the master buffer: nothing to wait for, and backward goes on."""
        if self.master_in_file and self.two_copies:
            self._settle_slot(slot)

    def _written(self, slot: Slot) -> bool:
        """No write from `slot` is still running (a read may start into it without waiting)."""
        return all(h.done() for s, hs in self.writes.values() if s is slot for h in hs)

    def _last_write(self, slot: Slot) -> int:
        """The latest sub-group written from `slot` (-1: none): reuse the oldest first."""
        return max((i for i, (s, _) in self.writes.items() if s is slot), default=-1)

    # -- the pipeline -------------------------------------------------------------
    def allow_step_in_backward(self, allowed: bool, keep_gradients: bool) -> None:
        """`ZeroOptimizer`: whether nothing needs the whole gradient before the update (no
        loss scale, no model-parallel norm, a clip coefficient of 1 expected), so the
        boundary backward may step sub-groups (offload/backward_step.py); only with two
        copies of the records. `keep_gradients` (clipping): they go to grads.swp as well,
        for `step()` to redo the step from when the coefficient is below 1."""
        if self.in_backward is not None:
            self.in_backward.allowed, self.in_backward.keep_gradients = allowed, keep_gradients

    def read_before_step(self) -> None:
        """Start reading the first sub-groups' fields (fp32: and master pieces) now, in the
        backward that ends the step, so that the step starts with its first buffers full;
        or, where allowed, begin the step itself in this backward (`StepInBackward`).

        Their gradients are read at the step, once backward has written them. Nothing
        read here changes before the step: only the step writes these records (and
        `all_in_memory`, which drops these reads first)."""
        if self.failed is not None:
            return
        try:
            if self.in_backward is not None and self.in_backward.allowed:
                # unscaled and unclipped: a guess follows a step not clipped (`ZeroOptimizer`)
                assert self.grad_multiplier == 1.0, self.grad_multiplier
                self.in_backward.begin()
                return
            if self.early or not self.read_ahead:
                return
            free = sorted(self.slots, key=self._last_write)
            self.put_in_backward, self.grads_early = set(), set()
            for i in range(min(self.depth, len(self.sub_groups))):
                slot = free.pop(0)
                self.early[i] = (slot, self._start_state_reads(i, slot))
        except BaseException as e:
            self.failed = e
            raise

    def _take(self, group: FlatParamGroup, shard: torch.Tensor) -> bool:
        """`GradFile.put`: the boundary backward's reduced `shard` of `group`, stepped with its
        sub-groups where the step runs in backward; True: it need not be stored."""
        if self.in_backward is None or not self.in_backward.active or self.failed is not None:
            return False
        try:
            return self.in_backward.take(group, shard)
        except BaseException as e:
            self.failed = e
            raise

    def _read_grads_early(self, group: FlatParamGroup) -> None:
        """`GradFile.put` stored `group`'s gradient: start the gradient reads of each early
        sub-group whose groups' gradients this backward has all put and written.

        The boundary backward puts each group's final gradient once, so a record put
        since `read_before_step` no longer changes before the step."""
        if not self.early or self.failed is not None or self.grad_file is None:
            return
        self.put_in_backward.add(id(group))
        stored = self.grad_file.stored
        try:
            for i, (slot, handles) in self.early.items():
                pieces = self.sub_groups[i].pieces
                if i not in self.grads_early and all(
                        id(p.group) in self.put_in_backward and stored(p.group) for p in pieces):
                    self.grads_early.add(i)
                    handles += self._start_grad_reads(i, slot)
        except BaseException as e:
            self.failed = e
            raise

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # no closures
        """One optimizer step over every sub-group not stepped in backward: read ahead, step,
        write behind; then, with two copies, the copies written become current.

        The last sub-groups' writes are still in flight when it returns (with
        `pipeline_write`): waited for when their slot or record is next used, or by `settle`."""
        if self.failed is not None:
            raise OffloadError(f"NVMe offload failed earlier and the optimizer state on "
                               f"{self.file.path} is not trustworthy: {self.failed}")
        reading: dict[int, tuple[Slot, list[IOHandle]]] = {}
        try:
            if self.grad_file is not None:
                self.grad_file.flush()  # the last gradients' writes, before their reads
            if self.in_backward is not None and self.in_backward.active:
                reading, stepped = self.in_backward.finish()
                self._count(len(reading), 0, len(stepped))
            else:
                reading, stepped = self._reading_before_step(), set()
            taken = [s for s, _ in reading.values()]
            free = sorted((s for s in self.slots if not any(s is t for t in taken)),
                          key=self._last_write)
            todo = list(reading) + [i for i in range(len(self.sub_groups))
                                    if i not in reading and i not in stepped]
            self._pipeline(todo, free, reading)
        except BaseException as e:
            self.failed = e
            for handles in [h for _, h in reading.values()] + [h for _, h in self.writes.values()]:
                for h in handles:
                    with contextlib.suppress(BaseException):
                        h.wait()
            raise
        self.overlapped["after_step"] = sum(not all(h.settled for h in hs)
                                            for _, hs in self.writes.values())
        for pg in {sg.param_group for sg in self.sub_groups}:
            self.steps[pg] += 1
        self._commit()

    def _reading_before_step(self) -> dict[int, tuple[Slot, list[IOHandle]]]:
        """The sub-groups `read_before_step` began, with their gradient reads started."""
        reading, self.early = self.early, {}
        self._count(len(reading), len(self.grads_early), 0)
        for i, (slot, handles) in reading.items():
            if i not in self.grads_early:  # else read in backward (`_read_grads_early`)
                handles += self._start_grad_reads(i, slot)
        self.grads_early = set()
        return reading

    def _count(self, before_step: int, grads_before_step: int, in_backward: int) -> None:
        """Restart `overlapped`: sub-groups whose I/O (or update) overlapped other work."""
        self.overlapped = {"read_ahead": 0, "write_behind": 0, "before_step": before_step,
                           "grads_before_step": grads_before_step, "after_step": 0,
                           "in_backward": in_backward}

    def _commit(self) -> None:
        """Two copies: the step is taken, the copies it wrote are the records now."""
        if self.two_copies:
            self.copy = 1 - self.copy
            self.params.commit()

    def discard(self) -> None:
        """The step is skipped: what the boundary backward stepped was written to the copies
        not current, which stay so (the next step writes them whole again)."""
        self._count(0, 0, 0)  # nothing of it overlapped anything: it is not taken
        try:
            if self.in_backward is not None:
                self.in_backward.drop()
            if self.two_copies:
                self.params.discard()
            # the next step writes the same records, shared blocks maybe by other pieces: no
            # write of this one may land after those
            for i in list(self.writes):
                self._settle(i)
        except BaseException as e:
            self.failed = e
            raise

    def _pipeline(self, todo: list[int], free: list[Slot],
                  reading: dict[int, tuple[Slot, list[IOHandle]]]) -> None:
        """Step the sub-groups `todo` in order; `reading` those whose reads have begun."""
        subs = self.sub_groups
        queue = [i for i in todo if i not in reading]  # still to read, in order
        position = {i: k for k, i in enumerate(todo)}

        def read_ahead(k: int) -> None:
            """Into slots whose writes are done, up to `depth` sub-groups ahead of position k."""
            while queue and position[queue[0]] - k < self.depth:
                at = next((n for n, s in enumerate(free) if self._written(s)), None)
                if at is None:
                    return
                j, ready = queue.pop(0), free.pop(at)
                reading[j] = (ready, self._start_reads(j, ready))
                self.overlapped["read_ahead"] += 1

        for k, i in enumerate(todo):
            if i not in reading:  # read-ahead off, or no slot's write had finished
                queue.remove(i)
                slot = free.pop(0)  # the slot written longest ago
                reading[i] = (slot, self._start_reads(i, slot))
            slot, handles = reading.pop(i)
            for h in handles:
                h.wait()
            if self.read_ahead:
                read_ahead(k)
            self._compute(subs[i], slot)
            self._start_writes(i, slot)
            free.append(slot)
            if not self.write_behind:
                self._settle(i)
            elif self.read_ahead:
                read_ahead(k)  # a slot whose write finished while `i` stepped
            if self.write_behind and k + 1 < len(todo):
                self.overlapped["write_behind"] += 1  # stays in flight while the next steps

    def settle(self) -> None:
        """Wait for every read and write in flight; the reads `read_before_step` started are
        dropped (the step reads again), as is a step begun in backward (its step() never
        comes: the engine closes). Before the files are read or written whole."""
        early, self.early, self.grads_early = self.early, {}, set()
        try:
            if self.in_backward is not None:
                self.in_backward.drop()
            for _, handles in early.values():
                for h in handles:
                    h.wait()
            for i in list(self.writes):
                self._settle(i)
        except BaseException as e:
            self.failed = e
            raise

    # -- whole-state access (checkpoints, full_state_dict) --------------------------
    def _read_fields(self, sg: SubGroup, slot: Slot) -> None:
        for h in self._read_fields_async(sg, slot):
            h.wait()

    def _read_fields_async(self, sg: SubGroup, slot: Slot,
                           after: list[IOHandle] | None = None) -> list[IOHandle]:
        handles, at = [], self._record(sg, self.copy)
        for k, name in enumerate(self.file_fields):
            buf = slot[name][:sg.field_bytes]
            if name != "master" and self.steps[sg.param_group] == 0:
                buf.zero_()  # a fresh state is zeros: nothing to read
            else:
                handles.append(self.file.read(buf, at + k * sg.field_bytes, after or ()))
        return handles

    @contextlib.contextmanager
    def all_in_memory(self, groups: list[FlatParamGroup]) -> Iterator[None]:
        """Masters and states in memory as torch-style `state[master]` inside the block.

        On exit the (possibly replaced) tensors are written back to the file and the
        step counters taken from `state[master]["step"]`.
        """
        if self.in_backward is not None and self.in_backward.began():
            raise OffloadError("the optimizer states are read whole between a boundary backward "
                               "that began the step and its step(); save or load after step(), "
                               "or set zeromem.nvme_step_in_backward to false")
        self.settle()  # writes behind land, reads before the step are dropped: the file is whole
        slot = self.slots[0]
        self.state.in_memory = True
        if self.master_in_file:
            for g in groups:
                g.set_master_storage(torch.zeros(g.shard_numel))
        for g in groups:
            self.state[g.master] = {
                "step": torch.tensor(float(self.steps[g.param_group_index])),
                **{name: torch.zeros(g.shard_numel) for name in self.states}}
        for sg in self.sub_groups:
            self._read_fields(sg, slot)
            views = self._views(sg, slot)
            for p in sg.pieces:
                for name in self.file_fields:
                    whole = p.group.master if name == "master" else self.state[p.group.master][name]
                    whole[p.start:p.start + p.numel].copy_(views[name][p.at:p.at + p.numel])
        try:
            yield
        finally:
            self._write_in_memory(groups, slot)

    def _write_in_memory(self, groups: list[FlatParamGroup], slot: Slot) -> None:
        for g in groups:
            self.steps[g.param_group_index] = int(self.state[g.master]["step"])
        for sg in self.sub_groups:
            views = self._views(sg, slot)
            for p in sg.pieces:
                for name in self.file_fields:
                    whole = p.group.master if name == "master" else self.state[p.group.master][name]
                    views[name][p.at:p.at + p.numel].copy_(whole[p.start:p.start + p.numel])
            for h in self._write_fields(sg, slot, self.copy):
                h.wait()
        self.state = SwappedState()  # load_state_dict may have replaced the dict
        if self.master_in_file:
            for g in groups:
                g.set_master_storage(torch.empty(0))
