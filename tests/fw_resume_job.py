#!/usr/bin/env python3
"""Training job for the bit-exact resume test (tests/test_frameworks.py::test_bit_exact_resume).

Trains ``fw_common.TinyLM`` on CPU, deterministic (one thread, deterministic algorithms, seeded
torch + Python RNGs).  With ``--dir`` it checkpoints with TorchTitan's CheckpointManager logic
(``step-N/``, DCP, keep_latest_k purge thread).  ``--dump-dir`` records, after every update,
the loss, parameters, AdamW state and RNG states (the reference run does this without ``--dir``).
``--resume`` loads the newest *complete* checkpoint (DCP writes ``.metadata`` last), performs the
next update(s) and dumps them.  ``--stall-before-metadata N`` makes the save of step N stop after
its data files are written and fsynced but before ``.metadata`` (prints ``STALLED N``), so a test
can kill everything at that point.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import fw_common as C  # noqa: E402


class StallingWriter(FileSystemWriter):
    def finish(self, metadata, results):
        print(f"STALLED {self.stall_step}", flush=True)
        time.sleep(60)
        super().finish(metadata, results)


def dump(path: str, loss, model, opt) -> None:
    torch.save({"loss": loss, "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": C.flat_optim_tensors(opt), "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate()}, path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--dump-dir")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--updates", type=int, default=1, help="with --resume: updates to run")
    ap.add_argument("--stall-before-metadata", type=int, default=-1)
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(1234)
    model, opt = C.make_model(seed=0)
    app = C.AppState(model, opt)
    states = {"app": app, "step": torch.tensor(0)}
    mgr = None
    start = 0
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        mgr = C.TitanCheckpointManager(args.dir, states, interval=args.every,
                                       keep_latest_k=args.keep)
    if args.resume:
        step = mgr.load()
        if step < 0:
            print("NO COMPLETE CHECKPOINT", flush=True)
            return 3
        assert int(states["step"]) == step
        start = step
        print(f"RESUMED {step}", flush=True)
    end = start + args.updates if args.resume else args.steps
    for step in range(start + 1, end + 1):
        loss = C.train_step(model, opt)
        if args.dump_dir:
            dump(os.path.join(args.dump_dir, f"step-{step}.pt"), loss, model, opt)
        print(f"STEP {step} loss {loss.item():.6f}", flush=True)
        if mgr is not None and step % args.every == 0 and not args.resume:
            states["step"] = torch.tensor(step)
            print(f"SAVING {step}", flush=True)
            if step == args.stall_before_metadata:
                w = StallingWriter(mgr._create_checkpoint_id(step))
                w.stall_step = step
                dcp.save(states, storage_writer=w)
            else:
                mgr.save(step)
            print(f"SAVED {step}", flush=True)
    if mgr is not None:
        mgr.close()
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
