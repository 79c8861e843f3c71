"""The real framework packages on a real retainzfs mount (issue 11 item 1).

TorchTitan 0.3.0 (``torchtitan.components.checkpointer.dcp.CheckpointManager``), megatron-core
0.16.1 (``megatron.core.dist_checkpointing``) and nvidia-resiliency-ext 0.4.1
(``LocalCheckpointManager``), installed by scripts/setup.sh, write checkpoints through
``mount.retainzfs`` (tests/conftest.py) the way they do upstream.  Every test checks

* the hints the filesystem derived from the `.retainz` preset, read through the ``xattr`` package
  (virtual xattr ``user.retainz.hint``);
* the retention the framework (or, for megatron-core, which has none, the training script)
  performed, and that the zones of deleted generations were reset (zone map read from the
  root's ``user.retainz.zonemap.*`` xattrs, counters from ``user.retainz.status``);
* byte-exact data after unmount/remount and a bit-exact load back into fresh objects.

A package that is not installed skips the test with the reason, except under ``CI=true`` where
the ImportError fails it.  A package that runs on CPU is not skipped; where it calls CUDA-only
functions a small shim is documented at the call site.
"""
from __future__ import annotations

import copy
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
import xattr  # noqa: E402

import fw_common as C  # noqa: E402
from retainzfs import hints as H

torch.set_num_threads(1)          # leave the second core to the FUSE daemon
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def hint(path) -> dict:
    import json
    return json.loads(xattr.getxattr(os.fspath(path), H.XATTR_HINT))


def assert_hints(files, birth: int, reclaim, source: str = "policy") -> None:
    assert files
    for f in files:
        h = hint(f)
        assert (h["birth"], C.reclaim(h), h["source"]) == (birth, float(reclaim), source), (f, h)
        if os.path.getsize(f):
            assert C.zones_of(f), f"{f}: data but no zones"


def zones_below(path) -> set[int]:
    files = C.files_below(path) if os.path.isdir(path) else [os.fspath(path)]
    return {z for f in files for z in C.zones_of(f)}


@pytest.fixture
def gloo_world1(tmp_path):
    """A one-rank gloo process group (FileStore), torn down after the test."""
    dist = torch.distributed
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg.store"), 1),
                            rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def tensors_equal(a, b, where="") -> None:
    """Deep bit-exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            tensors_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            tensors_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


# ------------------------------------------------------------------------------- TorchTitan
class TrainState:
    """TorchTitan's train_state Stateful (Trainer.state_dict: step + ntokens_seen)."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def titan_job(folder, async_mode: str, seed: int, keep_latest_k: int = 3):
    """Model, OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader, train_state and
    a CheckpointManager, all built from their torchtitan Configs."""
    C.require("torchtitan")
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    model, _ = C.make_model(seed=seed, dim=128)
    ocfg = default_adamw(lr=3e-3)
    ocfg.implementation = "for-loop"          # "fused" (the default) is CUDA only
    opt = ocfg.build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=3, decay_type="cosine").build(
        optimizers=opt, training_steps=40)
    g = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randint(0, C.VOCAB, (400, 24), generator=g))
    dl = ParallelAwareDataloader(data, dp_rank=0, dp_world_size=1, batch_size=4)
    ts = TrainState()
    cfg = CheckpointManager.Config(enable=True, folder=os.path.basename(folder), interval=2,
                                   keep_latest_k=keep_latest_k, async_mode=async_mode,
                                   last_save_model_only=False)
    mgr = cfg.build(dataloader=dl, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                    states={"train_state": ts}, sd_adapter=None,
                    base_folder=os.path.dirname(folder))
    return mgr, model, opt, sched, dl, ts


def titan_step(model, opt, sched, batch) -> None:
    (x,) = batch
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_torchtitan_checkpoint_manager(mounted, gloo_world1, async_mode, monkeypatch):
    """TorchTitan's CheckpointManager (interval 2, keep_latest_k 3) saves step-N DCP dirs while
    its purge thread rmtree's the old ones beside the next save; resume from the newest complete
    step restores model, optimizer, lr scheduler, dataloader and train state bit for bit."""
    C.require("torchtitan")
    from torchtitan.tools import filesystem
    folder = mounted / "titan" / "checkpoint"
    folder.mkdir(parents=True)
    # async: the purge lists the folder right after the next save was dispatched, before that
    # save's thread made its step-N dir, so between saves one more generation stays on disk
    # (keep_latest_k + 1): that is the retention the filesystem is told
    keep = 3 if async_mode == "disabled" else 4
    (folder / ".retainz").write_text(f'preset = "torchtitan"\nkeep_latest = {keep}\n')

    purges: list[tuple[str, bool]] = []        # (path, a save was still in flight at its start)
    real_rmtree = filesystem.rmtree
    mgr_box: list = []

    def rmtree_logged(path):
        fut = mgr_box[0].save_future if mgr_box else None
        purges.append((os.path.basename(path), fut is not None and not fut.done()))
        real_rmtree(path)
    # the manager hands filesystem.rmtree to its purge thread at construction: wrap it to log
    monkeypatch.setattr(filesystem, "rmtree", rmtree_logged)

    mgr, model, opt, sched, dl, ts = titan_job(os.fspath(folder), async_mode, seed=0)
    mgr_box.append(mgr)
    it = iter(dl)
    gen_zones: dict[int, set[int]] = {}
    for step in range(1, 13):
        titan_step(model, opt, sched, next(it))
        ts.step, ts.ntokens_seen = step, step * 4 * 24
        try:
            mgr.save(step)
        except AssertionError as e:
            if async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
                mgr.close()
                pytest.skip(f"async_with_pinned_mem needs an accelerator: torch's DefaultStager "
                            f"(pinned memory, non-blocking copy) raised on CPU: {e}")
            raise
        if step % 2 == 0 and step > 2:
            mgr.maybe_wait_for_saving()          # previous generation complete: its zones
            prev = folder / f"step-{step - 2}"
            if prev.exists() and (prev / ".metadata").exists():
                gen_zones.setdefault(step - 2, zones_below(prev))
    mgr.maybe_wait_for_saving()
    gen_zones[12] = zones_below(folder / "step-12")
    mgr.close()                                   # joins the purge thread
    left = sorted(int(n[5:]) for n in os.listdir(folder) if n.startswith("step-"))
    if async_mode == "disabled":
        assert left == [8, 10, 12], left
    else:
        assert left[-3:] == [8, 10, 12] and len(left) <= 4, left
    gone = sorted(set(range(2, 13, 2)) - set(left))
    assert sorted({p for p, _ in purges}) == [f"step-{s}" for s in gone], (purges, left)
    if async_mode != "disabled":
        # purge runs while the next async save is still writing (at least once)
        assert any(inflight for _, inflight in purges), purges
    # births from the names; cadence 2 inferred from the siblings; reclaim = birth + 2 * keep
    for s in left:
        files = C.files_below(folder / f"step-{s}")
        assert sorted(os.path.basename(f) for f in files) == [".metadata", "__0_0.distcp"]
        assert_hints(files, s, s + 2 * keep)
    st = mounted.status()
    assert st["gc_copied_bytes"] == 0 and not st["capacity_stop"], st
    C.assert_zones_reset(mounted.path, set().union(*(gen_zones[s] for s in gone)), st, 12)

    # what the run would see next: the model/optimizer/scheduler/train state saved at step 12 ...
    want_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want_opt = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                for k, v in opt.state_dict().items()}
    want_lr = [s.get_last_lr() for s in sched]
    want_sched = sched.state_dict()
    want_batch = next(it)[0].clone()            # ... and the batch after step 12

    # a save that died half way (no .metadata): resume must skip it
    (folder / "step-14").mkdir()
    (folder / "step-14" / "__0_0.distcp").write_bytes(os.urandom(1 << 20))
    before = C.tree_digest(folder)
    mounted.remount()
    assert C.tree_digest(folder) == before
    for s in left:
        assert_hints(C.files_below(folder / f"step-{s}"), s, s + 2 * keep)

    mgr2, m2, o2, s2, dl2, ts2 = titan_job(os.fspath(folder), "disabled", seed=7)
    assert not all(torch.equal(v, m2.state_dict()[k]) for k, v in want_model.items())  # fresh
    assert mgr2.load() is True
    mgr2.close()
    assert (ts2.step, ts2.ntokens_seen) == (12, 12 * 4 * 24)
    tensors_equal(want_model, {k: v for k, v in m2.state_dict().items()}, "model")
    tensors_equal(want_opt, o2.state_dict(), "optimizer")
    assert s2.state_dict() == want_sched and [s.get_last_lr() for s in s2] == want_lr
    assert torch.equal(next(iter(dl2))[0], want_batch)
    # one more identical step from both: the resumed run continues exactly
    torch.manual_seed(5)
    titan_step(model, opt, sched, (want_batch,))
    torch.manual_seed(5)
    titan_step(m2, o2, s2, (want_batch,))
    tensors_equal(model.state_dict(), m2.state_dict(), "model after one more step")


# -------------------------------------------------------------------------------- megatron-core
def megatron_cpu_shim(monkeypatch) -> None:
    """megatron-core 0.16.1's dist_checkpointing calls two CUDA-only functions on its CPU path:
    ``torch.cuda.synchronize()`` before writing (strategies/filesystem_async.py
    ``preload_tensors``) and ``torch.cuda.current_device()`` as the device of the one-int failure
    flag it broadcasts after the metadata write (strategies/state_dict_saver.py
    ``save_state_dict_async_finalize``).  On CPU there is nothing to synchronize and gloo
    broadcasts CPU tensors, so: a no-op and "cpu" (restored after the test)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def megatron_sharded_state_dict(model, opt, iteration: int, empty: bool = False) -> dict:
    """The state dict Megatron's training loop hands to ``dist_checkpointing.save``: model and
    optimizer tensors as ShardedTensors (one rank: the whole tensor, replica 0), rng state as a
    ShardedObject, iteration and args in the common state (common.pt)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def st(key, t):
        t = torch.empty_like(t) if empty else t.detach()
        return ShardedTensor.from_rank_offsets(key, t, replica_id=0)
    sd = {"model": {k: st(f"model.{k}", v) for k, v in model.state_dict().items()}}
    osd = opt.state_dict()
    sd["optimizer"] = {
        "state": {i: {k: st(f"optimizer.state.{i}.{k}", v) for k, v in s.items()}
                  for i, s in osd["state"].items()},
        "param_groups": osd["param_groups"]}
    sd["rng_state"] = ShardedObject("rng_state", None if empty else C.rng_state(), (1,), (0,),
                                    replica_id=0)
    sd["iteration"] = iteration
    sd["checkpoint_version"] = 3.0
    return sd


def test_megatron_core_dist_checkpointing_iter_dirs(mounted, gloo_world1, monkeypatch):
    """megatron-core ``dist_checkpointing.save`` into ``iter_NNNNNNN`` (torch_dist layout), the
    tracker ``latest_checkpointed_iteration.txt`` rewritten after each save, the training script
    keeping the latest 2 (megatron-core has no retention of its own; megatron.training's
    ``--save-retain-interval`` is reproduced in tests/test_frameworks.py); load back bit-exact."""
    C.require("megatron.core.dist_checkpointing")
    from megatron.core import dist_checkpointing
    megatron_cpu_shim(monkeypatch)
    save = mounted / "megatron"
    save.mkdir()
    (save / ".retainz").write_text('preset = "megatron"\nkeep_latest = 2\ncadence = 2\n')
    model, opt = C.make_model(seed=0)
    tracker = save / C.TRACKER
    gen_zones: dict[int, set[int]] = {}
    for it in range(1, 11):
        C.train_step(model, opt)
        if it % 2:
            continue
        d = save / f"iter_{it:07d}"
        d.mkdir()
        dist_checkpointing.save(megatron_sharded_state_dict(model, opt, it), str(d))
        with open(tracker, "w") as f:                    # megatron.training: after the save
            f.write(str(it))
        gen_zones[it] = zones_below(d)
        assert_hints(C.files_below(d), it, it + 4)
        h = hint(tracker)
        assert (h["birth"], h["reclaim"], h["source"]) == (it, it + 2, "policy-rolling"), h
        for old in sorted(int(n[5:]) for n in os.listdir(save) if n.startswith("iter_"))[:-2]:
            shutil.rmtree(save / f"iter_{old:07d}")
    assert sorted(os.listdir(save)) == [".retainz", "iter_0000008", "iter_0000010", C.TRACKER]
    names = sorted(os.listdir(save / "iter_0000010"))     # torch_dist: 2 writer threads/rank
    assert [n for n in names if not n.endswith(".distcp")] == [".metadata", "common.pt",
                                                               "metadata.json"], names
    assert [n for n in names if n.endswith(".distcp")] == ["__0_0.distcp", "__0_1.distcp"]
    st = mounted.status()
    assert st["gc_copied_bytes"] == 0, st
    C.assert_zones_reset(mounted.path, set().union(*(gen_zones[i] for i in (2, 4, 6))), st, 10)
    live_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    live_opt = opt.state_dict()
    rng = C.rng_state()
    before = C.tree_digest(save)
    mounted.remount()
    assert C.tree_digest(save) == before
    assert_hints(C.files_below(save / "iter_0000010"), 10, 14)

    it = int(tracker.read_text())
    assert it == 10
    m2, o2 = C.make_model(seed=3)
    C.train_step(m2, o2)                                  # optimizer state shaped like the saved
    empty = megatron_sharded_state_dict(m2, o2, 0, empty=True)
    loaded = dist_checkpointing.load(empty, str(save / f"iter_{it:07d}"))
    assert loaded["iteration"] == 10
    m2.load_state_dict(loaded["model"])
    o2.load_state_dict(loaded["optimizer"])
    tensors_equal(live_model, m2.state_dict(), "model")
    tensors_equal(live_opt, o2.state_dict(), "optimizer")
    tensors_equal(C.to_plain(rng), C.to_plain(loaded["rng_state"]), "rng")


# ------------------------------------------------------------------------ nvidia-resiliency-ext
def test_nvrx_local_checkpoint_manager(mounted, gloo_world1):
    """nvidia-resiliency-ext ``LocalCheckpointManager``: each save writes
    ``iter_NNNNNNN_0_local.dirty.pt`` and renames it; the filesystem re-derives the hint on rename,
    so the final files are generations of the ``nvrx`` preset (not policy-nongeneration); the
    manager's cleanup deletes older iterations and their zones are reset; find_latest + load give
    back the saved tensors bit for bit after remount."""
    C.require("nvidia_resiliency_ext.checkpointing.local")
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager)
    root = mounted / "local"
    root.mkdir()
    (root / ".retainz").write_text('preset = "nvrx"\nkeep_latest = 1\ncadence = 50\n')
    model, opt = C.make_model(seed=0, dim=128)
    mgr = LocalCheckpointManager(root, session_id="run1")
    rank_dir = root / "run1" / "0"
    gen_zones: dict[int, set[int]] = {}
    saved = {}
    for it in (50, 100, 150, 200):
        C.train_step(model, opt)
        sd = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
              "optimizer": copy.deepcopy(opt.state_dict()), "iteration": it}   # (see worker)
        saved[it] = {"model": {k: v.clone() for k, v in sd["model"].items()},
                     "optimizer": C.flat_optim_tensors(opt)}
        mgr.save(C.CPUTensorAwareStateDict(sd), it)
        final = rank_dir / f"iter_{it:07d}_0_local.pt"
        assert sorted(os.listdir(rank_dir)) == [final.name]       # cleanup removed older ones
        h = hint(final)
        assert (h["birth"], h["reclaim"], h["source"]) == (it, it + 50, "policy"), h
        assert "placed" not in h, h                               # placed under the final hint
        gen_zones[it] = zones_below(final)
    st = mounted.status()
    assert st["gc_copied_bytes"] == 0, st
    C.assert_zones_reset(mounted.path, set().union(*(gen_zones[i] for i in (50, 100, 150))), st, 200)
    rows = {r["path"]: r for r in hints_json(root)["generations"]}
    assert [r["birth"] for p, r in rows.items() if p.endswith("_local.pt")] == [200], rows
    before = C.tree_digest(root)
    mounted.remount()
    assert C.tree_digest(root) == before
    h = hint(rank_dir / "iter_0000200_0_local.pt")
    assert (h["birth"], h["reclaim"], h["source"]) == (200, 250, "policy"), h

    mgr2 = LocalCheckpointManager(root, session_id="run1")
    assert mgr2.find_latest() == 200
    tasd, ckpt_id = mgr2.load()
    assert ckpt_id == (200, 0, "run1")
    sd = tasd.state_dict
    assert sd["iteration"] == 200
    tensors_equal(saved[200]["model"], sd["model"], "model")
    m2, o2 = C.make_model(seed=9, dim=128)
    C.train_step(m2, o2)
    m2.load_state_dict(sd["model"])
    o2.load_state_dict(sd["optimizer"])
    tensors_equal(saved[200]["optimizer"], C.flat_optim_tensors(o2), "optimizer")


def hints_json(path) -> dict:
    import json
    from conftest import RETAINZFS, run
    return json.loads(run(RETAINZFS, "hints", "--json", path).stdout)
