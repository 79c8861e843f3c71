"""Shared pieces of the framework tests (tests/test_frameworks.py) and their helper processes.

* ``TinyLM``          a small transformer LM built in code (no hub download), dropout on so the
                      RNG state matters for bit-exact resume.
* ``AppState``        DCP ``Stateful`` with model + AdamW (``get_state_dict``/``set_state_dict``,
                      so FSDP2-sharded models work too) and the torch + Python RNG states.
* ``TitanCheckpointManager``  our reproduction of TorchTitan's ``CheckpointManager`` save/purge/load
                      logic (torchtitan/components/checkpoint.py): ``step-N`` directories,
                      ``keep_latest_k`` with the purge running ``shutil.rmtree`` in a thread fed by
                      a queue, beside the next (optionally ``dcp.async_save``) save, and a load
                      that only considers checkpoints with a ``.metadata`` file.
* ``megatron_save_checkpoint`` / ``megatron_load_checkpoint``  our reproduction of Megatron-LM's
                      ``save_checkpoint``/``load_checkpoint`` (megatron/training/checkpointing.py):
                      ``iter_0000100/`` in the ``torch_dist`` layout (DCP shards + ``.metadata`` +
                      ``common.pt`` + ``metadata.json``), ``latest_checkpointed_iteration.txt``
                      rewritten in place after each save, and ``--save-retain-interval``: the
                      previous iteration is deleted (in a thread) unless it is a multiple of the
                      retain interval.
* helpers: ``tree_digest`` (sha256 of every file + symlink targets), ``hint_of``, ``zones_of``.

The real packages run in tests/test_frameworks_real.py (torchtitan 0.3.0, megatron-core 0.16.1,
nvidia-resiliency-ext 0.4.1, installed by scripts/setup.sh).  The reproductions stay: the
TorchTitan one drives a cadence-inferred preset with a purge log of its own, and Megatron's
``--save-retain-interval`` lives in ``megatron.training.checkpointing``, which megatron-core ships
only from versions that need Python >= 3.12 (this project runs on 3.11; 0.16.1 has
``dist_checkpointing`` but no ``megatron.training``).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import queue
import random
import re
import shutil
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
import xattr
from retainzfs import hints as H

VOCAB = 256


# ----------------------------------------------------------------------------------- model
class TinyLM(nn.Module):
    """Embedding + 2 pre-LN transformer encoder layers (causal mask) + LM head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, 64, dim))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim * 2, dropout=dropout, batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.emb(x) + self.pos[:, :t]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def make_model(seed: int = 0, **kw) -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: int = 8) -> torch.Tensor:
    """One update on synthetic tokens; uses the torch *and* Python RNGs (data + dropout)."""
    seq = 16 + random.randrange(8)
    x = torch.randint(0, VOCAB, (batch, seq))
    logits = model(x)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": io.BytesIO(pickle.dumps(random.getstate()))}


def set_rng_state(d: dict) -> None:
    torch.set_rng_state(d["torch"])
    b = d["python"]
    b.seek(0)
    random.setstate(pickle.loads(b.read()))


class AppState(Stateful):
    """Model + optimizer (+ RNG) as one DCP Stateful (the DCP tutorial's pattern)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, with_rng: bool = True):
        self.model, self.opt, self.with_rng = model, opt, with_rng

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.opt)
        sd = {"model": msd, "optim": osd}
        if self.with_rng:
            sd["rng"] = rng_state()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        if self.with_rng and "rng" in sd:
            set_rng_state(sd["rng"])


def flat_optim_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"{pid}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


# ----------------------------------------------------------------------------- TorchTitan
class _Terminate:
    pass


def _purge_thread(purge_queue: queue.Queue, log: list) -> None:
    """torchtitan ``purge_thread``: rmtree whatever the checkpointer queues."""
    while True:
        path = purge_queue.get()
        if isinstance(path, _Terminate):
            return
        begin = time.monotonic()
        shutil.rmtree(path, ignore_errors=True)
        log.append((path, begin, time.monotonic()))


class TitanCheckpointManager:
    """TorchTitan's CheckpointManager save/purge/load (upstream logic, our code).

    ``states`` maps names to Stateful objects / state dicts (TorchTitan: model, optimizer,
    lr_scheduler, dataloader, train_state).  ``async_mode``: ``"disabled"`` or ``"async"``
    (``dcp.async_save``; the previous save is awaited before the next one starts).  As upstream,
    the purge runs right after an async save is *started*: the new ``step-N`` directory may not
    exist yet (DCP creates it in the background), so a purge can keep one generation too many
    until the next purge catches up; the forced last-step save is synchronous.
    """

    def __init__(self, folder: str, states: dict, interval: int, keep_latest_k: int = 0,
                 async_mode: str = "disabled", process_group=None):
        self.folder = folder
        self.states = states
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.pg = process_group
        self.async_future = None
        self.purge_log: list = []
        self.save_log: list = []
        if keep_latest_k > 0:
            if keep_latest_k == 1:
                raise ValueError("We need to maintain at least 2 checkpoint replicas, "
                                 "as the last one may be in the process of being saved.")
            self.purge_queue: queue.Queue = queue.Queue()
            self.purge_thread = threading.Thread(target=_purge_thread,
                                                 args=(self.purge_queue, self.purge_log),
                                                 daemon=True)
            self.purge_thread.start()
        else:
            self.purge_thread = None

    def _create_checkpoint_id(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def _should_save(self, curr_step: int, force: bool = False) -> bool:
        return force or curr_step % self.interval == 0

    def _async_wait(self) -> None:
        if self.async_mode == "async" and self.async_future is not None:
            self.async_future.result()
            self.async_future = None

    @torch.no_grad()
    def save(self, curr_step: int, force: bool = False) -> None:
        if not self._should_save(curr_step, force):
            return
        checkpoint_id = self._create_checkpoint_id(curr_step)
        self._async_wait()
        begin = time.monotonic()
        if force:
            # _save_last_step: the final (forced) save is synchronous
            dcp.save(self.states, checkpoint_id=checkpoint_id)
        elif self.async_mode == "async":
            self.async_future = dcp.async_save(self.states, checkpoint_id=checkpoint_id,
                                               process_group=self.pg)
        else:
            dcp.save(self.states, checkpoint_id=checkpoint_id)
        self.save_log.append((checkpoint_id, begin))
        self._purge_stale_checkpoints()

    def _purge_stale_checkpoints(self) -> None:
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if self.keep_latest_k > 0 and rank0 and os.path.isdir(self.folder):
            discovered = []
            for filename in os.listdir(self.folder):
                match = re.search(r"step-(\d+)", filename)
                if match:
                    discovered.append((int(match.group(1)), os.path.join(self.folder, filename)))
            discovered.sort()
            for _, path in discovered[: -1 * self.keep_latest_k]:
                self.purge_queue.put(path)

    def _find_load_step(self, folder: str = "") -> int:
        folder = folder or self.folder
        steps = []
        if not os.path.isdir(folder):
            return -1
        for filename in os.listdir(folder):
            match = re.search(r"step-(\d+)", filename)
            if match and os.path.isfile(os.path.join(folder, filename, ".metadata")):
                steps.append(int(match.group(1)))
        return max(steps) if steps else -1

    @torch.no_grad()
    def load(self, step: int = -1) -> int:
        """Load ``step`` (-1: the newest complete one); returns the step loaded or -1."""
        if step == -1:
            step = self._find_load_step()
            if step == -1:
                return -1
        checkpoint_id = self._create_checkpoint_id(step)
        if not os.path.isdir(checkpoint_id):
            return -1
        dcp.load(self.states, checkpoint_id=checkpoint_id)
        return step

    def close(self) -> None:
        self._async_wait()
        if self.purge_thread is not None and self.purge_thread.is_alive():
            self.purge_queue.put(_Terminate())
            self.purge_thread.join()


# ------------------------------------------------------------------------------- Megatron
TRACKER = "latest_checkpointed_iteration.txt"


def megatron_checkpoint_name(checkpoints_path: str, iteration: int, release: bool = False) -> str:
    """get_checkpoint_name(..., return_base_dir=True)."""
    return os.path.join(checkpoints_path, "release" if release else "iter_{:07d}".format(iteration))


def megatron_read_metadata(tracker_filename: str) -> tuple[int, bool]:
    with open(tracker_filename) as f:
        metastring = f.read().strip()
    try:
        return int(metastring), False
    except ValueError:
        if metastring == "release":
            return 0, True
        raise


def megatron_save_checkpoint(save_dir: str, iteration: int, model: nn.Module,
                             opt: torch.optim.Optimizer, *, save_retain_interval: int | None = None,
                             args: dict | None = None) -> list[threading.Thread]:
    """Megatron save_checkpoint, torch_dist format, non-async; returns the delete threads."""
    checkpoint_name = megatron_checkpoint_name(save_dir, iteration)
    msd, osd = get_state_dict(model, opt)
    sharded = {"model": msd, "optimizer": osd}
    os.makedirs(checkpoint_name, exist_ok=True)
    dcp.save(sharded, checkpoint_id=checkpoint_name)                 # torch_dist sharded part
    common = {"args": args or {}, "iteration": iteration, "checkpoint_version": 3.0,
              "rng_state": [{"random_rng_state": random.getstate(),
                             "torch_rng_state": torch.get_rng_state()}],
              "num_floating_point_operations_so_far": 0}
    torch.save(common, os.path.join(checkpoint_name, "common.pt"))
    with open(os.path.join(checkpoint_name, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    threads: list[threading.Thread] = []
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        tracker_filename = os.path.join(save_dir, TRACKER)
        # iter_finalize_fn
        prev_iteration = 0
        if save_retain_interval is not None and os.path.exists(tracker_filename):
            with open(tracker_filename) as f:
                prev_iteration = int(f.read().strip())
        with open(tracker_filename, "w") as f:                      # rewritten in place
            f.write(str(iteration))

        def delete_checkpoint(iteration_to_delete: int) -> None:
            try:
                shutil.rmtree(megatron_checkpoint_name(save_dir, iteration_to_delete))
            except Exception:
                pass                 # not fatal, like upstream

        if save_retain_interval is not None:
            if (prev_iteration > 0 and prev_iteration != iteration
                    and prev_iteration % save_retain_interval != 0):
                name = megatron_checkpoint_name(save_dir, prev_iteration)
                if not os.path.islink(name):
                    t = threading.Thread(target=delete_checkpoint, args=(prev_iteration,))
                    t.start()
                    threads.append(t)
    return threads


def megatron_load_checkpoint(load_dir: str, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    iteration, release = megatron_read_metadata(os.path.join(load_dir, TRACKER))
    name = megatron_checkpoint_name(load_dir, iteration, release)
    msd, osd = get_state_dict(model, opt)
    sharded = {"model": msd, "optimizer": osd}
    dcp.load(sharded, checkpoint_id=name)
    set_state_dict(model, opt, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    common = torch.load(os.path.join(name, "common.pt"), weights_only=False)
    assert common["iteration"] == iteration
    return iteration


# -------------------------------------------------------------------------------- helpers
def tree_digest(root) -> dict[str, str]:
    """relpath -> sha256 of every regular file, 'link:<target>' for symlinks."""
    out = {}
    root = os.fspath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
                continue
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            out[rel] = h.hexdigest()
    return out


def hint_of(path) -> dict:
    return json.loads(xattr.getxattr(path, H.XATTR_HINT))


def zones_of(path) -> list[int]:
    raw = xattr.getxattr(path, H.XATTR_ZONES).decode()
    return [int(z) for z in raw.split(",") if z]


def reclaim(h: dict) -> float:
    return float("inf") if h["reclaim"] == "inf" else float(h["reclaim"])


def files_below(root) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(root):
        out += [os.path.join(dirpath, f) for f in filenames]
    return sorted(out)


def wait_for(pred, timeout: float = 60.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def to_plain(x: Any) -> Any:
    """For equality checks: BytesIO -> bytes, recursively."""
    if isinstance(x, io.BytesIO):
        return x.getvalue()
    if isinstance(x, dict):
        return {k: to_plain(v) for k, v in x.items()}
    return x


# ------------------------------------------------------------- real packages (issue 11)
def require(module: str):
    """Import a real framework package; skip with the reason when it is not installed, but under
    CI=true (where scripts/setup.sh installed it) an ImportError fails the test."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI") == "true":
            raise
        import pytest
        pytest.skip(f"{module} is not installed ({e}); scripts/setup.sh installs it")


def zone_rows(mountpoint) -> list[list]:
    """The whole zone map of a mount: rows [condition, written, live, reclaim, kind] read from
    the root's paged ``user.retainz.zonemap.<first>`` xattrs."""
    rows: list[list] = []
    while True:
        page = json.loads(xattr.getxattr(os.fspath(mountpoint), H.XATTR_ZONEMAP + b"%d" % len(rows)))
        rows += page["rows"]
        if not page["rows"] or len(rows) >= page["nr_zones"]:
            return rows


def assert_zones_reset(mountpoint, deleted: set[int], status: dict, now: int) -> None:
    """The zones that held data of deleted generations (``deleted``, recorded while those were
    live) were reset, read from the zone map [condition, written, live, reclaim, kind]:

    * a zone with no dead bytes left (written == live) is empty again or was reset and refilled;
      nothing was GC-copied, so a reset is the only way its dead bytes went away;
    * a zone that still holds dead bytes must be one the allocator shares with a newer, live
      generation (an open zone of generation tails whose reclaim epoch is still ahead of ``now``):
      those bytes wait for that generation, and they are at most one zone's worth.
    """
    assert deleted, "no zones recorded for the deleted generations"
    assert status["gc_copied_bytes"] == 0, status
    rows = zone_rows(mountpoint)
    cap = status["zone_capacity"]
    clean = [z for z in sorted(deleted) if rows[z][1] == rows[z][2]]
    shared = {z: rows[z] for z in sorted(deleted) if rows[z][1] != rows[z][2]}
    assert clean, f"no zone of the deleted generations was reset: {shared}"
    assert status["zone_resets"] >= len(clean), (status["zone_resets"], clean)
    for z, (cond, written, live, reclaim, _kind) in shared.items():
        assert cond != "full" and live > 0, (z, rows[z])
        assert reclaim is not None and (reclaim == -1 or reclaim > now), (z, rows[z], now)
    assert sum(r[1] - r[2] for r in shared.values()) <= cap, shared


try:
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
        BasicTensorAwareStateDict as _NvrxBasic)
except ImportError:          # the tests that need it skip (or fail under CI) through require()
    _NvrxBasic = object


class CPUTensorAwareStateDict(_NvrxBasic):
    """CPU shim of nvidia-resiliency-ext's ``BasicTensorAwareStateDict`` (0.4.1).

    Upstream asserts ``tensor.is_cuda`` for every tensor in ``__init__`` and moves tensors to
    ``"cuda"`` in ``restore_tensor_device``; both are the only CUDA-only calls on the save/load
    path of ``LocalCheckpointManager``.  ``TensorAwareStateDict`` is the package's interface for
    user state dicts, so this subclass keeps everything else (pop/insert/init tensors, which the
    replication strategies use) and only drops the CUDA assumption."""

    def __init__(self, state_dict):
        self.state_dict = state_dict
        self._is_hollow = False

    def restore_tensor_device(self, non_blocking=True):
        assert not self.is_hollow
