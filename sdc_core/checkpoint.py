"""Checkpoint alteration and verification (torch only).

Checkpoint alteration is the fault-injection technique of the SBAC-PAD 2022 study of DDP and
Horovod training: flip bits in a saved checkpoint, resume, and watch what happens. This module
reads Lightning ``.ckpt`` files, plain ``torch.save`` state dicts and Accelerate ``save_state``
folders, flips chosen bits in chosen tensors with a seeded generator, and logs every flip
(tensor, index, bit, old and new value) so a run can be replayed. It never writes over its input
unless asked to.

``fingerprint_state(state_dict)`` is what ``WeightFingerprintCheck`` stores in the checkpoints it
sees written; ``verify(path)`` recomputes it and names the tensors that changed.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sdc_core.errors import FingerprintMismatchError
from sdc_core.faults import flip_bit
from sdc_core.fingerprint import tensor_digest

FINGERPRINT_KEY = "sdc_fingerprint"
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


def fingerprint_checkpoint(obj: dict[str, Any]) -> dict[str, Any]:
    """Per-tensor exact digests of a checkpoint's weights and optimizer state (what
    ``WeightFingerprintCheck`` stores under ``sdc_fingerprint`` in the checkpoints it sees written).

    For a Lightning checkpoint: every tensor under ``state_dict`` and ``optimizer_states``; for a
    plain state dict: every tensor."""
    lightning = "state_dict" in obj
    tensors = {
        key: int(tensor_digest(t))
        for key, t in _walk(obj, "")
        if not lightning or key.startswith(("state_dict/", "optimizer_states/"))
    }
    return {"version": 1, "tensors": tensors}


def changed_tensors(obj: dict[str, Any]) -> list[str] | None:
    """Names of the tensors whose digest differs from the stored fingerprint (None: none stored)."""
    stored = obj.get(FINGERPRINT_KEY)
    if not isinstance(stored, dict) or not isinstance(stored.get("tensors"), dict):
        return None
    now = fingerprint_checkpoint(obj)["tensors"]
    was = stored["tensors"]
    return sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))


@dataclass
class Checkpoint:
    """A loaded checkpoint: its kind, its objects and where each came from."""

    kind: str  # "lightning", "state_dict" or "accelerate"
    path: Path
    objects: dict[str, Any] = field(default_factory=dict)  # file name (or "") -> loaded object

    @classmethod
    def load(cls, path: str | Path) -> Checkpoint:
        """Read a checkpoint; raises ``ValueError`` naming the file when it is not one."""
        path = Path(path)
        if path.is_dir():
            objects = {}
            for f in sorted(path.iterdir()):
                if f.suffix == ".safetensors":
                    from safetensors.torch import load_file

                    objects[f.name] = load_file(str(f))
                elif f.suffix in (".bin", ".pt", ".pth"):
                    objects[f.name] = _torch_load(f)
            if not objects:
                raise ValueError(f"{path} holds no model or optimizer files of an Accelerate save_state folder")
            return cls("accelerate", path, objects)
        obj = _torch_load(path)
        kind = "lightning" if isinstance(obj, dict) and "state_dict" in obj else "state_dict"
        return cls(kind, path, {"": obj})

    def tensors(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(name, group, tensor)`` for every floating tensor; group is "weights" or "optimizer"."""
        for fname, obj in self.objects.items():
            for key, t in _walk(obj, fname):
                if not t.is_floating_point():
                    continue
                yield key, _group(self.kind, key), t

    def save(self, out: Path) -> None:
        if self.kind == "accelerate":
            if out != self.path:
                shutil.copytree(self.path, out, dirs_exist_ok=True)
            for fname, obj in self.objects.items():
                if fname.endswith(".safetensors"):
                    from safetensors.torch import save_file

                    save_file(obj, str(out / fname))
                else:
                    torch.save(obj, out / fname)
        else:
            torch.save(self.objects[""], out)


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ValueError(f"{path} is not a readable torch checkpoint: {type(err).__name__}: {err}") from None


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k == FINGERPRINT_KEY:
                continue
            yield from _walk(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}/{i}" if prefix else str(i))


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
            re.compile(self.pattern)


def corrupt(ckpt: Checkpoint, spec: Corruption) -> list[dict[str, Any]]:
    """Flip bits of ``ckpt``'s tensors in memory as ``spec`` says; returns the flip log."""
    rx = re.compile(spec.pattern) if spec.pattern else None
    chosen = [(name, t) for name, group, t in ckpt.tensors()
              if (spec.target == "all" or group == spec.target) and (rx is None or rx.search(name))]  # fmt: skip
    if not chosen:
        raise ValueError(f"no floating tensor matches target={spec.target!r} pattern={spec.pattern!r} in {ckpt.path}")
    sizes = torch.tensor([t.numel() for _, t in chosen], dtype=torch.float64)
    total = int(sizes.sum())
    n = spec.count if spec.count is not None else max(1, round(spec.fraction * total))  # type: ignore[operator]
    gen = torch.Generator().manual_seed(spec.seed)
    flat = torch.randperm(total, generator=gen)[: min(n, total)].sort().values
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


def corrupt_file(src: str | Path, out: str | Path | None, spec: Corruption, in_place: bool = False) -> dict[str, Any]:
    """Load ``src``, flip as ``spec`` says, write ``out`` (or ``src`` with ``in_place``), and
    return the log (also written beside the output as ``<out>.flips.json``)."""
    src = Path(src)
    if out is None and not in_place:
        raise ValueError("give an output path, or in_place=True to overwrite the input")
    dst = src if in_place else Path(out)  # type: ignore[arg-type]
    if not in_place and dst.resolve() == src.resolve():
        raise ValueError("the output is the input; pass --in-place (in_place=True) to overwrite it")
    ckpt = Checkpoint.load(src)
    flips = corrupt(ckpt, spec)
    ckpt.save(dst)
    log = {"input": str(src), "output": str(dst), "kind": ckpt.kind, "spec": spec.__dict__, "flips": flips}
    Path(f"{dst}.flips.json").write_text(json.dumps(log, indent=1, default=list))
    return log


def verify(path: str | Path) -> dict[str, Any]:
    """Recompute a checkpoint's fingerprint and compare it with the one stored when it was written.

    Returns ``{"status": "clean" | "corrupted" | "no_fingerprint", "changed": [...], ...}``.
    """
    ckpt = Checkpoint.load(path)
    obj = ckpt.objects.get("")
    changed = changed_tensors(obj) if isinstance(obj, dict) else None
    if changed is None:
        return {"status": "no_fingerprint", "changed": [], "path": str(path)}
    total = len(obj[FINGERPRINT_KEY]["tensors"])
    return {"status": "corrupted" if changed else "clean", "changed": changed, "path": str(path), "tensors": total}


def check_loaded_checkpoint(obj: dict[str, Any], step: int) -> None:
    """Raise ``FingerprintMismatchError`` (on every rank: each loads the same file) when a
    checkpoint's tensors no longer match the fingerprint stored with it."""
    changed = changed_tensors(obj)
    if not changed:
        return
    raise FingerprintMismatchError(
        step=step,
        rank=None,
        suspects=(),
        details={"checkpoint_changed_tensors": changed[:20], "changed_count": len(changed)},
        reason=f"the checkpoint changed on disk after it was written ({len(changed)} tensors, e.g. {changed[0]})",
    )


def newest_verified(folders: list[str | Path], max_step: int) -> Path | None:
    """The newest checkpoint under ``folders`` written at or before optimizer step ``max_step``
    whose tensors still match the fingerprint stored with it (None when there is none)."""
    best: tuple[int, float, Path] | None = None
    for folder in map(Path, folders):
        for path in sorted(folder.glob("*.ckpt")) if folder.is_dir() else []:
            try:
                obj = _torch_load(path)
            except ValueError:  # unreadable: not a candidate
                continue
            step = int(obj.get("global_step", -1)) if isinstance(obj, dict) else -1
            if step < 0 or step > max_step or changed_tensors(obj) != []:
                continue
            key = (step, path.stat().st_mtime, path)
            best = key if best is None or key[:2] > best[:2] else best
    return best[2] if best else None
