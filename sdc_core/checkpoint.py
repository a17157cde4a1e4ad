"""Checkpoint alteration and verification (torch only).

Checkpoint alteration is the fault-injection technique of the SBAC-PAD 2022 study of DDP and
Horovod training: flip bits in a saved checkpoint, resume, and watch what happens. This module
reads Lightning ``.ckpt`` files, plain ``torch.save`` state dicts and Accelerate ``save_state``
folders, flips chosen bits in chosen tensors with a seeded generator, and logs every flip
(tensor, index, bit, old and new value) so a run can be replayed. It never writes over its input
unless asked to, and writes every output atomically (a hard link to the input is replaced, never
written through) and only to a regular file: a device or FIFO given as the output is refused.

Every file is read with ``weights_only=True`` (``sdc_core.safeio.load_torch``): reading a checkpoint
cannot run code hidden in it; ``trust_pickle=True`` opts in, loudly, for a legacy file you wrote.

``fingerprint_checkpoint(obj)`` is what ``WeightFingerprintCheck`` stores in the checkpoints it
sees written; ``verify(path)`` recomputes it and names the tensors that changed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sdc_core.errors import FingerprintMismatchError
from sdc_core.faults import flip_bit
from sdc_core.fingerprint import tensor_digest, tensor_digest_v1
from sdc_core.safeio import (
    OutputError,
    UnreadableError,
    atomic_write,
    atomic_write_text,
    check_output,
    load_torch,
    output_mode,
)

FINGERPRINT_KEY = "sdc_fingerprint"
_DIGESTS = {1: tensor_digest_v1, 2: tensor_digest}  # fingerprint version -> per-tensor digest (newest written)
FINGERPRINT_VERSION = max(_DIGESTS)
BIT_CLASSES = ("sign", "exponent_top", "exponent", "mantissa")
# (exponent bits, mantissa bits) per float format
_LAYOUT = {torch.float32: (8, 23), torch.bfloat16: (8, 7), torch.float16: (5, 10), torch.float64: (11, 52)}


def bits_of_class(dtype: torch.dtype, bit_class: str) -> list[int]:
    """Bit positions (0 = least significant) of a bit class in a float format."""
    if dtype not in _LAYOUT:
        raise ValueError(f"bit classes are defined for float formats, not {dtype}")
    exp, man = _LAYOUT[dtype]
    width = 1 + exp + man
    classes = {
        "sign": [width - 1],
        "exponent_top": [width - 2],
        "exponent": list(range(man, width - 2)),
        "mantissa": list(range(man)),
    }
    if bit_class not in classes:
        raise ValueError(f"bit class must be one of {BIT_CLASSES}, got {bit_class!r}")
    return classes[bit_class]


def fingerprint_checkpoint(obj: dict[str, Any], version: int = FINGERPRINT_VERSION) -> dict[str, Any]:
    """Per-tensor exact digests of a checkpoint's weights and optimizer state (what
    ``WeightFingerprintCheck`` stores under ``sdc_fingerprint`` in the checkpoints it sees written).

    For a Lightning checkpoint: every tensor under ``state_dict`` and ``optimizer_states``; for a
    plain state dict: every tensor. ``version`` picks the digest (older ones verify older files):
    2 is ``tensor_digest``; 1, the plain word sum of earlier releases, only verifies their files."""
    if version not in _DIGESTS:
        raise ValueError(f"unknown {FINGERPRINT_KEY} version {version!r} (this release reads {sorted(_DIGESTS)})")
    digest = _DIGESTS[version]
    lightning = "state_dict" in obj
    tensors = {
        key: int(digest(t))
        for key, t in _walk(obj, "")
        if not lightning or key.startswith(("state_dict/", "optimizer_states/"))
    }
    return {"version": version, "tensors": tensors}


class FingerprintUnusable(ValueError):
    """A stored fingerprint that cannot be compared: ``damaged`` (not the shape this module
    writes: the file changed) or written with another fingerprint version."""

    def __init__(self, message: str, damaged: bool) -> None:
        super().__init__(message)
        self.damaged = damaged


def stored_fingerprint(obj: Any) -> tuple[int, dict[str, int]] | None:
    """``(version, per-tensor digests)`` stored in ``obj`` (None: none stored); raises
    ``FingerprintUnusable`` when an entry is stored but damaged or of a version this release
    does not know."""
    if not isinstance(obj, dict) or FINGERPRINT_KEY not in obj:
        return None
    stored = obj[FINGERPRINT_KEY]
    tensors = stored.get("tensors") if isinstance(stored, dict) else None
    version = stored.get("version", 1) if isinstance(stored, dict) else None
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in tensors.items()
    ):
        raise FingerprintUnusable("its stored SDC fingerprint is damaged (not the shape sdc-checks writes)", True)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise FingerprintUnusable(f"its stored SDC fingerprint is damaged (version {version!r})", True)
    if version not in _DIGESTS:
        raise FingerprintUnusable(
            f"its SDC fingerprint is version {version}, this sdc-checks verifies versions {sorted(_DIGESTS)} "
            "(verify it with the sdc-checks that wrote it)",
            False,
        )
    return version, tensors


def changed_tensors(obj: dict[str, Any]) -> list[str] | None:
    """Names of the tensors whose digest differs from the stored fingerprint (None: none stored).

    Raises ``FingerprintUnusable`` when a fingerprint is stored but cannot be compared."""
    stored = stored_fingerprint(obj)
    if stored is None:
        return None
    version, was = stored
    now = fingerprint_checkpoint(obj, version)["tensors"]
    return sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))


@dataclass
class Checkpoint:
    """A loaded checkpoint: its kind, its objects and where each came from."""

    kind: str  # "lightning", "state_dict" or "accelerate"
    path: Path
    objects: dict[str, Any] = field(default_factory=dict)  # file name (or "") -> loaded object
    metadata: dict[str, dict[str, str] | None] = field(default_factory=dict)  # safetensors header metadata

    @classmethod
    def load(cls, path: str | Path, trust_pickle: bool = False) -> Checkpoint:
        """Read a checkpoint with ``weights_only=True`` (``trust_pickle``: full unpickling, loudly).

        Raises ``UnreadableError`` naming the file when it cannot be read or is not a checkpoint."""
        path = Path(path)
        if not path.exists():
            raise UnreadableError(f"{path} does not exist")
        if not path.is_dir():
            obj = load_torch(path, trust_pickle)
            kind = "lightning" if isinstance(obj, dict) and "state_dict" in obj else "state_dict"
            return cls(kind, path, {"": obj})
        objects: dict[str, Any] = {}
        metadata: dict[str, dict[str, str] | None] = {}
        try:
            files = sorted(path.iterdir())
        except OSError as err:
            raise UnreadableError(f"cannot read folder {path}: {err.strerror or err}") from None
        for f in files:
            if f.suffix == ".safetensors":
                objects[f.name], metadata[f.name] = _safetensors_load(f)
            elif f.suffix in (".bin", ".pt", ".pth"):
                objects[f.name] = load_torch(f, trust_pickle)
        if not objects:
            raise UnreadableError(f"{path} holds no model or optimizer files of an Accelerate save_state folder "
                                  "(*.safetensors, *.bin, *.pt, *.pth)")  # fmt: skip
        return cls("accelerate", path, objects, metadata)

    def tensors(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(name, group, tensor)`` for every floating tensor; group is "weights" or "optimizer"."""
        for fname, obj in self.objects.items():
            for key, t in _walk(obj, fname):
                if not t.is_floating_point():
                    continue
                yield key, _group(self.kind, key), t

    def save(self, out: Path) -> None:
        """Write to ``out`` atomically. A file is written beside ``out`` and renamed onto it; a
        folder is built beside ``out`` and renamed into place (``out`` must not exist or be empty),
        or, when ``out`` is the folder read, each of its files is replaced in turn."""
        if self.kind != "accelerate":
            atomic_write(out, lambda f: torch.save(self.objects[""], f))
            return
        if out.exists() and out.resolve() == self.path.resolve():
            for fname in self.objects:
                self._save_file(fname, out / fname)
            return
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise OutputError(f"{out} already exists; give a new (or empty) folder for the altered copy")
        if not out.parent.is_dir():
            raise OutputError(f"cannot write {out}: folder {out.parent} does not exist; create it first")
        try:
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        except OSError as err:
            raise OutputError(f"cannot write {out}: {err.strerror or err}") from None
        try:
            shutil.copytree(self.path, tmp, dirs_exist_ok=True)
            for fname in self.objects:
                self._save_file(fname, tmp / fname)
            os.chmod(tmp, output_mode(out, folder=True))  # mkdtemp made it 0o700
            if out.exists():
                out.rmdir()
            os.replace(tmp, out)
        except OSError as err:
            raise OutputError(f"cannot write {out}: {err.strerror or err}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _save_file(self, fname: str, dst: Path) -> None:
        obj = self.objects[fname]
        if fname.endswith(".safetensors"):
            from safetensors.torch import save

            data = save(obj, metadata=self.metadata.get(fname))
            atomic_write(dst, lambda f: f.write(data))
        else:
            atomic_write(dst, lambda f: torch.save(obj, f))


def _safetensors_load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """Tensors and header metadata of a ``.safetensors`` file (a format that holds no code)."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    except Exception as err:
        text = str(err).splitlines()[0] if str(err) else ""
        raise UnreadableError(f"{path} is not a readable safetensors file: {type(err).__name__}: {text}") from None


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in nested dicts, lists and tuples, depth first in order;
    a container met again on its own path (a self-referencing file) is not entered again."""
    stack: list[tuple[Any, str, frozenset[int]]] = [(obj, prefix, frozenset())]
    while stack:
        item, name, seen = stack.pop()
        if isinstance(item, torch.Tensor):
            yield name, item
            continue
        if isinstance(item, dict):
            children = [(v, f"{name}/{k}" if name else str(k)) for k, v in item.items() if k != FINGERPRINT_KEY]
        elif isinstance(item, list | tuple):
            children = [(v, f"{name}/{i}" if name else str(i)) for i, v in enumerate(item)]
        else:
            continue
        if id(item) in seen:
            continue
        inner = seen | {id(item)}
        stack.extend((v, n, inner) for v, n in reversed(children))


# per checkpoint kind: (name prefix, group) in order, and the group of everything else
_GROUPS: dict[str, tuple[tuple[tuple[str, ...], str], ...]] = {
    "lightning": ((("state_dict/",), "weights"), (("optimizer_states/",), "optimizer")),
    "accelerate": ((("optimizer",), "optimizer"), (("model", "pytorch_model"), "weights")),
    "state_dict": ((("optimizer", "optim"), "optimizer"),),
}
_OTHER = {"lightning": "other", "accelerate": "other", "state_dict": "weights"}


def _group(kind: str, key: str) -> str:
    return next((group for prefixes, group in _GROUPS[kind] if key.startswith(prefixes)), _OTHER[kind])


@dataclass(frozen=True)
class Corruption:
    """What to flip (validated on construction)."""

    target: str = "weights"  # "weights", "optimizer" or "all"
    pattern: str | None = None  # regular expression on tensor names
    count: int | None = 1
    fraction: float | None = None
    bit_class: str | None = "exponent_top"
    bits: tuple[int, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.target not in ("weights", "optimizer", "all"):
            raise ValueError(f"target must be weights, optimizer or all, got {self.target!r}")
        if (self.count is None) == (self.fraction is None):
            raise ValueError("give exactly one of count and fraction")
        if self.count is not None and self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if (self.bit_class is None) == (self.bits is None):
            raise ValueError("give exactly one of bit_class and bits")
        if self.bit_class is not None and self.bit_class not in BIT_CLASSES:
            raise ValueError(f"bit_class must be one of {BIT_CLASSES}, got {self.bit_class!r}")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {err}") from None
        if self.bits is not None and (not self.bits or any(not 0 <= b < 64 for b in self.bits)):
            raise ValueError(f"bits must be bit positions in 0..63, got {list(self.bits)}")


def distinct_positions(total: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct positions in ``range(total)``, sorted, every ``n``-subset equally likely.

    Memory is O(n), not O(total): iid uniform draws are pooled until ``n`` distinct values are
    seen (given its size, the set of distinct draws is a uniform subset), then ``n`` of them are
    kept at random. When ``n`` is at least half of ``total`` a permutation of ``range(total)``
    costs no more than the answer and is used instead."""
    if not 0 <= n <= total:
        raise ValueError(f"cannot pick {n} distinct positions out of {total}")
    if 2 * n >= total:
        return torch.randperm(total, generator=gen)[:n].sort().values
    pool = torch.empty(0, dtype=torch.int64)
    while pool.numel() < n:
        need = n - pool.numel()
        draws = torch.randint(total, (need + need // 2 + 16,), generator=gen, dtype=torch.int64)
        pool = torch.unique(torch.cat([pool, draws]))
    if pool.numel() > n:
        pool = pool[torch.randperm(pool.numel(), generator=gen)[:n]]
    return pool.sort().values


def corrupt(ckpt: Checkpoint, spec: Corruption) -> list[dict[str, Any]]:
    """Flip bits of ``ckpt``'s tensors in memory as ``spec`` says; returns the flip log."""
    rx = re.compile(spec.pattern) if spec.pattern else None
    chosen = [(name, t) for name, group, t in ckpt.tensors()
              if (spec.target == "all" or group == spec.target) and (rx is None or rx.search(name))]  # fmt: skip
    if not chosen:
        raise ValueError(f"no floating tensor matches target={spec.target!r} pattern={spec.pattern!r} in {ckpt.path}")
    sizes = torch.tensor([t.numel() for _, t in chosen], dtype=torch.float64)
    total = int(sizes.sum())
    if total == 0:
        raise ValueError(f"the tensors matching target={spec.target!r} pattern={spec.pattern!r} are empty")
    n = spec.count if spec.count is not None else max(1, round(spec.fraction * total))  # type: ignore[operator]
    gen = torch.Generator().manual_seed(spec.seed)
    flat = distinct_positions(total, min(n, total), gen)
    bounds = torch.cumsum(sizes.long(), 0)
    log = []
    for pos in flat.tolist():
        ti = int(torch.searchsorted(bounds, torch.tensor(pos), right=True))
        name, t = chosen[ti]
        index = pos - (int(bounds[ti - 1]) if ti else 0)
        options = list(spec.bits) if spec.bits is not None else bits_of_class(t.dtype, spec.bit_class)  # type: ignore[arg-type]
        bit = options[int(torch.randint(len(options), (1,), generator=gen))]
        target = t if t.is_contiguous() else None
        if target is None:
            raise ValueError(f"tensor {name} is not contiguous")
        old, new = flip_bit(target, index, bit)
        log.append({"tensor": name, "index": index, "bit": bit, "old": old, "new": new, "dtype": str(t.dtype)})
    return log


def corrupt_file(src: str | Path, out: str | Path | None, spec: Corruption, in_place: bool = False,
                 trust_pickle: bool = False) -> dict[str, Any]:  # fmt: skip
    """Load ``src``, flip as ``spec`` says, write ``out`` (or ``src`` with ``in_place``), and
    return the log (also written beside the output as ``<out>.flips.json``).

    Both files are written atomically; the input is never written unless ``in_place``, not even
    through another name for it (a hard link). Raises ``ValueError`` for a bad request,
    ``UnreadableError`` for an input that cannot be read, ``OutputError`` for an output that
    cannot be written."""
    src = Path(src)
    if in_place and out is not None and Path(out) != src:
        raise ValueError("give an output path or in_place=True (--in-place), not both")
    if out is None and not in_place:
        raise ValueError("give an output path (-o), or in_place=True (--in-place) to overwrite the input")
    dst = src if in_place else Path(out)  # type: ignore[arg-type]
    log_path = Path(f"{dst}.flips.json")
    if not in_place and _same(dst, src):
        raise ValueError(f"the output {dst} is the input file; pass --in-place (in_place=True) to overwrite it")
    if _same(log_path, src) or (src.is_dir() and _inside(log_path, src) and not in_place):
        raise ValueError(f"the flip log {log_path} would overwrite the input; choose another output name")
    if src.is_dir() and not in_place and _inside(dst, src):
        raise ValueError(f"the output {dst} is inside the input folder {src}; choose a folder outside it")
    if not src.is_dir():
        check_output(dst)  # a device, FIFO or folder is refused before any work
    check_output(log_path)
    ckpt = Checkpoint.load(src, trust_pickle)
    flips = corrupt(ckpt, spec)
    ckpt.save(dst)
    log = {"input": str(src), "output": str(dst), "kind": ckpt.kind, "spec": spec.__dict__, "flips": flips}
    atomic_write_text(log_path, json.dumps(log, indent=1, default=list))
    return log


def _same(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name the same file or folder (hard links and symlinks included)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _inside(a: Path, folder: Path) -> bool:
    return a.resolve().is_relative_to(folder.resolve())


def verify(path: str | Path, trust_pickle: bool = False) -> dict[str, Any]:
    """Recompute a checkpoint's fingerprint and compare it with the one stored when it was written.

    Returns ``{"status": "clean" | "corrupted" | "no_fingerprint", "changed": [...], "path": ...}``
    with ``"reason"`` when the status is not clean; ``UnreadableError`` for a file it cannot read.
    A damaged stored fingerprint counts as corrupted (the file changed); one of another version
    as no fingerprint it can use."""
    ckpt = Checkpoint.load(path, trust_pickle)
    obj = ckpt.objects.get("")
    out: dict[str, Any] = {"status": "no_fingerprint", "changed": [], "path": str(path)}
    try:
        changed = changed_tensors(obj) if isinstance(obj, dict) else None
    except FingerprintUnusable as err:
        return out | {"status": "corrupted" if err.damaged else "no_fingerprint", "reason": str(err)}
    if changed is None:
        where = "an Accelerate folder" if ckpt.kind == "accelerate" else "it was written without WeightFingerprintCheck"
        return out | {"reason": f"no SDC fingerprint stored ({where})"}
    total = len(obj[FINGERPRINT_KEY]["tensors"])
    out |= {"status": "corrupted" if changed else "clean", "changed": changed, "tensors": total}
    if changed:
        out["reason"] = f"{len(changed)} tensors changed since it was written"
    return out


def check_loaded_checkpoint(obj: dict[str, Any], step: int) -> None:
    """Raise ``FingerprintMismatchError`` (on every rank: each loads the same file) when a
    checkpoint's tensors no longer match the fingerprint stored with it, or that fingerprint is
    damaged; warn when it is of another version (it cannot be checked)."""
    try:
        changed = changed_tensors(obj)
    except FingerprintUnusable as err:
        if not err.damaged:
            warnings.warn(f"the checkpoint being loaded cannot be verified: {err}", UserWarning, stacklevel=2)
            return
        reason = f"the checkpoint changed on disk after it was written: {err}"
        details = {"checkpoint_fingerprint": str(err)}
        raise FingerprintMismatchError(step=step, rank=None, suspects=(), details=details, reason=reason) from None
    if not changed:
        return
    raise FingerprintMismatchError(
        step=step,
        rank=None,
        suspects=(),
        details={"checkpoint_changed_tensors": changed[:20], "changed_count": len(changed)},
        reason=f"the checkpoint changed on disk after it was written ({len(changed)} tensors, e.g. {changed[0]})",
    )


def newest_verified(folders: list[str | Path], max_step: int, trust_pickle: bool = False,
                    skipped: list[str] | None = None) -> Path | None:  # fmt: skip
    """The newest checkpoint under ``folders`` written at or before optimizer step ``max_step``
    whose tensors still match the fingerprint stored with it (None when there is none). A
    weights-only checkpoint (no ``optimizer_states``) is passed over: Lightning cannot resume
    training from one either.

    Files are read with ``weights_only=True`` unless ``trust_pickle``; each file passed over is
    appended to ``skipped`` (when given) with the reason."""
    best: tuple[int, float, Path] | None = None
    for folder in map(Path, folders):
        for path in sorted(folder.glob("*.ckpt")) if folder.is_dir() else []:
            try:  # a hostile or odd file is passed over, never raised: the caller's ranks wait for the answer
                obj = load_torch(path, trust_pickle)
                step = int(obj.get("global_step", -1)) if isinstance(obj, dict) else -1
                changed = changed_tensors(obj) if 0 <= step <= max_step else None
                mtime = path.stat().st_mtime
            except Exception as err:  # unreadable, odd step, unusable fingerprint
                if skipped is not None:
                    skipped.append(f"{path}: {err}")
                continue
            if "optimizer_states" not in obj and 0 <= step <= max_step:  # Lightning save_weights_only
                if skipped is not None:
                    skipped.append(f"{path}: weights only (no optimizer state to roll back to)")
                continue
            if step < 0 or step > max_step or changed != []:
                if skipped is not None and step <= max_step:
                    why = "no fingerprint" if changed is None else f"changed tensors {changed[:3]}"
                    skipped.append(f"{path}: {why}" if step >= 0 else f"{path}: no global_step")
                continue
            key = (step, mtime, path)
            best = key if best is None or key[:2] > best[:2] else best
    return best[2] if best else None
