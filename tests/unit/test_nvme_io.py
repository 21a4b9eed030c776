"""NVMe offload's I/O pieces and sub-group plan (offload/nvme.py, nvme_optimizer.py): no process group."""
from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest
import torch

from zeromem.offload.nvme import ALIGN, AsyncIO, BufferPool, SwapFile, aligned_empty
from zeromem.offload.nvme_optimizer import plan_sub_groups


def test_plan_sub_groups_covers_shards_within_param_groups():
    groups = [SimpleNamespace(shard_numel=n, param_group_index=pg)
              for n, pg in ((50, 0), (7, 1), (30, 0), (100, 1))]
    subs = plan_sub_groups(groups, 40)
    assert all(0 < sg.numel <= 40 for sg in subs)
    assert all(p.group.param_group_index == sg.param_group for sg in subs for p in sg.pieces)
    for g in groups:
        pieces = sorted((p.start, p.numel) for sg in subs for p in sg.pieces if p.group is g)
        assert pieces[0][0] == 0 and sum(n for _, n in pieces) == g.shard_numel
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    assert [sg.numel for sg in subs] == [40, 40, 40, 40, 27]  # 50+30 and 7+100 elements


def test_buffers_are_aligned_and_bounded():
    pool = BufferPool(3, 5000)
    assert pool.buffer_bytes == 2 * ALIGN and pool.nbytes == 6 * ALIGN + ALIGN
    bufs = [pool.acquire() for _ in range(3)]
    assert pool.acquire() is None and all(b.data_ptr() % ALIGN == 0 for b in bufs)
    assert aligned_empty(100).data_ptr() % ALIGN == 0


@pytest.mark.parametrize("direct", [True, False])
def test_swap_file_round_trip(tmp_path, monkeypatch, direct):
    syncs = []
    if not direct:  # a filesystem that refuses O_DIRECT: buffered I/O, and every write synced
        real_open, real_sync = os.open, os.fdatasync

        def no_direct(path, flags, *args):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", no_direct)
        monkeypatch.setattr(os, "fdatasync", lambda fd: syncs.append(fd) or real_sync(fd))
    io = AsyncIO(block_size=ALIGN, threads=4)  # several chunks per request
    f = SwapFile(tmp_path / "t.swp", 5 * ALIGN, io)
    data = aligned_empty(3 * ALIGN).copy_(torch.randint(0, 256, (3 * ALIGN,), dtype=torch.uint8))
    f.write(data, ALIGN).wait()
    back = aligned_empty(3 * ALIGN)
    f.read(back, ALIGN).wait()
    assert torch.equal(data, back) and f.direct is direct and bool(syncs) is not direct
    f.close()
    io.shutdown()
