"""`.retainz` parsing and hint derivation (hints.py), and the one hint resolution shared by the
store and `retainzfs hints` (hints.HintResolver): what the CLI predicts for a generation with no
data yet is what the store places the data with."""
from __future__ import annotations

import json
import math
import os

import pytest
import xattr
from hypothesis import given, settings
from hypothesis import strategies as st

from retainzfs import hints as H

from conftest import RETAINZFS, run

pos_int = st.integers(1, 10_000)
keys = st.fixed_dictionaries({}, optional={
    "preset": st.sampled_from(sorted(H.PRESETS)),
    "keep_latest": pos_int, "cadence": pos_int, "milestone_every": pos_int,
    "stream": st.integers(0, 1 << 40),
})


def toml(doc: dict) -> bytes:
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in doc.items()).encode()


@settings(max_examples=200, deadline=None)
@given(keys)
def test_valid_policies_parse_to_their_fields(doc):
    pol = H.parse_policy(toml(doc))
    assert pol.preset == doc.get("preset")
    assert pol.keep_latest == doc.get("keep_latest") and pol.cadence == doc.get("cadence")
    assert pol.milestone_every == doc.get("milestone_every") and pol.stream == doc.get("stream")
    want = H.PRESETS[doc["preset"]] if "preset" in doc else H.DEFAULT_GENERATION
    assert pol.generation == want
    assert pol.rolling == (H.ROLLING.get(doc["preset"]) if "preset" in doc else None)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_parse_or_raise_hint_error(data):
    """A .retainz is user input: it parses, or fails with HintError (EINVAL) — nothing else."""
    try:
        pol = H.parse_policy(data)
    except H.HintError as e:
        assert e.errno == 22 and str(e).startswith(".retainz")
    else:
        assert isinstance(pol, H.Policy)


@pytest.mark.parametrize("text, what", [
    (b"keep_latest = 0\n", "keep_latest must be a positive integer"),
    (b"keep_latest = true\n", "keep_latest must be a positive integer"),
    (b"cadence = -3\n", "cadence must be a positive integer"),
    (b"stream = -1\n", "stream must be an integer >= 0"),
    (b'preset = "nope"\n', "unknown preset"),
    (b"retention = 3\n", "unknown key(s) retention"),
    (b'generation = "step-\\\\d+"\n', "needs a group"),
    (b'generation = "("\n', "generation regex"),
    (b'generation = "(a|aa)+$"\n', "too slow"),
    (b"keep_latest = \n", "invalid TOML"),
    (b"\xff\xfe", "not UTF-8"),
    (b"keep_latest = " + b"[" * 100_000, "nested too deeply"),        # RecursionError before
    (b"a = " + b"{x=" * 3000, "nested too deeply"),
    (b"keep_latest = " + b"9" * 5000, "invalid TOML"),                # ValueError before
])
def test_malformed_policies_name_the_problem(text, what):
    with pytest.raises(H.HintError) as e:
        H.parse_policy(text)
    assert what in str(e.value)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(H.PRESETS)), st.integers(0, 10 ** 12), pos_int, pos_int,
       st.none() | pos_int)
def test_preset_generation_names_give_their_birth(preset, step, keep, cadence, milestone):
    name = {"torchtitan": f"step-{step}", "megatron": f"iter_{step:07d}",
            "hf": f"checkpoint-{step}", "lightning": f"epoch=0-step={step}.ckpt",
            "dcp": f"step-{step}", "nvrx": f"iter_{step:07d}_0_local.pt"}[preset]
    doc = {"preset": preset, "keep_latest": keep, "cadence": cadence}
    if milestone:
        doc["milestone_every"] = milestone
    pol = H.parse_policy(toml(doc))
    assert H.generation_birth(pol, name) == step
    h = H.derive_hint(pol, [name, "shard0"], [], 9)
    assert h.birth == step and h.stream == 9
    if milestone and step > 0 and step % milestone == 0:
        assert math.isinf(h.reclaim) and h.source == "policy-milestone"
    else:
        assert h.reclaim == step + cadence * keep and h.source == "policy"


def test_epochs_past_int64_are_not_generations():
    pol = H.parse_policy(b'preset = "torchtitan"\n')
    assert H.generation_birth(pol, f"step-{H.EPOCH_MAX}") == H.EPOCH_MAX
    assert H.generation_birth(pol, f"step-{H.EPOCH_MAX + 1}") is None


def test_rolling_file_dies_at_the_next_save():
    pol = H.parse_policy(b'preset = "megatron"\nkeep_latest = 2\n')
    h = H.nongeneration_hint(pol, ["latest_checkpointed_iteration.txt"], [100, 200], 0)
    assert (h.birth, h.reclaim, h.source) == (200, 300.0, "policy-rolling")
    h = H.nongeneration_hint(pol, ["notes.txt"], [100, 200], 0)
    assert math.isinf(h.reclaim) and h.source == "policy-nongeneration"


class _Tree(H.HintResolver):
    """A dict tree: {"name": {...}} dirs, None files; xattrs/policies by path tuple."""

    def __init__(self, tree, xattrs=None, policies=None):
        self.tree, self.x, self.p = tree, xattrs or {}, policies or {}

    def _node(self, path):
        n = self.tree
        for c in path:
            n = n[c]
        return n

    def parent(self, path):
        return path[:-1] if path else None

    def name(self, path):
        return path[-1]

    def xattrs(self, path):
        return self.x.get(path, {})

    def policy(self, d):
        return self.p.get(d)

    def entry_names(self, d):
        return list(self._node(d))

    def dir_id(self, d):
        return 1000 + len(d)


def test_resolver_rules_in_order():
    pol = H.parse_policy(b'preset = "torchtitan"\nkeep_latest = 2\n')
    tree = {"job": {"step-100": {"a": None}, "step-200": {"b": None}, "log.txt": None},
            "tagged": {"x": None}}
    r = _Tree(tree, xattrs={("tagged",): {H.XATTR_BIRTH: b"7", H.XATTR_RECLAIM: b"9"},
                            ("job", "step-200", "b"): {H.XATTR_RECLAIM: b"inf"}},
              policies={("job",): pol})
    h = r.resolve(("job", "step-100", "a"))
    assert (h.birth, h.reclaim, h.stream, h.source) == (100, 300.0, 1001, "policy")
    assert r.resolve(("job", "step-200", "b")).source == "xattr"
    assert r.resolve(("job", "log.txt")).source == "policy-nongeneration"
    h = r.resolve(("tagged", "x"))
    assert (h.birth, h.reclaim, h.source) == (7, 9.0, "xattr-inherited")
    assert r.resolve(("tagged",)).source == "xattr"
    assert r.resolve(("elsewhere",)) == H.UNHINTED


# ------------------------------------------------------------------ CLI and store agree
def _store_hint(p) -> dict:
    h = json.loads(xattr.getxattr(os.fspath(p), H.XATTR_HINT.decode()))
    r = h["reclaim"]
    return {"birth": h["birth"], "reclaim": r if r == "inf" else int(r), "stream": h["stream"],
            "source": h["source"]}


@pytest.mark.parametrize("policy, layout", [
    ('preset = "torchtitan"\nkeep_latest = 2\n', ["step-100", "step-200"]),     # no stream
    ('preset = "megatron"\nkeep_latest = 3\nstream = 7\n', ["iter_0000100", "iter_0000300"]),
    ('preset = "dcp"\nkeep_latest = 1\nmilestone_every = 1000\n', ["step-900", "step-1000"]),
    ('keep_latest = 2\ncadence = 50\n', ["run/ckpt-50", "run/ckpt-100"]),   # nested generation
])
def test_cli_prediction_is_what_the_store_places(mounted, policy, layout):
    job = mounted / "job"
    job.mkdir()
    (job / ".retainz").write_text(policy)
    for g in layout:
        os.makedirs(job / g)
    rep = json.loads(run(RETAINZFS, "hints", "--json", job).stdout)
    rows = {r["path"]: r for r in rep["generations"]}
    for g in layout:
        pred = rows[g]
        assert pred["source"].endswith(" (no data yet)"), pred
        with open(job / g / "shard0", "wb") as f:
            f.write(os.urandom(64 << 10))
            os.fsync(f.fileno())
        got = _store_hint(job / g / "shard0")
        want = {k: pred[k] for k in ("birth", "reclaim", "stream")}
        want["source"] = pred["source"].removesuffix(" (no data yet)")
        assert got == want, (g, got, pred)
    if "stream" not in policy:          # the default stream is the policy directory's inode
        assert got["stream"] == os.stat(job).st_ino


def test_names_that_are_not_utf8_read_alike_in_every_report(mounted):
    """Two generations whose names differ only in bytes that are not UTF-8: `hints --json`'s
    rows, the daemon's `hint_from` (and so `scrub` and the log, through the same spelling) name
    each the same way and the two apart, each such byte as \\xNN.  Before, the rows used
    Python's surrogate escapes and the daemon the replacement character, which made the two
    names one: ``/job/step-\\ufffd`` for both."""
    from retainzfs.runtime import tag_generation
    root = os.fsencode(str(mounted))
    for i, raw in enumerate([b"step-\xff", b"step-\xfe"]):
        d = os.fsdecode(root + b"/job/" + raw)
        tag_generation(d, birth=100 + i, reclaim=300 + i)
        with open(os.path.join(d, os.fsdecode(b"shard\x80.pt")), "wb") as f:
            f.write(os.urandom(4096))
    rep = json.loads(run(RETAINZFS, "hints", "--json", mounted / "job").stdout)
    rows = {r["path"]: r for r in rep["generations"]}
    assert set(rows) == {"step-\\xff", "step-\\xfe"}, rows
    for name, r in rows.items():
        assert r["hint_from"] == [f"/job/{name}/shard\\x80.pt"], r
    human = run(RETAINZFS, "hints", mounted / "job").stdout
    assert "step-\\xff" in human and "step-\\xfe" in human, human
