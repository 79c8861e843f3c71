"""One rank of tests/test_two_node.py: nvidia-resiliency-ext local checkpoints with replication
across two "nodes" (two retainzfs mounts).  Ranks 0-1 are on node A, 2-3 on node B.

``--phase save``: every rank trains its own model shard a little and saves iterations 10, 20
and 30 with ``LocalCheckpointManager`` into ``<its node's mount>/ckpt`` and nvrx's
``LazyCliqueReplicationStrategy(replication_jump=2, replication_factor=2)``: cliques {0, 2} and
{1, 3}, so every rank's checkpoint has a copy on the other node.  The tensors saved at the last
iteration go to ``--ref`` (outside both mounts) for the comparison after the failure.

``--phase load``: after node A's image was destroyed and a fresh one mounted, every rank calls
``find_latest`` + ``load``.  nvrx 0.4.1 retrieves a missing checkpoint from its replica holder
with ``GroupWrapper.isend_state_dict`` / ``irecv_state_dict``, which move every tensor through
CUDA (``ten.cuda()``, ``torch.empty_like(ten, device='cuda')``) even on a gloo group; on CPU that
raises ``Torch not compiled with CUDA enabled`` on every rank of a clique that must exchange.  The
error is printed (the test asserts it) and the same bytes are replicated over torch.distributed
collectives instead: the surviving holder reads the replica file from its node's mount and sends
it (gloo send/recv of a uint8 tensor) to the rank that lost it, which writes it node-locally the
way nvrx does (``.dirty`` then rename) — its own checkpoint and its clique peer's copy, so the
redundancy is back too.  A fresh ``LocalCheckpointManager`` then loads locally; the loaded
tensors are compared bit for bit with ``--ref``.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fw_common as C  # noqa: E402

from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (  # noqa: E402
    LocalCheckpointManager)
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (  # noqa: E402
    LazyCliqueReplicationStrategy)

ITERS = (10, 20, 30)
SESSION = "job"


def node_root(args, rank: int) -> pathlib.Path:
    return pathlib.Path(args.mnt_a if rank < 2 else args.mnt_b) / "ckpt"


def peer(rank: int) -> int:
    return (rank + 2) % 4                      # clique {0, 2}, {1, 3}


def manager(args, rank):
    return LocalCheckpointManager(node_root(args, rank), session_id=SESSION,
                                  repl_strategy=LazyCliqueReplicationStrategy(
                                      replication_jump=2, replication_factor=2))


def state(model, opt, it):
    """A state dict nvrx may take apart: the replication pops the tensors out of the dicts in
    place (``dict_list_map_inplace``), and ``opt.state_dict()`` shares its per-parameter dicts
    with the live optimizer, so it is deep-copied (else the next ``opt.step()`` fails)."""
    import copy
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(opt.state_dict()), "iteration": it}


def phase_save(args, rank):
    model, opt = C.make_model(seed=100 + rank, dim=96)
    mgr = manager(args, rank)
    for it in range(1, ITERS[-1] + 1):
        C.train_step(model, opt, batch=4)
        if it in ITERS:
            mgr.save(C.CPUTensorAwareStateDict(state(model, opt, it)), it)
            print(f"rank {rank}: saved iteration {it}", flush=True)
    ref = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "optimizer": C.flat_optim_tensors(opt)}
    torch.save(ref, pathlib.Path(args.ref) / f"rank{rank}.pt")
    d = node_root(args, rank) / SESSION / str(rank)
    print(f"rank {rank}: files {sorted(os.listdir(d))}", flush=True)


def send_bytes(data: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def recv_bytes(src: int) -> bytes:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src)
    buf = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(buf, src)
    return buf.numpy().tobytes()


def rereplicate(args, rank, it: int) -> None:
    """Ranks whose node-local dir lost its files get them back from their clique peer: their own
    checkpoint (the peer's replica of it) and the peer's checkpoint (so both nodes hold a copy
    again).  Plain gloo point-to-point of the file bytes."""
    mine = node_root(args, rank) / SESSION / str(rank)
    mine.mkdir(parents=True, exist_ok=True)
    names = [f"iter_{it:07d}_{r}_local.pt" for r in (rank, peer(rank))]
    have = all((mine / n).exists() for n in names)
    needs = [None] * 4
    dist.all_gather_object(needs, not have)
    p = peer(rank)
    if needs[rank] and needs[p]:
        raise SystemExit(f"rank {rank}: both copies of clique {{{rank}, {p}}} are lost")
    if needs[p]:                     # send what my peer lost: its own file and mine
        for r in (p, rank):
            send_bytes((mine / f"iter_{it:07d}_{r}_local.pt").read_bytes(), p)
        print(f"rank {rank}: sent 2 files to rank {p}", flush=True)
    elif needs[rank]:
        for r in (rank, p):
            data = recv_bytes(p)
            tmp = mine / f"iter_{it:07d}_{r}_local.dirty.pt"
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.rename(mine / f"iter_{it:07d}_{r}_local.pt")
        print(f"rank {rank}: restored 2 files from rank {p}", flush=True)
    dist.barrier()


def phase_load(args, rank):
    mgr = manager(args, rank)
    latest = mgr.find_latest()
    print(f"rank {rank}: find_latest -> {latest}", flush=True)
    assert latest == ITERS[-1], latest
    try:
        mgr.load()
        print(f"rank {rank}: nvrx retrieval worked without CUDA", flush=True)
    except Exception as e:             # nvrx 0.4.1 on CPU: see the module docstring
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        print(f"rank {rank}: nvrx retrieval failed: {tb}", flush=True)
        dist.barrier()
        rereplicate(args, rank, latest)
    mgr = manager(args, rank)
    assert mgr.find_latest() == latest
    tasd, ckpt_id = mgr.load()
    assert ckpt_id == (latest, rank, SESSION), ckpt_id
    sd = tasd.state_dict
    ref = torch.load(pathlib.Path(args.ref) / f"rank{rank}.pt")
    assert sd["iteration"] == latest
    assert set(sd["model"]) == set(ref["model"])
    for k, v in ref["model"].items():
        assert torch.equal(v, sd["model"][k]), k
    model, opt = C.make_model(seed=7, dim=96)
    C.train_step(model, opt, batch=4)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    got = C.flat_optim_tensors(opt)
    assert set(got) == set(ref["optimizer"])
    assert all(torch.equal(ref["optimizer"][k], got[k]) for k in got)
    print(f"rank {rank}: resumed iteration {latest} bit-exact "
          f"({len(ref['model'])} model tensors, {len(got)} optimizer tensors)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("save", "load"), required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--mnt-a", required=True)
    ap.add_argument("--mnt-b", required=True)
    ap.add_argument("--ref", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(args.store, 4), rank=args.rank,
                            world_size=4, timeout=timedelta(seconds=90))
    try:
        (phase_save if args.phase == "save" else phase_load)(args, args.rank)
        dist.barrier()
        print(f"rank {args.rank}: OK", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
