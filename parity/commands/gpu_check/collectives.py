"""gpu_check.sh's collectives step (parity/commands/gpu_check/check.py): every collective the strategies use — theirs,
FSDP2's and DTensor's — tried on 2 local ranks over gloo with the run's tensors (CUDA ones on a GPU, both ranks on
cuda:0), in fp32 and bf16, each result checked: which work, which do not."""

from __future__ import annotations

import datetime
import json
import os
import socket
import time

from parity.commands.common import error_line


def step_collectives(folder: str, device: str, sizes: dict) -> dict:
    """Every collective the strategies use (theirs, FSDP2's and DTensor's), tried on 2 local ranks over gloo with
    tensors on `device` (both ranks on cuda:0), in fp32 and bf16, each result checked."""
    from parity.driver.local_group import start_processes

    os.makedirs(folder, exist_ok=True)
    result = os.path.join(folder, "collectives.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for r in range(2):  # an earlier check's progress
        if os.path.exists(f"{result}.rank{r}"):
            os.remove(f"{result}.rank{r}")
    try:
        start_processes(_collectives_rank, (2, port, device, sizes["numel"], result), 2, device=device)
    except Exception as exc:  # a rank that dies (gloo with CUDA tensors crashed so): the collective it was in
        begun = {r: _last_begun(result, r) for r in range(2)}
        raise RuntimeError(f"{str(exc).strip().splitlines()[-1]} in " + ", ".join(
            f"rank {r}'s {what}" for r, what in begun.items() if what)) from exc
    with open(result) as f:
        tried = json.load(f)
    failing = [f"{name} {dtype}" for name, by_dtype in tried.items() for dtype, r in by_dtype.items() if not r["ok"]]
    return {"backend": "gloo", "tensors_on": device, "ranks": 2, "results": tried,
            "working": sorted(name for name, by in tried.items() if all(r["ok"] for r in by.values())),
            "failures": [f"gloo refuses or miscomputes: {', '.join(failing)}"] if failing else []}


def _last_begun(result: str, rank: int) -> str | None:
    """The collective `rank` began last ("name dtype"), or None."""
    try:
        with open(f"{result}.rank{rank}") as f:
            lines = f.read().split()
    except FileNotFoundError:
        return None
    return " ".join(lines[-2:]) or None


def _collectives_rank(rank: int, world: int, port: int, device: str, numel: int, result: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if device == "cuda":
        torch.cuda.set_device(0)
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD

    def full(value, n=numel, dtype=torch.float32):
        return torch.full((n,), float(value), dtype=dtype, device=where)

    def same(t, value) -> bool:
        return t.device.type == where.type and bool((t.float() == value).all())

    def all_reduce(dt):
        t = full(rank + 1, dtype=dt)
        dist.all_reduce(t)
        return same(t, 3)

    def all_reduce_max(dt):
        t = full(rank + 1, dtype=dt)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return same(t, 2)

    def broadcast(dt):
        t = full(rank + 5, dtype=dt)
        dist.broadcast(t, src=0)
        return same(t, 5)

    def all_gather(dt):
        outs = [full(0, dtype=dt) for _ in range(world)]
        dist.all_gather(outs, full(rank + 1, dtype=dt))
        return all(same(o, i + 1) for i, o in enumerate(outs))

    def all_gather_into_tensor(dt):
        out = full(0, world * numel, dt)
        dist.all_gather_into_tensor(out, full(rank + 1, dtype=dt))
        return all(same(c, i + 1) for i, c in enumerate(out.chunk(world)))

    def reduce_scatter_tensor(dt):
        out = full(0, dtype=dt)
        dist.reduce_scatter_tensor(out, full(rank + 1, world * numel, dt))
        return same(out, 3)

    def all_to_all_single(dt):
        out = full(0, world * numel, dt)
        dist.all_to_all_single(out, torch.cat([full(rank * 10 + j, dtype=dt) for j in range(world)]))
        return all(same(c, i * 10 + rank) for i, c in enumerate(out.chunk(world)))

    def send_recv(dt):
        t = full(7 if rank == 0 else 0, dtype=dt)
        dist.send(t, dst=1) if rank == 0 else dist.recv(t, src=0)
        return same(t, 7)

    def batch_isend_irecv(dt):  # the pipeline's P2P
        other = 1 - rank
        got = full(0, dtype=dt)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, full(rank + 1, dtype=dt), other),
                                            dist.P2POp(dist.irecv, got, other)]):
            work.wait()
        return same(got, other + 1)

    def funcol_all_reduce(dt):  # DTensor's
        return same(funcol.wait_tensor(funcol.all_reduce(full(rank + 1, dtype=dt), "sum", group)), 3)

    def funcol_all_gather_tensor(dt):
        out = funcol.wait_tensor(funcol.all_gather_tensor(full(rank + 1, dtype=dt), 0, group))
        return all(same(c, i + 1) for i, c in enumerate(out.chunk(world)))

    def funcol_reduce_scatter_tensor(dt):
        out = funcol.wait_tensor(funcol.reduce_scatter_tensor(full(rank + 1, world * numel, dt), "sum", 0, group))
        return same(out, 3)

    def all_gather_object(dt):
        outs = [None] * world
        dist.all_gather_object(outs, {"rank": rank})
        return outs == [{"rank": i} for i in range(world)]

    def broadcast_object_list(dt):
        objs = [rank + 3]
        dist.broadcast_object_list(objs, src=0)
        return objs == [3]

    def barrier(dt):
        dist.barrier()
        return True

    tensor_ops = (all_reduce, all_reduce_max, broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor,
                  all_to_all_single, send_recv, batch_isend_irecv, funcol_all_reduce, funcol_all_gather_tensor,
                  funcol_reduce_scatter_tensor)
    results = {}
    for op in (*tensor_ops, all_gather_object, broadcast_object_list, barrier):
        dtypes = (torch.float32, torch.bfloat16) if op in tensor_ops else (None,)
        for dt in dtypes:
            key = str(dt).replace("torch.", "") if dt else "object"
            with open(f"{result}.rank{rank}", "a") as begun:  # a crash's collective (step_collectives)
                begun.write(f"{op.__name__} {key}\n")
            t0 = time.perf_counter()
            try:
                ok, error = bool(op(dt)), None
                if device == "cuda":
                    torch.cuda.synchronize()
                if not ok:
                    error = "wrong result"
            except Exception as exc:  # this collective does not take these tensors: say so, try the next
                ok, error = False, error_line(exc)
            results.setdefault(op.__name__, {})[key] = {"ok": ok, "error": error,
                                                        "seconds": time.perf_counter() - t0}
    if rank == 0:
        with open(result, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
