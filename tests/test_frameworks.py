"""Unmodified training frameworks on a real retainzfs mount (issue 5).

Every test formats an image, mounts it with the real `mount.retainzfs` (conftest.py), lets a
framework write checkpoints the way it does upstream, and checks

* the hints the filesystem derived from the layout (`.retainz` presets, no user code): birth and
  reclaim epoch of every file, read back through the virtual xattr `user.retainz.hint`;
* the retention the framework performed (which generations are left);
* that the data are byte-exact after unmount/remount (sha256 of every file, symlink targets) and
  load back into the model bit for bit.

Real packages where they install (PyTorch DCP/FSDP2, transformers' Trainer + safetensors,
Lightning); TorchTitan's and Megatron-LM's checkpoint managers are also reproduced from upstream
in tests/fw_common.py (the real torchtitan, megatron-core and nvidia-resiliency-ext packages run in
tests/test_frameworks_real.py).  The 4-rank DCP job is marked ``multirank`` (deselect with
``-m "not multirank"``); helper processes: tests/fw_dcp_multirank.py, tests/fw_resume_job.py.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import xattr

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402

import fw_common as C  # noqa: E402
from conftest import RETAINZFS, run  # noqa: E402
from retainzfs import hints as H  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
torch.set_num_threads(1)          # leave the second core to the FUSE daemon
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def write_policy(d, text: str) -> None:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, ".retainz"), "w") as f:
        f.write(text)


def assert_gen_hints(gen_path, birth: int, reclaim, source: str | None = None) -> list[str]:
    """Every file of a generation (dir or file) carries (birth, reclaim); returns the files."""
    files = C.files_below(gen_path) if os.path.isdir(gen_path) else [os.fspath(gen_path)]
    assert files, f"{gen_path}: no files"
    for f in files:
        h = C.hint_of(f)
        assert h["birth"] == birth, (f, h)
        assert C.reclaim(h) == float(reclaim), (f, h)
        if source:
            assert h["source"] == source, (f, h)
        if os.path.getsize(f):
            assert C.zones_of(f), f"{f}: data but no zones"
    return files


def hints_json(path) -> dict:
    return json.loads(run(RETAINZFS, "hints", "--json", path).stdout)


def state_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def live_status_ok(m) -> dict:
    st = m.status()
    assert st["gc_copied_bytes"] == 0, st
    assert not st["capacity_stop"], st
    return st


# ------------------------------------------------------------------- presets (no mount)
@pytest.mark.parametrize("preset,name,birth", [
    ("torchtitan", "step-1000", 1000), ("torchtitan", "step-1000.tmp", None),
    ("megatron", "iter_0000100", 100), ("megatron", "iter_0012345", 12345),
    ("megatron", "latest_checkpointed_iteration.txt", None),
    ("hf", "checkpoint-500", 500), ("hf", "tmp-checkpoint-500", 500), ("hf", "runs", None),
    ("lightning", "epoch=0-step=100.ckpt", 100), ("lightning", "epoch=3-step=4000-v1.ckpt", 4000),
    ("lightning", "epoch=1-step=20-val_loss=0.12.ckpt", 20), ("lightning", "last.ckpt", None),
    ("lightning", "mystep=5.ckpt", None),
    ("dcp", "step-7", 7), ("dcp", "ckpt-7.pt", 7), ("dcp", "epoch=3.pth", 3),
    ("dcp", "checkpoint_100", 100), ("dcp", "model.pt", None)])
def test_presets_match_framework_layouts(preset, name, birth):
    from retainzfs import hints as H
    pol = H.parse_policy(f'preset = "{preset}"\nkeep_latest = 2\n'.encode())
    assert H.generation_birth(pol, name) == birth


def test_rolling_files_and_retain_interval_rules():
    from retainzfs import hints as H
    meg = H.parse_policy(b'preset = "megatron"\nkeep_latest = 1\nretain_interval = 1000\n')
    assert H.derive_hint(meg, ["iter_0002000", "__0_0.distcp"], [1000, 1500], 0).anchor
    h = H.derive_hint(meg, ["iter_0002500", "common.pt"], [2000, 2500], 0)
    assert (h.birth, h.reclaim) == (2500, 3000)
    h = H.nongeneration_hint(meg, ["latest_checkpointed_iteration.txt"], [2000, 2500], 0)
    assert (h.birth, h.reclaim, h.source) == (2500, 3000, "policy-rolling")
    assert H.nongeneration_hint(meg, ["latest_checkpointed_iteration.txt"], [], 0).anchor
    assert H.nongeneration_hint(meg, ["progress.txt"], [2000], 0).anchor
    lit = H.parse_policy(b'preset = "lightning"\nkeep_latest = 3\ncadence = 50\n')
    h = H.nongeneration_hint(lit, ["last.ckpt"], [100, 150], 0)
    assert (h.birth, h.reclaim) == (150, 200)
    off = H.parse_policy(b'preset = "lightning"\nrolling = ""\n')
    assert H.nongeneration_hint(off, ["last.ckpt"], [100], 0).anchor
    with pytest.raises(H.HintError):
        H.parse_policy(b'preset = "megatron"\nrolling = "("\n')


# ------------------------------------------------------------------------------ PyTorch DCP
@pytest.mark.multirank
def test_dcp_multirank_fsdp2_save_async_save_load(mounted, tmp_path):
    """4 ranks (gloo, CPU), FSDP2-sharded transformer: dcp.save + dcp.async_save onto the mount,
    hints per rank file, byte-exact after remount, reload equal on every tensor."""
    run_dir = mounted / "dcp"
    write_policy(run_dir, 'preset = "dcp"\nkeep_latest = 2\ncadence = 2\n')
    ref = tmp_path / "ref"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(HERE / "fw_dcp_multirank.py"), "--dir", str(run_dir),
                             "--ref", str(ref), "--ranks", "4", "--timeout", "240"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(tmp_path))
    try:
        ok = C.wait_for(lambda: (ref / "SAVED").exists() or proc.poll() is not None, timeout=240)
        if not (ref / "SAVED").exists():
            proc.kill()
            pytest.fail(f"4-rank job did not save (ok={ok}):\n{proc.communicate()[0][-4000:]}")
        for step in (2, 4):
            gen = run_dir / f"step-{step}"
            names = sorted(os.listdir(gen))
            assert names == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)], names
            assert_gen_hints(gen, step, step + 2 * 2, "policy")
        before = C.tree_digest(run_dir)
        mounted.remount()
        assert C.tree_digest(run_dir) == before
        for step in (2, 4):
            assert_gen_hints(run_dir / f"step-{step}", step, step + 4, "policy")
        (ref / "GO").write_text("go")
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert "step-4: 30 model tensors and the AdamW state equal after reload" in out
    assert "ALL RANKS OK" in out


# ------------------------------------------------------------------------------ TorchTitan
def test_torchtitan_keep_latest_k_async_purge_thread(mounted):
    """TorchTitan CheckpointManager (async_mode=async, keep_latest_k=3): step-N DCP dirs, the
    purge thread rmtree's old ones beside the next async save; the torchtitan preset derives
    births from the names and the cadence from the siblings (no cadence in .retainz)."""
    folder = mounted / "titan" / "checkpoint"
    write_policy(folder, 'preset = "torchtitan"\nkeep_latest = 3\n')
    model, opt = C.make_model(seed=0, dim=128)
    states = {"app": C.AppState(model, opt), "train_state": {"step": torch.tensor(0)}}
    mgr = C.TitanCheckpointManager(str(folder), states, interval=2, keep_latest_k=3,
                                   async_mode="async")
    hints_seen = {}
    for step in range(1, 13):
        C.train_step(model, opt)
        states["train_state"]["step"] = torch.tensor(step)
        mgr.save(step, force=step == 12)            # torchtitan: last step -> forced sync save
        if step % 2 == 0 and step > 2:
            # the previous generation is complete (async_wait happened in save): its hints
            prev = folder / f"step-{step - 2}"
            if prev.exists():
                h = C.hint_of(prev / "__0_0.distcp")
                hints_seen[step - 2] = (h["birth"], h["reclaim"])
    mgr.close()
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert sorted(os.listdir(folder)) == [".retainz", "step-10", "step-12", "step-8"]
    assert sorted(os.path.basename(p) for p, _, _ in mgr.purge_log) == ["step-2", "step-4", "step-6"]
    assert len(mgr.save_log) == 6
    # births from the names, cadence 2 inferred from the siblings (step-2: from its own birth)
    assert hints_seen == {s: (s, s + 6) for s in (2, 4, 6, 8, 10)}, hints_seen
    for s in (8, 10, 12):
        assert_gen_hints(folder / f"step-{s}", s, s + 6, "policy")
    rep = hints_json(folder)
    rows = {r["path"]: r for r in rep["generations"]}
    assert set(rows) == {"step-8", "step-10", "step-12"}
    for s in (8, 10, 12):
        r = rows[f"step-{s}"]
        assert (r["kind"], r["birth"], r["reclaim"], r["files"]) == ("generation", s, s + 6, 2)
        assert r["zones"] and r["bytes"] > 3 << 20
    st = live_status_ok(mounted)
    assert st["zone_resets"] >= 1 and st["host_wa"] <= 1.05, st
    before = C.tree_digest(folder)
    mounted.remount()
    assert C.tree_digest(folder) == before
    m2, o2 = C.make_model(seed=1, dim=128)
    st2 = {"app": C.AppState(m2, o2), "train_state": {"step": torch.tensor(0)}}
    mgr2 = C.TitanCheckpointManager(str(folder), st2, interval=2, keep_latest_k=3)
    assert mgr2.load() == 12
    mgr2.close()
    assert int(st2["train_state"]["step"]) == 12
    assert state_equal(live, m2.state_dict())
    for s in (8, 10, 12):
        assert_gen_hints(folder / f"step-{s}", s, s + 6, "policy")


# ------------------------------------------------------------------------------- Megatron
def test_megatron_iter_layout_tracker_and_retain_interval(mounted):
    """Megatron-LM torch_dist checkpoints iter_0000002..iter_0000010 with --save-retain-interval 6:
    the previous iteration is deleted in a thread unless retained; retained ones are anchors
    (reclaim inf) kept apart from finite hints; the tracker is rewritten in place and is a
    rolling file (dies at the next save).

    A reproduction on purpose: ``--save-retain-interval`` is implemented in
    ``megatron.training.checkpointing``, which megatron-core ships only in releases that need
    Python >= 3.12 (0.19.2), and this project runs on 3.11; megatron-core 0.16.1 (3.11) has
    ``dist_checkpointing`` and is tested for real in tests/test_frameworks_real.py."""
    save = mounted / "megatron"
    write_policy(save, 'preset = "megatron"\nkeep_latest = 1\nretain_interval = 6\n')
    model, opt = C.make_model(seed=0)
    tracker = save / C.TRACKER
    tracker_ino = None
    for it in range(1, 11):
        C.train_step(model, opt)
        if it % 2 == 0:
            threads = C.megatron_save_checkpoint(str(save), it, model, opt, save_retain_interval=6)
            for t in threads:
                t.join()
            ino = os.stat(tracker).st_ino
            tracker_ino = tracker_ino or ino
            assert ino == tracker_ino                      # rewritten in place, same inode
            h = C.hint_of(tracker)
            assert (h["birth"], h["reclaim"], h["source"]) == (it, it + 2, "policy-rolling")
    assert sorted(os.listdir(save)) == [".retainz", "iter_0000006", "iter_0000010", C.TRACKER]
    assert tracker.read_text() == "10"
    assert sorted(os.listdir(save / "iter_0000010")) == [".metadata", "__0_0.distcp",
                                                         "common.pt", "metadata.json"]
    anchor_files = assert_gen_hints(save / "iter_0000006", 6, float("inf"), "policy-milestone")
    finite_files = assert_gen_hints(save / "iter_0000010", 10, 12, "policy") + [str(tracker)]
    anchor_zones = {z for f in anchor_files for z in C.zones_of(f)}
    finite_zones = {z for f in finite_files for z in C.zones_of(f)}
    assert anchor_zones and finite_zones and not anchor_zones & finite_zones
    rows = {r["path"]: r for r in hints_json(save)["generations"]}
    assert rows["iter_0000006"]["reclaim"] == "inf"
    assert rows["iter_0000010"]["reclaim"] == 12
    assert rows[C.TRACKER]["kind"] == "rolling"
    live_status_ok(mounted)
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = C.tree_digest(save)
    mounted.remount()
    assert C.tree_digest(save) == before
    m2, o2 = C.make_model(seed=5)
    assert C.megatron_load_checkpoint(str(save), m2, o2) == 10
    assert state_equal(live, m2.state_dict())
    assert_gen_hints(save / "iter_0000006", 6, float("inf"), "policy-milestone")


# ----------------------------------------------------------------------- HF Trainer (real)
def test_hf_trainer_safetensors_shards_and_save_total_limit(mounted):
    """transformers' Trainer with a GPT-2 built from a config: checkpoint-N/ with sharded
    safetensors + optimizer/scheduler/RNG/trainer state; save_total_limit=2 rotation (sorted by
    directory mtime); hf preset hints; byte-exact and loadable after remount."""
    pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                              TrainingArguments)
    try:
        from transformers.trainer_utils import sort_checkpoints      # transformers >= 5
    except ImportError:
        sort_checkpoints = None

    class ShardedGPT2(GPT2LMHeadModel):
        def save_pretrained(self, *a, **kw):          # small model, several shards anyway
            kw["max_shard_size"] = "150KB"
            return super().save_pretrained(*a, **kw)

    class Spacer(TrainerCallback):                    # saves >= 0.5 s apart: mtime order is used
        def on_save(self, args, state, control, **kw):
            time.sleep(0.55)

    out = mounted / "hf"
    write_policy(out, 'preset = "hf"\nkeep_latest = 2\ncadence = 2\n')
    torch.manual_seed(0)
    model = ShardedGPT2(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2,
                                   n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (64, 16), generator=g)]
    args = TrainingArguments(output_dir=str(out), max_steps=8, save_strategy="steps", save_steps=2,
                             save_total_limit=2, per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_strategy="no", report_to="none", use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Spacer()])
    trainer.train()
    assert sorted(os.listdir(out)) == [".retainz", "checkpoint-6", "checkpoint-8"]
    if sort_checkpoints is not None:
        ordered = sort_checkpoints(str(out), use_mtime=True)
        assert [os.path.basename(p) for p in ordered] == ["checkpoint-6", "checkpoint-8"]
    m6, m8 = (os.path.getmtime(out / f"checkpoint-{s}") for s in (6, 8))
    assert m8 - m6 >= 0.5, (m6, m8)
    ck = out / "checkpoint-8"
    names = set(os.listdir(ck))
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) >= 2 and "model.safetensors.index.json" in names, names
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "training_args.bin", "config.json"} <= names, names
    for s in (6, 8):
        assert_gen_hints(out / f"checkpoint-{s}", s, s + 4, "policy")
    live = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    before = C.tree_digest(out)
    mounted.remount()
    assert C.tree_digest(out) == before
    loaded = {}
    for s in shards:
        loaded.update(safetensors_torch.load_file(str(ck / s)))
    assert loaded and all(torch.equal(v, live[k]) for k, v in loaded.items())
    m2 = GPT2LMHeadModel.from_pretrained(str(ck), local_files_only=True)
    assert state_equal(live, m2.state_dict())
    opt_sd = torch.load(ck / "optimizer.pt", weights_only=True)
    exp = trainer.optimizer.state_dict()["state"]
    for pid, st in opt_sd["state"].items():
        assert torch.equal(st["exp_avg"], exp[pid]["exp_avg"])
    assert_gen_hints(out / "checkpoint-8", 8, 12, "policy")


# ------------------------------------------------------------------------ Lightning (real)
def test_lightning_modelcheckpoint_top_k_and_last_link(mounted):
    """Lightning ModelCheckpoint(save_top_k=2, monitor="step", mode="max", save_last="link"):
    epoch=0-step=N.ckpt files, old ones removed, last.ckpt a relative symlink to the newest; the
    lightning preset reads the step from the file name."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    class LitLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = C.TinyLM(dropout=0.0)

        def training_step(self, batch, _):
            (x,) = batch
            logits = self.model(x)
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ckdir = mounted / "lightning" / "checkpoints"
    write_policy(ckdir, 'preset = "lightning"\nkeep_latest = 2\ncadence = 2\n')
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randint(0, 256, (64, 16), generator=g))
    dl = torch.utils.data.DataLoader(ds, batch_size=4)
    cb = ModelCheckpoint(dirpath=str(ckdir), filename="{epoch}-{step}", every_n_train_steps=2,
                         save_top_k=2, monitor="step", mode="max", save_last="link")
    lit = LitLM()
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(mounted / "lightning"), callbacks=[cb],
                         num_sanity_val_steps=0)
    trainer.fit(lit, dl)
    names = sorted(os.listdir(ckdir))
    assert names == [".retainz", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"], names
    assert os.path.islink(ckdir / "last.ckpt")
    assert os.readlink(ckdir / "last.ckpt") == "epoch=0-step=8.ckpt"
    assert_gen_hints(ckdir / "epoch=0-step=6.ckpt", 6, 10, "policy")
    assert_gen_hints(ckdir / "epoch=0-step=8.ckpt", 8, 12, "policy")
    rows = {r["path"]: r for r in hints_json(ckdir)["generations"]}
    assert rows["last.ckpt"]["kind"] == "link" and rows["last.ckpt"]["target"] == "epoch=0-step=8.ckpt"
    assert rows["epoch=0-step=8.ckpt"]["reclaim"] == 12
    live = {k: v.detach().clone() for k, v in lit.state_dict().items()}
    before = C.tree_digest(ckdir)
    mounted.remount()
    assert C.tree_digest(ckdir) == before
    ck = torch.load(ckdir / "last.ckpt", weights_only=False)        # through the symlink
    assert ck["global_step"] == 8
    assert state_equal(live, ck["state_dict"])


# ---------------------------------------------------------------- torch.save / mmap load
def test_torch_save_and_mmap_load(mounted):
    """torch.save single-file checkpoints (dcp preset: ckpt-N.pt, milestones), read back with
    torch.load(mmap=True) (shared mmap of a FUSE file, multi-zone tensor) before and after
    remount."""
    d = mounted / "single"
    write_policy(d, 'preset = "dcp"\nkeep_latest = 2\ncadence = 10\nmilestone_every = 30\n')
    g = torch.Generator().manual_seed(0)
    sds = {}
    for s in (10, 20, 30):
        sds[s] = {"big": torch.randn(3 << 20, generator=g),          # 12 MiB: several zones
                  "w": torch.randn(64, 64, generator=g), "step": torch.tensor(s)}
        torch.save(sds[s], d / f"ckpt-{s}.pt")
    assert_gen_hints(d / "ckpt-10.pt", 10, 30, "policy")
    assert_gen_hints(d / "ckpt-20.pt", 20, 40, "policy")
    assert_gen_hints(d / "ckpt-30.pt", 30, float("inf"), "policy-milestone")
    assert len(C.zones_of(d / "ckpt-10.pt")) >= 3

    def check():
        for s, sd in sds.items():
            got = torch.load(d / f"ckpt-{s}.pt", mmap=True, weights_only=True)
            assert state_equal(sd, got), s
            del got
    check()
    os.remove(d / "ckpt-10.pt")                      # latest-2: ckpt-10 retires at 30
    before = C.tree_digest(d)
    mounted.remount()
    assert C.tree_digest(d) == before
    del sds[10]
    check()


# --------------------------------------------------------------------- retainzfs.runtime
def test_runtime_api_tag_generation_and_retainz_writer(mounted, tmp_path):
    from retainzfs.runtime import (RetainzWriter, hint_of, latest_k_hint, tag_generation,
                                   tag_path, zones_of)
    assert latest_k_hint(100, 10, 3) == 130
    for bad in ((100, 0, 3), (100, 10, 0), (-1, 10, 3)):
        with pytest.raises(ValueError):
            latest_k_hint(*bad)
    run_dir = mounted / "rt"
    write_policy(run_dir, 'preset = "torchtitan"\nkeep_latest = 3\ncadence = 100\n')
    # explicit tag wins over the directory's .retainz (nearest declaration first)
    gen = tag_generation(run_dir / "step-100", 100, latest_k_hint(100, 100, 5), stream=2)
    assert os.path.isdir(gen)
    assert xattr.getxattr(gen, H.XATTR_BIRTH) == b"100"
    assert xattr.getxattr(gen, H.XATTR_RECLAIM) == b"600"
    with open(os.path.join(gen, "shard0"), "wb") as f:
        f.write(os.urandom(3 << 20))
    h = hint_of(os.path.join(gen, "shard0"))
    assert h == {"birth": 100, "reclaim": 600, "stream": 2, "source": "xattr-inherited",
                 "name": "/rt/step-100/shard0"}
    assert zones_of(os.path.join(gen, "shard0"))
    ms = tag_generation(mounted / "milestones" / "m1", 50, None)
    with open(os.path.join(ms, "w.pt"), "wb") as f:
        f.write(b"x" * 10000)
    assert hint_of(os.path.join(ms, "w.pt"))["reclaim"] == "inf"
    f1 = mounted / "loose.bin"
    f1.write_bytes(b"")
    tag_path(f1, 7, 9)
    with open(f1, "ab") as f:
        f.write(b"y" * 5000)
    assert hint_of(f1) == {"birth": 7, "reclaim": 9, "stream": 0, "source": "xattr",
                           "name": "/loose.bin"}
    with pytest.raises(ValueError):
        tag_generation(run_dir / "bad", 10, 5)                       # reclaim before birth
    assert hint_of(tmp_path) is None and zones_of(tmp_path) == []    # not on retainzfs

    # DCP writer that tags its directory (sync + async, checkpoint_id=, milestone)
    model, opt = C.make_model(seed=0)
    C.train_step(model, opt)
    state = {"app": C.AppState(model, opt, with_rng=False)}
    dcp.save(state, storage_writer=RetainzWriter(run_dir / "step-200", birth=200, cadence=100,
                                                 keep_latest=3))
    fut = dcp.async_save(state, storage_writer=RetainzWriter("unused", birth=300, reclaim=450),
                         checkpoint_id=run_dir / "step-300")
    fut.result()
    dcp.save(state, storage_writer=RetainzWriter(run_dir / "step-400", birth=400, cadence=100,
                                                 keep_latest=3, milestone=True))
    assert_gen_hints(run_dir / "step-200", 200, 500, "xattr-inherited")
    assert_gen_hints(run_dir / "step-300", 300, 450, "xattr-inherited")
    assert_gen_hints(run_dir / "step-400", 400, float("inf"), "xattr-inherited")
    rows = {r["path"]: r for r in hints_json(run_dir)["generations"]}
    assert rows["step-100"]["source"] == "xattr-inherited" and rows["step-100"]["reclaim"] == 600
    assert rows["step-400"]["reclaim"] == "inf"
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mounted.remount()
    assert_gen_hints(run_dir / "step-300", 300, 450, "xattr-inherited")
    m2, o2 = C.make_model(seed=3)
    st2 = {"app": C.AppState(m2, o2, with_rng=False)}
    dcp.load(st2, checkpoint_id=run_dir / "step-300")
    assert state_equal(live, m2.state_dict())
    # importing the runtime API does not drag torch in
    out = run(sys.executable, "-c", "import sys, retainzfs.runtime; print('torch' in sys.modules)")
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------- retainzfs hints
def test_hints_cli_table_json_and_errors(mounted, tmp_path):
    d = mounted / "job"
    write_policy(d, 'preset = "torchtitan"\nkeep_latest = 2\n')
    for s in (100, 200):
        os.makedirs(d / f"step-{s}")
        (d / f"step-{s}" / "__0_0.distcp").write_bytes(os.urandom(1 << 20))
    os.makedirs(d / "step-300")                                     # not written yet
    (d / "notes.txt").write_text("hello")
    os.symlink("step-200", d / "latest")
    rep = hints_json(d)
    rows = {r["path"]: r for r in rep["generations"]}
    assert rep["policies"]["job"]["preset"] == "torchtitan"
    assert (rows["step-100"]["birth"], rows["step-100"]["reclaim"]) == (100, 300)
    assert (rows["step-200"]["birth"], rows["step-200"]["reclaim"]) == (200, 400)
    assert rows["step-200"]["bytes"] == 1 << 20 and rows["step-200"]["zones"]
    assert rows["step-300"]["source"] == "policy (no data yet)" and rows["step-300"]["reclaim"] == 500
    assert rows["notes.txt"]["kind"] == "file" and rows["notes.txt"]["reclaim"] == "inf"
    assert rows["latest"] == {**rows["latest"], "kind": "link", "target": "step-200"}
    one = hints_json(d / "step-100")["generations"]
    assert len(one) == 1 and one[0]["reclaim"] == 300
    table = run(RETAINZFS, "hints", d).stdout
    for s in ("step-100", "step-200", "step-300", "latest -> step-200", "generation"):
        assert s in table, table
    bad = run(RETAINZFS, "hints", tmp_path, check=False)
    assert bad.returncode != 0 and "not on a retainzfs mount" in bad.stderr


# ---------------------------------------------------------------------- bit-exact resume
def _read_until(proc, token: str, timeout: float) -> list[str]:
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if line.startswith(token):
            return lines
    raise AssertionError(f"did not see {token!r}:\n" + "\n".join(lines[-30:]))


def test_bit_exact_resume_after_killing_trainer_and_daemon(mounted, tmp_path):
    """Train with TorchTitan-style checkpoints on the mount; SIGKILL the daemon and the trainer
    while step-8 is half written (data fsynced, .metadata not yet); remount (mount.retainzfs
    clears the stale mount); resume from the newest complete checkpoint (step-6); the next update
    equals the uninterrupted reference run: loss, parameters, AdamW state, torch + Python RNG."""
    job = [sys.executable, str(HERE / "fw_resume_job.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ref_dir, res_dir = tmp_path / "ref", tmp_path / "res"
    ref_dir.mkdir()
    res_dir.mkdir()
    run_dir = mounted / "run"
    write_policy(run_dir, 'preset = "torchtitan"\nkeep_latest = 3\ncadence = 2\n')
    ref = subprocess.Popen(job + ["--steps", "8", "--dump-dir", str(ref_dir)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    crash = subprocess.Popen(job + ["--dir", str(run_dir), "--steps", "12", "--every", "2",
                                    "--keep", "3", "--stall-before-metadata", "8"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _read_until(crash, "STALLED 8", timeout=180)
        assert (run_dir / "step-8" / "__0_0.distcp").exists()
        mounted.kill()                  # SIGKILL the FUSE daemon ...
        crash.kill()                    # ... and the trainer, mid-save
        crash.wait(timeout=30)
    finally:
        if crash.poll() is None:
            crash.kill()
            crash.wait()
    out, _ = ref.communicate(timeout=240)
    assert ref.returncode == 0, out[-3000:]
    mounted.mount()                     # clears the stale mountpoint, replays the journal
    # keep_latest_k=3: step-2 would only be purged by the save of step-8, which never finished
    assert sorted(os.listdir(run_dir)) == [".retainz", "step-2", "step-4", "step-6", "step-8"]
    assert not (run_dir / "step-8" / ".metadata").exists()
    assert (run_dir / "step-6" / ".metadata").exists()
    assert_gen_hints(run_dir / "step-6", 6, 12, "policy")
    res = run(*job, "--dir", run_dir, "--resume", "--dump-dir", res_dir, timeout=240)
    assert "RESUMED 6" in res.stdout, res.stdout
    a = torch.load(ref_dir / "step-7.pt", weights_only=False)
    b = torch.load(res_dir / "step-7.pt", weights_only=False)
    assert torch.equal(a["loss"], b["loss"])
    assert state_equal(a["params"], b["params"])
    assert len(a["optim"]) > 30 and state_equal(a["optim"], b["optim"])   # exp_avg(_sq), step
    assert torch.equal(a["torch_rng"], b["torch_rng"])
    assert a["python_rng"] == b["python_rng"]
