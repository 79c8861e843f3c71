#!/usr/bin/env python3
"""4-rank PyTorch DCP job for tests/test_frameworks.py::test_dcp_multirank.

One process imports torch, then forks ``--ranks`` workers (torch.multiprocessing, fork: torch is
imported once, which matters on a 2-core machine) that form a gloo process group on CPU, shard
``fw_common.TinyLM`` with FSDP2 (``fully_shard``; parameters and AdamW state are DTensors), train
a few steps and save with ``dcp.save`` (``step-2``) and ``dcp.async_save`` on a separate gloo
group like TorchTitan (``step-4``).  Rank 0 keeps full (unsharded) copies of model + optimizer
state in ``--ref`` for comparison.  Then it writes ``--ref/SAVED`` and waits for ``--ref/GO`` (the
test unmounts and remounts meanwhile), loads both checkpoints into freshly built sharded models
and checks every tensor with ``torch.equal``.  Exit code 0 = all equal.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import fw_common as C  # noqa: E402


def build(mesh):
    model, opt = C.make_model(seed=0, dropout=0.0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt


def full_state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    # deep copy: CPU tensors (e.g. AdamW's ``step``) may be shared with the live optimizer
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(),
                                             {"model": msd, "optim": osd})


def compare(a, b, where: str) -> list[str]:
    bad = []
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys differ {sorted(set(a) ^ set(b))[:5]}"]
        for k in a:
            bad += compare(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            bad += compare(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        if not torch.equal(a, b):
            bad.append(where)
    elif a != b:
        bad.append(where)
    return bad


def worker(rank: int, ws: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.ref}/pg_init", rank=rank,
                            world_size=ws)
    mesh = init_device_mesh("cpu", (ws,))
    async_pg = dist.new_group(backend="gloo")          # TorchTitan: a separate group for async
    model, opt = build(mesh)
    torch.manual_seed(100 + rank)                       # each rank sees different data
    refs = {}
    for step in range(1, 5):
        C.train_step(model, opt, batch=4)
        if step in (2, 4):
            state = {"app": C.AppState(model, opt, with_rng=False)}
            ckpt = os.path.join(args.dir, f"step-{step}")
            if step == 2:
                dcp.save(state, checkpoint_id=ckpt)
            else:
                fut = dcp.async_save(state, checkpoint_id=ckpt, process_group=async_pg)
                fut.result()
            refs[step] = full_state(model, opt)
    dist.barrier()
    if rank == 0:
        torch.save(refs, os.path.join(args.ref, "refs.pt"))
        with open(os.path.join(args.ref, "SAVED"), "w") as f:
            f.write("ok")
    deadline = time.monotonic() + args.timeout
    while not os.path.exists(os.path.join(args.ref, "GO")):
        if time.monotonic() > deadline:
            raise TimeoutError("no GO from the test")
        time.sleep(0.1)
    dist.barrier()
    for step in (2, 4):
        fresh, fopt = build(mesh)
        state = {"app": C.AppState(fresh, fopt, with_rng=False)}
        dcp.load(state, checkpoint_id=os.path.join(args.dir, f"step-{step}"))
        got = full_state(fresh, fopt)
        if rank == 0:
            bad = compare(refs[step], got, f"step-{step}")
            if bad:
                raise AssertionError(f"rank {rank}: loaded state differs: {bad[:10]}")
            print(f"step-{step}: {len(refs[step]['model'])} model tensors and the AdamW state "
                  f"equal after reload", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="checkpoint folder (on the mount)")
    ap.add_argument("--ref", required=True, help="local scratch dir (not on the mount)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=180)
    args = ap.parse_args()
    args.ref, args.dir = os.path.abspath(args.ref), os.path.abspath(args.dir)
    os.makedirs(args.ref, exist_ok=True)
    mp.start_processes(worker, args=(args.ranks, args), nprocs=args.ranks, start_method="fork")
    print("ALL RANKS OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
