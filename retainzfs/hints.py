"""Reclaim hints: xattr names, `.retainz` policy parsing, presets, epoch/hint derivation.

Why here and not in the store: these are the *rules* that turn what a runtime says (xattrs) or
what a directory declares (a `.retainz` TOML file) into a (birth, reclaim, stream) triple.  The
store only asks "what is the hint of this path?" and places data accordingly.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import errno
import logging
import math
import re
import tomllib
from dataclasses import dataclass, field

import regex       # policy regexes: like re, plus a per-match timeout (user-supplied patterns)

log = logging.getLogger("retainzfs")

XATTR_BIRTH = b"user.retainz.birth"
XATTR_RECLAIM = b"user.retainz.reclaim"
XATTR_STREAM = b"user.retainz.stream"
HINT_XATTRS = (XATTR_BIRTH, XATTR_RECLAIM, XATTR_STREAM)
# Read-only virtual xattrs reporting placement/state.
XATTR_ZONES = b"user.retainz.zones"
XATTR_HINT = b"user.retainz.hint"
XATTR_STATUS = b"user.retainz.status"
#: root only: ``user.retainz.zonemap.<first zone>`` -> JSON rows of up to ZONEMAP_ROWS zones
#: (paged: an xattr value holds at most 64 KiB)
XATTR_ZONEMAP = b"user.retainz.zonemap."
ZONEMAP_ROWS = 1024
VIRTUAL_XATTRS = (XATTR_ZONES, XATTR_HINT, XATTR_STATUS)
#: set by ``retainzfs fsck --repair`` on files with data past a damaged zone's write pointer
XATTR_DAMAGED = b"user.retainz.damaged"
#: the prefix of every retainzfs xattr
XATTR_PREFIX = b"user.retainz."
#: the names under it a user may set (and ``cp -a`` copy); any other is refused, so a
#: misspelt hint (``user.retainz.reclaims``) is an error, not a name stored and never read
SETTABLE_XATTRS = HINT_XATTRS + (XATTR_DAMAGED,)

#: births and streams are journaled as signed 64-bit integers (records.pack_inode)
EPOCH_MAX = (1 << 63) - 1
POLICY_NAME = b".retainz"
POLICY_MAX = 1 << 20           # a .retainz larger than this is refused, never read as empty
INF = math.inf
#: a user's generation/rolling regex may backtrack catastrophically; one match may take at most
#: this long, and a policy whose pattern ever times out stops matching (and says so)
MATCH_TIMEOUT = 0.01
#: names whose generation is remembered per policy before the memo starts afresh (one name
#: per save under a policy's directory: bounded for a daemon that runs for months)
POLICY_CACHE_MAX = 4096
_PROBES = ["a" * 64 + "!", "1" * 64 + "!", "step-" + "1" * 60 + "x", "-_=." * 16 + "!",
           "aA0-_=." * 9 + "\x00"]

#: generation-name patterns of each framework preset (group 1 = birth epoch), checked against
#: the layouts the real frameworks write (tests/test_frameworks.py):
#:   torchtitan  <folder>/step-100/{__0_0.distcp,.metadata}          (CheckpointManager)
#:   megatron    <save>/iter_0000100/...  (7-digit, zero padded)      (get_checkpoint_name)
#:   hf          <output_dir>/checkpoint-500/model-00001-of-00002.safetensors ... (Trainer;
#:               transformers 4.36-4.38 wrote tmp-checkpoint-500/ and renamed it)
#:   lightning   <dirpath>/epoch=0-step=100.ckpt, epoch=0-step=100-v1.ckpt, ...-val_loss=0.12.ckpt
#:   dcp         step-100/, checkpoint_100/, ckpt-7.pt, epoch=3.pth (dirs or single files)
PRESETS: dict[str, str] = {
    "torchtitan": r"^step-(\d+)$",
    "megatron": r"^iter_(\d+)$",
    "hf": r"^(?:tmp-)?checkpoint-(\d+)$",
    "lightning": r"(?:^|[-_])step=(\d+)(?=[-_.]|$)",
    "dcp": r"^(?:step|checkpoint|ckpt|epoch)[-_=]?(\d+)(?:\.[A-Za-z0-9]+)?$",
    # nvidia-resiliency-ext local checkpoints: written as ...local.dirty.pt, then renamed
    "nvrx": r"^iter_(\d+)_\d+_local(?:\.dirty)?\.pt$",
}
#: "rolling" files of each preset: not a generation, rewritten (or replaced) at every save, so
#: the data written now die at the next save: birth = newest generation beside it, reclaim =
#: birth + cadence.  Megatron's tracker file is rewritten in place after each save; Lightning's
#: ``last.ckpt`` (save_last=True) is rewritten at each save (save_last="link" makes it a symlink).
ROLLING: dict[str, str] = {
    "megatron": r"^latest_checkpointed_iteration\.txt$",
    "lightning": r"^last(?:-v\d+)?\.ckpt$",
}
DEFAULT_GENERATION = r"(?:step|iter|checkpoint|ckpt|epoch)[-_=]?(\d+)"
_POLICY_KEYS = {"preset", "keep_latest", "cadence", "generation", "milestone_every", "stream",
                "retain_interval", "rolling"}


class HintError(ValueError):
    """Bad hint input (xattr value or `.retainz`); carries the errno the caller should return."""

    def __init__(self, message: str, err: int = errno.EINVAL):
        super().__init__(message)
        self.errno = err


@dataclass(frozen=True)
class Hint:
    """Placement hint of a file: birth epoch, reclaim epoch (inf = anchor), stream."""
    birth: int
    reclaim: float
    stream: int = 0
    source: str = "xattr"

    @property
    def anchor(self) -> bool:
        return math.isinf(self.reclaim)


UNHINTED = Hint(0, INF, 0, "none")


@dataclass(frozen=True)
class Policy:
    """A parsed `.retainz` file."""
    keep_latest: int | None = None
    cadence: int | None = None
    generation: str = DEFAULT_GENERATION
    milestone_every: int | None = None
    preset: str | None = None
    stream: int | None = None
    pattern: regex.Pattern = field(default=regex.compile(DEFAULT_GENERATION), compare=False,
                                   repr=False)
    rolling: str | None = None
    rolling_pattern: regex.Pattern | None = field(default=None, compare=False, repr=False)
    #: name -> birth (or None): every name is matched once per policy
    cache: dict = field(default_factory=dict, compare=False, repr=False)
    #: set when a match timed out: the pattern is disabled, the error is reported
    slow: list = field(default_factory=list, compare=False, repr=False)


def parse_int_xattr(name: bytes, value: bytes) -> int:
    try:
        text = value.decode("ascii").strip()
        if not re.fullmatch(r"-?\d+", text):
            raise ValueError
        return int(text)
    except (UnicodeDecodeError, ValueError):
        raise HintError(f"{name.decode()}: expected an integer, got {value[:40]!r}") from None


def validate_xattr(name: bytes, value: bytes) -> float | int:
    """Check a hint xattr value; raise HintError (EINVAL) when it is malformed."""
    if name == XATTR_RECLAIM:
        if value.strip().lower() in (b"inf", b"infinity", b"anchor"):
            return INF
        v = parse_int_xattr(name, value)
        if v < 0:
            raise HintError(f"{name.decode()}: must be >= 0 (or inf)")
        return v
    if name in (XATTR_BIRTH, XATTR_STREAM):
        v = parse_int_xattr(name, value)
        if not 0 <= v <= EPOCH_MAX:
            raise HintError(f"{name.decode()}: must be between 0 and {EPOCH_MAX}")
        return v
    raise HintError(f"unknown hint xattr {name!r}")


def hint_from_xattrs(xattrs: dict[bytes, bytes]) -> Hint | None:
    """A hint when the xattrs name a reclaim epoch (birth defaults to 0)."""
    if XATTR_RECLAIM not in xattrs:
        return None
    reclaim = validate_xattr(XATTR_RECLAIM, xattrs[XATTR_RECLAIM])
    birth = validate_xattr(XATTR_BIRTH, xattrs[XATTR_BIRTH]) if XATTR_BIRTH in xattrs else 0
    stream = validate_xattr(XATTR_STREAM, xattrs[XATTR_STREAM]) if XATTR_STREAM in xattrs else 0
    return Hint(int(birth), float(reclaim), int(stream), "xattr")


def _pos_int(doc: dict, key: str) -> int | None:
    if key not in doc:
        return None
    v = doc[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise HintError(f".retainz: {key} must be a positive integer, got {v!r}")
    return v


def parse_policy(data: bytes) -> Policy:
    """Parse and validate a `.retainz` file; raise HintError with a clear message if malformed."""
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise HintError(".retainz: not UTF-8 text") from None
    except RecursionError:                # (tomllib recurses per bracket)
        raise HintError(".retainz: invalid TOML: arrays or tables nested too deeply") from None
    except ValueError as e:               # TOMLDecodeError, or an integer of 4,300+ digits
        raise HintError(f".retainz: invalid TOML: {e}") from None
    unknown = set(doc) - _POLICY_KEYS
    if unknown:
        raise HintError(f".retainz: unknown key(s) {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(sorted(_POLICY_KEYS))}")
    preset = doc.get("preset")
    if preset is not None and preset not in PRESETS:
        raise HintError(f".retainz: unknown preset {preset!r}; one of {', '.join(PRESETS)}")
    gen = doc.get("generation")
    if gen is None:
        gen = PRESETS[preset] if preset else DEFAULT_GENERATION
    if not isinstance(gen, str):
        raise HintError(".retainz: generation must be a regex string")
    pat = _compile(gen, "generation")
    if pat.groups < 1:
        raise HintError(f".retainz: generation regex {gen!r} needs a group for the birth epoch")
    keep = _pos_int(doc, "keep_latest")
    cadence = _pos_int(doc, "cadence")
    milestone = _pos_int(doc, "milestone_every") or _pos_int(doc, "retain_interval")
    stream = doc.get("stream")
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int) or stream < 0):
        raise HintError(".retainz: stream must be an integer >= 0")
    rolling = doc.get("rolling", ROLLING.get(preset) if preset else None)
    rpat = None
    if rolling is not None:
        if not isinstance(rolling, str):
            raise HintError(".retainz: rolling must be a regex string")
        if rolling:                       # rolling = "" switches a preset's rolling rule off
            rpat = _compile(rolling, "rolling")
    return Policy(keep, cadence, gen, milestone, preset, stream, pat,
                  rolling=rolling or None, rolling_pattern=rpat)


def _compile(pat: str, what: str) -> regex.Pattern:
    """Compile a policy regex; refuse one that is invalid or visibly too slow to match."""
    try:
        cp = regex.compile(pat)
    except (regex.error, ValueError, OverflowError) as e:
        raise HintError(f".retainz: {what} regex {pat!r}: {e}") from None
    for probe in _PROBES:
        try:
            cp.search(probe, timeout=MATCH_TIMEOUT * 5)
        except TimeoutError:
            raise HintError(f".retainz: {what} regex {pat!r} is too slow to match "
                            f"(catastrophic backtracking)") from None
    return cp


def _search(policy: Policy, pat: regex.Pattern, name: str):
    """``pat.search(name)`` bounded in time; a timeout disables the policy's matching."""
    if policy.slow:
        return None
    try:
        return pat.search(name, timeout=MATCH_TIMEOUT)
    except TimeoutError:
        policy.slow.append(f"regex {pat.pattern!r} took over {MATCH_TIMEOUT * 1000:.0f} ms "
                           f"on {name[:60]!r}; matching disabled")
        log.error(".retainz: %s", policy.slow[0])
        return None


def generation_birth(policy: Policy, name: str) -> int | None:
    """Birth epoch encoded in a generation name, or None when the name is not a generation."""
    try:
        return policy.cache[name]
    except KeyError:
        pass
    m = _search(policy, policy.pattern, name)
    birth = None
    if m:
        try:
            birth = int(m.group(1))
        except (TypeError, ValueError, IndexError):
            birth = None
        if birth is not None and birth > EPOCH_MAX:
            birth = None                  # no epoch that large: not a generation name
    if len(policy.cache) >= POLICY_CACHE_MAX:
        policy.cache.clear()
    policy.cache[name] = birth
    return birth


def infer_cadence(births: list[int]) -> int | None:
    """Smallest positive gap between known generation births (the save cadence)."""
    b = sorted(set(births))
    gaps = [y - x for x, y in zip(b, b[1:]) if y > x]
    return min(gaps) if gaps else None


def derive_hint(policy: Policy, components: list[str], sibling_births: list[int],
                stream: int) -> Hint | None:
    """Hint of a path below a policy directory.

    ``components`` are the path parts below the directory holding `.retainz`; the first part
    that matches the generation pattern gives the birth ``a``.  Latest-K with cadence ``c``
    gives ``d = a + c*K``; milestones (``a % milestone_every == 0``) and policies without
    ``keep_latest`` are anchors.  When ``cadence`` is absent it is inferred from the sibling
    generations' names, and from the birth itself for the very first generation (step-100 ->
    cadence 100).
    """
    for i, comp in enumerate(components):
        birth = generation_birth(policy, comp)
        if birth is None:
            continue
        if policy.milestone_every and birth > 0 and birth % policy.milestone_every == 0:
            return Hint(birth, INF, stream, "policy-milestone")
        if not policy.keep_latest:
            return Hint(birth, INF, stream, "policy")
        cadence = policy.cadence or infer_cadence(sibling_births + [birth]) or max(birth, 1)
        return Hint(birth, float(birth + cadence * policy.keep_latest), stream, "policy")
    return None


def nongeneration_hint(policy: Policy, components: list[str], sibling_births: list[int],
                       stream: int) -> Hint:
    """Hint of a path below a policy directory that is not inside a generation.

    A *rolling* file (the policy's ``rolling`` regex on the file name, e.g. Megatron's
    ``latest_checkpointed_iteration.txt``) holds what the newest save wrote and is replaced by the
    next one: ``birth`` = the newest generation among its siblings, ``reclaim`` = birth + cadence.
    Everything else (and a rolling file with no generation beside it yet) is an anchor.
    """
    name = components[-1] if components else ""
    if (policy.rolling_pattern is not None and sibling_births
            and _search(policy, policy.rolling_pattern, name)):
        birth = max(sibling_births)
        cadence = policy.cadence or infer_cadence(sibling_births) or max(birth, 1)
        return Hint(birth, float(birth + cadence), stream, "policy-rolling")
    return Hint(0, INF, stream, "policy-nongeneration")


class HintResolver(ABC):
    """The one hint resolution: a file's own hint xattrs, else an ancestor's hint xattrs
    (``xattr-inherited``), else the nearest ancestor's ``.retainz`` policy (a generation below
    it, a rolling file, or an anchor), else :data:`UNHINTED`.

    The store resolves over inodes, ``retainzfs hints`` over paths of a mount; both subclass this
    and say only how to walk their tree, so they cannot disagree on the rules (the default
    stream of a policy without ``stream`` is the policy directory's inode number)."""

    @abstractmethod
    def parent(self, node):
        """The directory holding ``node``, or None at the root (or when it is unknown)."""
        ...

    @abstractmethod
    def name(self, node) -> str:
        """The name of ``node`` in its parent."""
        ...

    @abstractmethod
    def xattrs(self, node) -> dict:
        """``node``'s xattrs (at least the hint xattrs), name bytes -> value bytes."""
        ...

    @abstractmethod
    def policy(self, d) -> Policy | None:
        """The ``.retainz`` policy in force in directory ``d`` itself (not inherited)."""
        ...

    @abstractmethod
    def entry_names(self, d):
        """Names of the entries of directory ``d`` (str)."""
        ...

    @abstractmethod
    def dir_id(self, d) -> int:
        """The inode number of directory ``d`` (the default stream of its policy)."""
        ...

    def resolve(self, node) -> Hint:
        h = hint_from_xattrs(self.xattrs(node))
        if h is not None:
            return h
        chain = []          # (dir, name of the child on the path below it)
        child = node
        while True:
            parent = self.parent(child)
            if parent is None:
                break
            chain.append((parent, self.name(child)))
            child = parent
        names_below: list[str] = []
        for depth, (d, name) in enumerate(chain):
            names_below.insert(0, name)
            h = hint_from_xattrs(self.xattrs(d))
            if h is not None:
                return Hint(h.birth, h.reclaim, h.stream, "xattr-inherited")
            pol = self.policy(d)
            if pol is None:
                continue
            stream = pol.stream if pol.stream is not None else self.dir_id(d)
            for k, comp in enumerate(names_below):
                if generation_birth(pol, comp) is None:
                    continue
                # births of the generation siblings: entries of the dir holding the generation
                holder = chain[depth - k][0] if k <= depth else d
                sibs = [b for b in (generation_birth(pol, n) for n in self.entry_names(holder))
                        if b is not None]
                h = derive_hint(pol, names_below[k:], sibs, stream)
                if h is not None:
                    return h
                break
            # not in a generation: a rolling file (tracker, last.ckpt) dies at the next save
            sibs = [b for b in (generation_birth(pol, n) for n in self.entry_names(chain[0][0]))
                    if b is not None]
            return nongeneration_hint(pol, names_below, sibs, stream)
        return UNHINTED


def round_hint(hint: float, grid: int) -> float:
    """Round a finite hint up to a grid of ``grid`` epochs (hint-precision experiments)."""
    if grid <= 1 or math.isinf(hint):
        return hint
    return float(math.ceil(hint / grid) * grid)
