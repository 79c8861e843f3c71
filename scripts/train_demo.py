#!/usr/bin/env python3
"""A small training job that checkpoints onto a directory the way TorchTitan does.

Trains a tiny transformer on CPU (built in code, synthetic tokens), saves a PyTorch DCP
checkpoint into ``step-N/`` every ``--every`` steps, keeps the latest ``--keep`` (older ones are
``shutil.rmtree``'d after the next save, like TorchTitan's ``keep_latest_k`` purge), and writes a
`.retainz` policy so the filesystem knows when each generation will be deleted.  At the end it
loads the newest checkpoint back and checks it equals the live model.

    python scripts/train_demo.py --dir /mnt/ckpt/run --steps 200 --every 10 --keep 3
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def state(model, opt, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": torch.tensor(step)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    os.makedirs(args.dir, exist_ok=True)
    with open(os.path.join(args.dir, ".retainz"), "w") as f:
        f.write(f'preset = "torchtitan"\nkeep_latest = {args.keep}\ncadence = {args.every}\n')
    model = TinyLM(dim=args.dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lossf = nn.CrossEntropyLoss()
    saves, t_save = 0, 0.0
    for step in range(1, args.steps + 1):
        x = torch.randint(0, 512, (8, 32))
        loss = lossf(model(x).flatten(0, 1), x.roll(1, dims=1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0:
            t0 = time.perf_counter()
            dcp.save(state(model, opt, step), checkpoint_id=os.path.join(args.dir, f"step-{step}"))
            t_save += time.perf_counter() - t0
            saves += 1
            gens = sorted((int(m.group(1)), n) for n in os.listdir(args.dir)
                          if (m := re.fullmatch(r"step-(\d+)", n)))
            for _, name in gens[:-args.keep]:
                shutil.rmtree(os.path.join(args.dir, name))
            print(f"step {step:5d} loss {loss.item():.4f} saved step-{step} "
                  f"(kept {min(len(gens), args.keep)})", flush=True)
    newest = max(int(m.group(1)) for n in os.listdir(args.dir) if (m := re.fullmatch(r"step-(\d+)", n)))
    probe = TinyLM(dim=args.dim)
    popt = torch.optim.AdamW(probe.parameters(), lr=1e-3)
    sd = state(probe, popt, 0)
    dcp.load(sd, checkpoint_id=os.path.join(args.dir, f"step-{newest}"))
    probe.load_state_dict(sd["model"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), probe.state_dict().values()))
    print(f"{saves} saves, mean save {1000 * t_save / max(saves, 1):.1f} ms; "
          f"reloaded step-{newest}: {'identical' if same else 'MISMATCH'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
