"""The NVMe optimizer's step, run in the boundary backward sub-group by sub-group (issue 16).

When nothing needs the whole gradient before the update (no fp16 loss scale, no
model-parallel norm, and a clip coefficient of 1 expected: `ZeroOptimizer` says so),
a sub-group can be stepped (fp32 or bf16) as soon as the boundary backward has
reduced every piece of its gradient: its states and master pieces are read while
backward goes on, the reduced shards' pieces are copied into its gradient buffer as
`GradFile.put` hands them over (`take`), and once all are in, Adam steps it and its
writes start.
The gradient then never goes to grads.swp nor is read back, and the update
overlaps backward instead of following it.

With gradient_clipping the coefficient is known only once the whole gradient is
(the global norm, at `step()`), so what backward steps is a guess that it is 1,
made while the last step's was (`ZeroOptimizer._predict`): the gradients also go to
grads.swp (`keep_gradients`), and a coefficient below 1 drops what backward stepped,
as a skipped step does (`drop`, below), and redoes the step from them in `step()`.
Either way the update is the one `step()` alone would make: a coefficient of 1
multiplies nothing.

    begin()            the boundary backward starts: the sub-groups expected first
                       (group order, in which the reductions come; then the order
                       the last boundary completed them in) are read into the free slots
    take(group, shard) a reduced shard: its pieces go to the slots of their sub-groups
                       (a sub-group with no slot free when its first piece comes is
                       left to `step()`, its gradient through grads.swp as before);
                       a sub-group whose pieces are all in is stepped at once, or,
                       its reads still running, at the next `take` (`_step_ready`)
    finish()           `step()`: the last ones are stepped; those still held (their
                       last gradients never came: zeros, or earlier micro-steps' sum
                       in grads.swp) go to the step's pipeline with the ones left to it
    drop()             the step is skipped, redone (a clip below 1), or the files are
                       needed whole

Bitwise the same update: the same sub-groups and pieces, the same kernel on the same
values (the shard that would have gone through grads.swp, which stores it exactly).

A skipped step (a non-finite global norm: DeepSpeed 0.19 skips it for fp32 and bf16
too, zero/stage3.py `step`) must leave the states and parameters as they were,
though some sub-groups were stepped before the last gradient, on any rank, was
known. So the step writes the other of two copies of every record (optimizer.swp
and params.swp, `SwappedOptimizer.two_copies`, `ParamsOnNvme.copies`), which becomes
current only when `step()` runs (`commit`); a skip leaves the current copies. The
same holds for every read before the commit: a unit re-gathered in the same backward
(tied weights), an evaluation between backward and step, see the old parameters.
The cost: twice the disk for optimizer states and parameter shards
(`zeromem.nvme_step_in_backward: false` turns it off).

Buffer lifetimes: the optimizer's pool only; a sub-group holds a slot from the
start of its reads to its step (or to `finish`), as in `step()`. A slot is read into
again as soon as its sub-group is stepped: the reads wait for its writes in the I/O
threads (`SwapFile.read(after=)`), so that they run while backward goes on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zeromem.flat import FlatParamGroup
from zeromem.offload.nvme import IOHandle, OffloadError, piece_view

if TYPE_CHECKING:  # the optimizer owns this object and hands itself in
    from zeromem.offload.nvme_optimizer import Slot, SwappedOptimizer

Held = dict[int, tuple["Slot", list[IOHandle]]]  # sub-group -> (its slot, reads in flight)


class StepInBackward:
    """The boundary backward's share of one `SwappedOptimizer` step (module docstring)."""

    def __init__(self, opt: SwappedOptimizer):
        self.opt = opt
        self.allowed = False  # `ZeroOptimizer`: nothing needs the whole gradient first
        # the gradients are stored too (clipping: the step is a guess that `step()` may redo)
        self.keep_gradients = False
        self.active = False  # a boundary backward is running, or ended without its step
        # the order gradients are expected to complete in: the groups' (`Comm.reduce_in_order`
        # launches the reductions in group order), then as the last boundary completed them
        self.order = list(range(len(opt.sub_groups)))
        self.pieces_of: dict[int, list[tuple[int, int]]] = {}  # group id -> (sub-group, piece)
        for i, sg in enumerate(opt.sub_groups):
            for k, p in enumerate(sg.pieces):
                self.pieces_of.setdefault(id(p.group), []).append((i, k))
        self.held: Held = {}
        self.arrived: dict[int, set[int]] = {}  # sub-group -> pieces whose gradient is in
        self.stepped: list[int] = []  # in the order they were stepped
        # held sub-groups whose gradient is all in, stepped once their reads are (`_step_ready`)
        self.ready: list[int] = []
        self.late: set[int] = set()  # left to `step()`: no slot when their first piece came
        self.settings: list[dict[str, Any]] = []  # the hyperparameters the update used

    def began(self) -> bool:
        """Has this backward taken a gradient (which then lives only here) since `begin`?"""
        return self.active and bool(self.arrived)

    def begin(self) -> None:
        """The boundary backward starts: read the sub-groups expected first."""
        if self.began():
            raise OffloadError("a second boundary backward before step(): the first one began "
                               "the step (zeromem.nvme_step_in_backward); call step() between, "
                               "or set \"zeromem\": {\"nvme_step_in_backward\": false} to "
                               "take several backwards a step")
        self.drop()
        self.active = True
        self.settings = _settings(self.opt.param_groups)
        self._read_expected()

    def take(self, group: FlatParamGroup, shard: torch.Tensor) -> bool:
        """`group`'s reduced gradient `shard`: its pieces into their sub-groups' slots, each
        sub-group stepped once all of its pieces are in. True: every piece was taken (the
        gradient need not be stored)."""
        if not self.active:
            return False
        self._step_ready(wait=True)  # read while the last unit's backward ran
        taken = True
        for i, k in self.pieces_of.get(id(group), ()):
            taken = self._take_piece(i, k, shard) and taken
        self._step_ready(wait=False)
        self._read_expected()  # into the slots just stepped: the reads wait for their writes
        return taken and not self.keep_gradients

    def finish(self) -> tuple[Held, set[int]]:
        """`step()` begins: (the sub-groups still held, with reads of their missing gradient
        pieces started; the sub-groups stepped already). The grads.swp writes are done."""
        opt = self.opt
        if _settings(opt.param_groups) != self.settings:
            raise OffloadError("an optimizer setting (the learning rate?) changed between the "
                               "boundary backward and step(), which had begun the update in "
                               "backward; change it before backward, or set "
                               "zeromem.nvme_step_in_backward to false")
        self._step_ready(wait=True)
        held, stepped = self.held, set(self.stepped)
        for i, (slot, handles) in held.items():
            opt._settle_grad_buffer(slot)  # as in `_take_piece`: read into below
            sg, got = opt.sub_groups[i], self.arrived.get(i, set())
            for k, (p, at) in enumerate(zip(sg.pieces, opt._grad_places(sg))):
                if k not in got:  # its group's gradient never came this backward
                    assert opt.grad_file is not None  # two copies only with grads.swp
                    _, handle = opt.grad_file.read_piece(p.group, p.start, p.numel,
                                                         slot["grad"][at:])
                    if handle is not None:
                        handles.append(handle)
        self.order = self.stepped + [i for i in self.order if i not in stepped]
        self.held, self.active = {}, False
        return held, stepped

    def drop(self) -> None:
        """Forget this backward's share (a skipped step, or the files needed whole): reads in
        flight are waited for; what was stepped was written to the copies not current."""
        held, self.held, self.active = self.held, {}, False
        self.arrived, self.stepped, self.late, self.ready = {}, [], set(), []
        for _, handles in held.values():
            for h in handles:
                h.wait()

    # -- one piece, one sub-group ---------------------------------------------------
    def _take_piece(self, i: int, k: int, shard: torch.Tensor) -> bool:
        opt = self.opt
        if i in self.late:
            return False
        if i not in self.held:
            if i in self.arrived:
                raise OffloadError(f"sub-group {i} was stepped in backward before all of its "
                                   "gradient came")
            slot = self._free_slot() or self._unexpect() or self._step_ready(wait=True, most=1)
            if slot is None:  # every slot waits for gradients still to come
                self.late.add(i)
                return False
            self.held[i] = (slot, opt._start_state_reads(i, slot, chained=True))
        slot = self.held[i][0]
        # bf16's new shards were written from this slot's gradient buffer (two copies): that
        # write must end before a gradient goes in (the field reads wait in the I/O threads)
        opt._settle_grad_buffer(slot)
        sg = opt.sub_groups[i]
        p, at = sg.pieces[k], opt._grad_places(sg)[k]
        piece_view(p.start, p.numel, slot["grad"][at:]).copy_(shard[p.start:p.start + p.numel])
        got = self.arrived.setdefault(i, set())
        got.add(k)
        if len(got) == len(sg.pieces):
            self.ready.append(i)
        return True

    def _step_ready(self, wait: bool, most: int | None = None) -> Slot | None:
        """Step the sub-groups whose gradient is all in, in order: those whose reads are done
        (`wait`: all, up to `most`, waiting for their reads). A read still running when its
        gradient comes (started just then, behind a write) thus runs on while backward
        goes on, its sub-group held to the next `take`. Returns the slot freed last."""
        slot = None
        done = [i for i in self.ready if all(h.done() for h in self.held[i][1])]
        first = done + [i for i in self.ready if i not in done]  # those read already first
        for i in first if most is None else first[:most]:
            if not wait and i not in done:
                continue
            self.ready.remove(i)
            slot = self._step(i)
        return slot

    def _step(self, i: int) -> Slot:
        """All of sub-group `i`'s gradient is in: step it, start its writes (other copy)."""
        opt = self.opt
        slot, handles = self.held.pop(i)
        for h in handles:
            h.wait()
        opt._compute(opt.sub_groups[i], slot)
        opt._start_writes(i, slot)
        if not opt.write_behind:  # offload_optimizer.pipeline_write off: waited here too
            opt._settle(i)
        self.stepped.append(i)
        return slot

    def _read_expected(self) -> None:
        """Start reading the next expected sub-groups into the free slots; a read into a slot
        whose write is still running waits for it in the I/O threads, not here (the
        backward goes on)."""
        if not self.opt.read_ahead:
            return
        seen = set(self.held) | set(self.arrived) | self.late
        expected = (i for i in self.order if i not in seen)
        while (slot := self._free_slot()) is not None:
            i = next(expected, None)
            if i is None:
                return
            self.held[i] = (slot, self.opt._start_state_reads(i, slot, chained=True))

    def _unexpect(self) -> Slot | None:
        """The slot of the held sub-group expected last that no gradient reached yet (its
        reads waited for and forgotten: it was expected wrongly), or None."""
        unreached = [i for i in self.held if i not in self.arrived]
        if not unreached:
            return None
        i = max(unreached, key=self.order.index)
        slot, handles = self.held.pop(i)
        for h in handles:
            h.wait()
        return slot

    def _free_slot(self) -> Slot | None:
        """A slot no sub-group holds, the one written longest ago, or None."""
        opt = self.opt
        taken = [s for s, _ in self.held.values()]
        free = [s for s in opt.slots if not any(s is t for t in taken)]
        return min(free, key=opt._last_write, default=None)


def _settings(groups: list[dict]) -> list[dict[str, Any]]:
    """The param groups' hyperparameters (all but the parameters), as plain values."""
    return [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
            for g in groups]
