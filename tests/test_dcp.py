"""PyTorch Distributed Checkpoint (DCP) onto a retainzfs mount: save, load, remount, load.

Single process, CPU, no process group: DCP then saves and loads like rank 0 of a world of one,
through its FileSystemWriter (thread pool, tmp files renamed into place, fsync, .metadata).
"""
from __future__ import annotations

import json
import os

import pytest
import xattr
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from retainzfs import hints as H

torch.set_num_threads(1)       # tiny model; more threads only fight the daemon for the CPUs
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=512, d=128, heads=4, layers=2, seq=32):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d,
                                                 batch_first=True, dropout=0.0)
        self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        return self.head(self.enc(self.tok(x) + self.pos[: x.shape[1]]))


def make(seed: int):
    torch.manual_seed(seed)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def train_steps(model, opt, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 512, (4, 32), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.step_count += 1


def flat(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out.update(flat(dict(enumerate(v)), key + "."))
        else:
            out[key] = v
    return out


def assert_same(a, b):
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = fa[k], fb[k]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x, y), k
        else:
            assert x == y, k


def test_dcp_save_load_roundtrip(mounted):
    (mounted / "ckpt" / ".retainz").parent.mkdir()
    (mounted / "ckpt" / ".retainz").write_text('preset = "dcp"\nkeep_latest = 2\n')
    model, opt = make(0)
    train_steps(model, opt)
    msd, osd = get_state_dict(model, opt)
    ref = {"model": msd, "optim": osd, "extra": {"step": 300, "rng": torch.get_rng_state()}}
    ref = {k: v for k, v in ref.items()}
    saved = torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, ref)
    for step in (100, 200, 300):
        dcp.save(ref, checkpoint_id=str(mounted / "ckpt" / f"step-{step}"))
    files = sorted(os.listdir(mounted / "ckpt" / "step-300"))
    assert ".metadata" in files and any(f.endswith(".distcp") for f in files), files
    hint = json.loads(xattr.getxattr(mounted / "ckpt" / "step-300" / files[-1], H.XATTR_HINT))
    assert hint["birth"] == 300 and hint["reclaim"] == 500

    def load_into_fresh(path):
        m2, o2 = make(1)                         # different init: everything must come from disk
        train_steps(m2, o2, n=1, seed=9)         # optimizer state exists, with other values
        msd2, osd2 = get_state_dict(m2, o2)
        target = {"model": msd2, "optim": osd2,
                  "extra": {"step": 0, "rng": torch.zeros_like(saved["extra"]["rng"])}}
        dcp.load(target, checkpoint_id=str(path))
        set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
        return m2, o2, target

    m2, o2, loaded = load_into_fresh(mounted / "ckpt" / "step-300")
    assert_same(loaded, saved)
    assert_same(get_state_dict(m2, o2)[0], saved["model"])
    mounted.remount()
    m3, o3, loaded = load_into_fresh(mounted / "ckpt" / "step-300")
    assert_same(loaded, saved)
    msd3, osd3 = get_state_dict(m3, o3)
    assert_same(msd3, saved["model"])
    assert_same(osd3, saved["optim"])
    # the restored model and optimizer continue training exactly like the original
    train_steps(model, opt, n=2, seed=5)
    train_steps(m3, o3, n=2, seed=5)
    for (k, a), (_, b) in zip(model.state_dict().items(), m3.state_dict().items()):
        assert torch.equal(a, b), k
    # latest-K: drop the oldest generation; the others still load
    import shutil
    shutil.rmtree(mounted / "ckpt" / "step-100")
    _, _, loaded = load_into_fresh(mounted / "ckpt" / "step-200")
    assert_same(loaded, saved)
