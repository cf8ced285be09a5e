"""Runs of several world sizes in one worker group (parity/driver/launch.py): a run of k workers in a group of W > k
trains on the group's first k ranks, in a process group of its own, while the other W − k wait; the whole group is
formed again after it. Starting a Ray Train worker group costs 10–15 s on 2 cores (its actors, and every worker's
imports), and the main job's three world sizes (DDP's 2, its noise reference's 1, the TP runs' 4) started three.

Ray Train's report is a collective of the whole worker group: every worker calls it as often (it agrees on the
checkpoint's folder), so a waiting rank reports whenever the run's rank 0 does, told through the group's store.
A run that stops every rank (RunStopped) tells the waiting ranks its line, so that the whole group stops on it."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from dataclasses import dataclass, field

import torch.distributed as dist

from parity.errors import COLLATERAL

TIMEOUT = datetime.timedelta(minutes=30)  # Ray Train's own process-group timeout (TorchConfig.timeout_s)
REPORT, DONE, STOP, FAILED = "report", "done", "stop:", "failed"
_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE")  # what DeepSpeed reads of the process group


@dataclass
class Part:
    """This rank's part in a run: whether it trains, and the line a run that stopped every rank stopped on."""

    trains: bool
    stopped: str | None = None
    _tell: list = field(default_factory=list)  # the running ranks' rank 0: [store, events told]


_current: Part | None = None


def before_report() -> None:
    """Before the run's ranks call Ray Train's report: the running ranks' rank 0 tells the waiting ranks to call it."""
    if _current is not None and _current._tell:
        _tell(_current, REPORT)


@contextlib.contextmanager
def ranks_for(k: int):
    """Yield this rank's Part in a run of `k` workers: the first k ranks of the current process group train in a group
    of their own (Part.trains); the others wait, reporting to Ray Train as the run does, until it ends. The whole group
    is formed again after a run that ended or stopped (a failure raises on, and Ray Train restarts the group). Both
    groups meet through the store the group was formed with (its launcher's), under keys of their own: no new port."""
    global _current
    world, rank, backend = dist.get_world_size(), dist.get_rank(), dist.get_backend()
    if k >= world:
        yield Part(trains=True)
        return
    base = _base_store()
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    _sessions[0] += 1  # every rank of the group counts the same sessions
    keys = f"parity_sub_world/{_sessions[0]}/"
    dist.destroy_process_group()
    part = Part(trains=rank < k)
    saved = {name: os.environ.get(name) for name in _ENV}
    try:
        if part.trains:
            os.environ.update(WORLD_SIZE=str(k), LOCAL_WORLD_SIZE=str(hosts[:k].count(hosts[rank])))
            _form(backend, dist.PrefixStore(keys + "run/", base), rank, k)
            events = dist.PrefixStore(keys + "events/", base)
            if rank == 0:
                part._tell = [events, 0]
            _current = part
            try:
                yield part
            except BaseException:
                if rank == 0:
                    _tell(part, FAILED)
                raise
            finally:
                _current = None
            if rank == 0:
                _tell(part, STOP + part.stopped if part.stopped else DONE)
            dist.destroy_process_group()
        else:
            yield part
            _wait(dist.PrefixStore(keys + "events/", base), part)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    _form(backend, dist.PrefixStore(keys + "group/", base), rank, world)
    _store[1] = dist.group.WORLD


def _form(backend: str, store, rank: int, size: int) -> None:
    """Form the process group over `store`, returning once every rank's is formed. Gloo's full mesh is connected on
    a rank when its own init returns, not yet on its peers: a rank that then destroys its group with no collective in
    between (the whole group formed again after a last run of fewer ranks, then left) closes a connection a peer is
    still setting up ("Connection closed by peer": twice in 5 suites, in the megatron-core replays' 1/3/1 groups; 2 to
    3 in 150 three-rank groups that form and leave at once, on loaded cores, none once each waits for the others)."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    formed = dist.PrefixStore("formed/", store)
    formed.set(str(rank), "1")
    formed.wait([str(r) for r in range(size)], TIMEOUT)


_sessions = [0]
_store: list = []  # [the launcher's store, the group formed again from it last]


def _base_store():
    """The store the launcher formed the group with (Ray Train's or a local group's), kept while its group is replaced;
    a group this module did not form is a launcher's, with its own store."""
    from torch.distributed.distributed_c10d import _get_default_store

    if not _store or dist.group.WORLD is not _store[1]:
        _store[:] = [_get_default_store(), None]
    return _store[0]


def _tell(part: Part, event: str) -> None:
    store, told = part._tell
    store.set(f"event_{told}", event)
    part._tell[1] = told + 1


def _wait(store, part: Part) -> None:
    """A waiting rank: report when told to, until the run ends (or stopped: its line; or failed: raise)."""
    told = 0
    while True:
        key = f"event_{told}"
        try:
            store.wait([key])
        except dist.DistStoreError:  # the store's timeout, not the run's: a run may train for longer
            continue
        event = store.get(key).decode()
        told += 1
        if event == REPORT:
            import ray.train

            ray.train.report({})
        elif event == DONE:
            return
        elif event.startswith(STOP):
            part.stopped = event[len(STOP):]
            return
        else:
            raise RuntimeError(f"{COLLATERAL[0]}: the run on the group's first ranks failed")


