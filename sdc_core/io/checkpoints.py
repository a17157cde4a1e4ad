"""Checkpoint reading, writing and verification (torch only). Reads Lightning ``.ckpt`` files, ``torch.save`` state
dicts, Accelerate ``save_state`` and Hugging Face Trainer folders (``Checkpoint``) with ``weights_only=True``
(``trust_pickle=True`` opts in, loudly, for a legacy file you wrote), and writes them back atomically, only to a regular
file. ``fingerprint_checkpoint(obj)`` is what ``WeightFingerprintCheck`` stores in the checkpoints it sees written;
``verify(path)`` recomputes it."""

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

from sdc_core.checks.digest import tensor_digest, tensor_digest_v1
from sdc_core.errors import FingerprintMismatchError
from sdc_core.io.safe_files import OutputError, UnreadableError, atomic_write, load_torch, output_mode

FINGERPRINT_KEY = "sdc_fingerprint"
ACCELERATE_STATE = "sdc_state.json"  # the hook set's state in an Accelerate save_state folder
TRAINER_STATE = "trainer_state.json"  # a Hugging Face Trainer checkpoint folder's state
_STATE_FILES = ("model", "pytorch_model", "optimizer")  # the files of a folder that hold the saved state
_FOLDERS = ("accelerate", "trainer")
_MAX_JSON_BYTES = 64 << 20
_DIGESTS = {1: tensor_digest_v1, 2: tensor_digest}  # fingerprint version -> per-tensor digest (newest written)
FINGERPRINT_VERSION = max(_DIGESTS)


def fingerprint_checkpoint(obj: dict[str, Any], version: int = FINGERPRINT_VERSION) -> dict[str, Any]:
    """Per-tensor exact digests of a checkpoint's tensors (of a Lightning one: under ``state_dict`` and
    ``optimizer_states``). ``version`` picks the digest: 2 (``tensor_digest``) is written, 1 only verifies."""
    if version not in _DIGESTS:
        raise ValueError(f"unknown {FINGERPRINT_KEY} version {version!r} (this release reads {sorted(_DIGESTS)})")
    digest = _DIGESTS[version]
    lightning = "state_dict" in obj
    tensors = {
        key: int(digest(t))
        for key, t in _walk(obj, "")
        if not lightning or key.startswith(("state_dict/", "optimizer_states/"))}
    return {"version": version, "tensors": tensors}


class FingerprintUnusable(ValueError):
    """A stored fingerprint that cannot be compared: ``damaged`` (the file changed), or of another version."""

    def __init__(self, message: str, damaged: bool) -> None:
        super().__init__(message)
        self.damaged = damaged


def stored_fingerprint(obj: Any) -> tuple[int, dict[str, int]] | None:
    """``(version, per-tensor digests)`` stored in ``obj``, or None; ``FingerprintUnusable`` for an unusable one."""
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
    """Names of the tensors whose digest differs from the stored fingerprint (None: none stored)."""
    stored = stored_fingerprint(obj)
    if stored is None:
        return None
    version, was = stored
    now = fingerprint_checkpoint(obj, version)["tensors"]
    return sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))


@dataclass
class Checkpoint:
    """A loaded checkpoint: its kind, its objects and where each came from."""

    kind: str  # "lightning", "state_dict", "accelerate" (a save_state folder) or "trainer" (a Trainer checkpoint)
    path: Path
    objects: dict[str, Any] = field(default_factory=dict)  # file name (or "") -> loaded object
    metadata: dict[str, dict[str, str] | None] = field(default_factory=dict)  # safetensors header metadata

    @classmethod
    def load(cls, path: str | Path, trust_pickle: bool = False) -> Checkpoint:
        """Read with ``weights_only=True`` (``trust_pickle``: full unpickling, loudly); else ``UnreadableError``."""
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
        if any(f.name == ".metadata" for f in files) and any(f.suffix == ".distcp" for f in files):
            raise UnreadableError(
                f"{path} is a torch.distributed.checkpoint (DCP) folder: sdc reads Lightning .ckpt files, torch.save "
                "files and Accelerate / Trainer folders, not DCP shards (the hook set compares the replicas before "
                "dcp.save; sharded state carries no fingerprint)")
        for f in files:
            if f.suffix == ".safetensors":
                objects[f.name], metadata[f.name] = _safetensors_load(f)
            elif f.suffix in (".bin", ".pt", ".pth"):
                try:
                    objects[f.name] = load_torch(f, trust_pickle)
                except UnreadableError:  # an auxiliary file (scheduler, RNG states) may need unpickling: left out,
                    if f.name.startswith(_STATE_FILES):  # and a written copy keeps it byte for byte
                        raise
        if not objects:
            raise UnreadableError(f"{path} holds no model or optimizer files of an Accelerate save_state or Trainer "
                                  "checkpoint folder (*.safetensors, *.bin, *.pt, *.pth)")  # fmt: skip
        kind = "trainer" if (path / TRAINER_STATE).is_file() else "accelerate"
        return cls(kind, path, objects, metadata)

    def tensors(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(name, group, tensor)`` for every floating tensor; group is "weights" or "optimizer"."""
        for fname, obj in self.objects.items():
            yield from ((key, _group(self.kind, key), t) for key, t in _walk(obj, fname) if t.is_floating_point())

    def save(self, out: Path) -> None:
        """Write to ``out`` atomically: a file or a folder (new or empty) is built beside ``out`` and
        renamed into place; in the folder read, each file is replaced in turn."""
        if self.kind not in _FOLDERS:
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
    """``(name, tensor)`` for every tensor in nested dicts, lists and tuples, depth first; a container
    met again on its own path (a self-referencing file) is not entered again."""
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


# per checkpoint kind: (name prefixes, group), the first that matches; "" matches everything else
_FOLDER_GROUPS = ((("optimizer",), "optimizer"), (("model", "pytorch_model"), "weights"), (("",), "other"))
_GROUPS: dict[str, tuple[tuple[tuple[str, ...], str], ...]] = {
    "lightning": ((("state_dict/",), "weights"), (("optimizer_states/",), "optimizer"), (("",), "other")),
    "accelerate": _FOLDER_GROUPS,
    "trainer": _FOLDER_GROUPS,
    "state_dict": ((("optimizer", "optim"), "optimizer"), (("",), "weights")),
}


def _group(kind: str, key: str) -> str:
    return next(group for prefixes, group in _GROUPS[kind] if key.startswith(prefixes))


def verify(path: str | Path, trust_pickle: bool = False) -> dict[str, Any]:
    """Recompute a checkpoint's fingerprint, found wherever the routes store it, and compare.

    Returns ``{"status": "clean" | "corrupted" | "no_fingerprint", "changed": [...], "path": ..., "where": ...}`` with
    ``"reason"`` when not clean; ``UnreadableError`` for a file it cannot read. A damaged stored fingerprint counts as
    corrupted; one of another version, or one covering state the file does not hold, as no fingerprint."""
    ckpt = Checkpoint.load(path, trust_pickle)
    out: dict[str, Any] = {"status": "no_fingerprint", "changed": [], "path": str(path)}
    found = _find_fingerprint(ckpt)
    if isinstance(found, str):
        return out | {"reason": f"no SDC fingerprint stored ({found})"}
    holder, where, candidates = found
    out["where"] = where
    try:
        stored = stored_fingerprint(holder)
    except FingerprintUnusable as err:
        return out | {"status": "corrupted" if err.damaged else "no_fingerprint", "reason": str(err)}
    assert stored is not None
    version, was = stored
    if candidates is None:  # at the top level: what fingerprint_checkpoint covers
        now = fingerprint_checkpoint(holder, version)["tensors"]
    else:
        tensors, missing = _matched(was, candidates)
        if missing:
            what = " and ".join(repr(m) for m in missing)
            return out | {"reason": f"its SDC fingerprint ({where}) covers {what}, which the file does not hold: no "
                                    "entry holds exactly its tensor names (save the model and the optimizer state in "
                                    "the same file or folder as the SDC state, under any keys, as the recipes do: "
                                    "{'model': ..., 'optimizer': ..., 'sdc': ...}; a model saved elsewhere, or a state "
                                    "dict renamed, cannot be matched)"}
        now = {name: int(_DIGESTS[version](t)) for name, t in tensors.items()}
    changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    out |= {"status": "corrupted" if changed else "clean", "changed": changed, "tensors": len(was)}
    if changed:
        out["reason"] = f"{len(changed)} tensors changed since it was written"
    return out


def _find_fingerprint(ckpt: Checkpoint) -> tuple[dict[str, Any], str, dict[str, Any] | None] | str:
    """``(holder, where, candidates)``: the dict holding the fingerprint, where it sits, and the
    entries its names are matched against (None: the whole checkpoint); else why there is none."""
    if ckpt.kind in _FOLDERS:
        sdc_state = _read_json(ckpt.path / ACCELERATE_STATE)
        if isinstance(sdc_state, dict) and FINGERPRINT_KEY in sdc_state:
            return sdc_state, f"in {ACCELERATE_STATE}", _merged_shards(ckpt.objects)
        trainer = _read_json(ckpt.path / TRAINER_STATE) if ckpt.kind == "trainer" else None
        for name, state in _callback_states(trainer):
            if isinstance(state, dict) and FINGERPRINT_KEY in state:
                return state, f"in {TRAINER_STATE}, callback {name}", _merged_shards(ckpt.objects)
        if ckpt.kind == "trainer":
            if any(state is not None for _, state in _callback_states(trainer)):
                return (f"a Hugging Face Trainer checkpoint whose {TRAINER_STATE} holds the SDC counters only "
                        "(saved by an sdc-checks release before the Trainer route stored a fingerprint)")  # fmt: skip
            return "a Hugging Face Trainer checkpoint written without SDCTrainerCallback"
        if sdc_state is not None:
            return f"its {ACCELERATE_STATE} holds the SDC counters only: the saved model was not the hook set's"
        return f"an Accelerate save_state folder without {ACCELERATE_STATE}: written without the SDC hook set"
    obj = ckpt.objects.get("")
    if not isinstance(obj, dict):
        return "not a dictionary of state: nothing sdc-checks writes"
    if FINGERPRINT_KEY in obj:
        return obj, "at the top level", None
    for key, value in obj.items():
        for path, holder in _dicts(value, (str(key),)):
            if FINGERPRINT_KEY in holder:
                where = "under " + "/".join(repr(p) for p in path)
                return holder, where, {k: v for k, v in obj.items() if k != key}
    counters = next((str(k) for k, v in obj.items() if isinstance(v, dict) and {"step", "updates", "checks"} <= set(v)),
                    None)  # fmt: skip
    if counters is not None:
        return (f"the SDC state under {counters!r} holds counters only: call hooks.before_save() before "
                "hooks.state_dict() (fabric.save does; a Fabric file of an sdc-checks release before that holds "
                "counters only)")  # fmt: skip
    if ckpt.kind == "lightning":
        return "it was written without WeightFingerprintCheck"
    return ("a state dict written without the SDC hook set: save {'model': ..., 'optimizer': ..., "
            "'sdc': hooks.state_dict()} after hooks.before_save()")  # fmt: skip


_SHARD = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")


def _merged_shards(objects: dict[str, Any]) -> dict[str, Any]:
    """A folder's files with a sharded model's files merged into one entry ``model``."""
    shards = sorted(name for name in objects if _SHARD.fullmatch(name))
    if not shards:
        return objects
    merged = {k: v for name in shards if isinstance(objects[name], dict) for k, v in objects[name].items()}
    return {k: v for k, v in objects.items() if k not in shards} | {"model": merged}


def _dicts(obj: Any, path: tuple[str, ...], depth: int = 3) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    if not isinstance(obj, dict) or depth == 0:
        return
    yield path, obj
    for key, value in obj.items():
        if key != FINGERPRINT_KEY:
            yield from _dicts(value, (*path, str(key)), depth - 1)


def _callback_states(trainer_state: Any) -> Iterator[tuple[str, Any]]:
    callbacks = trainer_state.get("stateful_callbacks") if isinstance(trainer_state, dict) else None
    for name, entry in (callbacks or {}).items() if isinstance(callbacks, dict) else ():
        for item in entry if isinstance(entry, list) else [entry]:
            attributes = item.get("attributes") if isinstance(item, dict) else None
            if isinstance(attributes, dict):
                yield str(name), attributes.get("sdc_state")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > _MAX_JSON_BYTES:
            raise UnreadableError(f"{path} is larger than {_MAX_JSON_BYTES >> 20} MiB: not a state file")
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UnreadableError(f"{path} is not a readable JSON state file: {err}") from None


_WRAPPERS = ("module.", "_orig_mod.")  # prefixes of a DDP-wrapped or compiled model's state dict


def _matched(was: dict[str, int], candidates: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors the fingerprint ``was`` (``<group>/<name>`` -> digest) refers to, and the groups
    found nowhere: each group is the candidate holding exactly its names (tied weights allowed:
    ``_with_tied``), preferring one named like the group; else the one named like it."""
    groups: dict[str, dict[str, int]] = {}
    for name, digest in was.items():
        group, _, rest = name.partition("/")
        groups.setdefault(group, {})[rest] = digest
    walked = {key: dict(_walk(value, "")) for key, value in candidates.items()}
    found: dict[str, torch.Tensor] = {}
    missing = []
    for group, rels in groups.items():
        named_like = [k for k in walked if k == group or k.split(".")[0] == group]
        order = [*named_like, *(k for k in walked if k not in named_like)]
        renamed = ({n[len(p):]: t for n, t in walked[k].items()} for k in order for p in ("", *_WRAPPERS)
                   if not p or all(n.startswith(p) for n in walked[k]))  # fmt: skip
        choice = next((held for held in (_with_tied(r, rels) for r in renamed) if held is not None), None)
        if choice is None and named_like:
            choice = walked[named_like[0]]
        if choice is None:
            missing.append(group)
            continue
        found.update({f"{group}/{n}": t for n, t in choice.items()})
    return found, missing


def _with_tied(held: dict[str, torch.Tensor], rels: dict[str, int]) -> dict[str, torch.Tensor] | None:
    """``held`` when it holds exactly the names of ``rels`` (name -> digest), a name it lacks mapped
    to the held tensor of the same digest (a tied weight written once); else None."""
    if not set(held) <= set(rels):
        return None
    lacking = set(rels) - set(held)
    by_digest = {rels[n]: n for n in held}
    if not all(rels[n] in by_digest for n in lacking):
        return None
    return held | {n: held[by_digest[rels[n]]] for n in lacking}


def check_loaded_checkpoint(obj: dict[str, Any], step: int) -> None:
    """Raise ``FingerprintMismatchError`` (on every rank: each loads the same file) when the tensors
    no longer match the stored fingerprint or it is damaged; warn when it is of another version."""
    try:
        changed = changed_tensors(obj)
    except FingerprintUnusable as err:
        if not err.damaged:
            warnings.warn(f"the checkpoint being loaded cannot be verified: {err}", UserWarning, stacklevel=2)
            return
        reason = f"the checkpoint changed on disk after it was written: {err}"
        details: dict[str, Any] = {"checkpoint_fingerprint": str(err)}
    else:
        if not changed:
            return
        reason = f"the checkpoint changed on disk after it was written ({len(changed)} tensors, e.g. {changed[0]})"
        details = {"checkpoint_changed_tensors": changed[:20], "changed_count": len(changed)}
    raise FingerprintMismatchError(step=step, rank=None, suspects=(), details=details, reason=reason)


def newest_verified(folders: list[str | Path], max_step: int, trust_pickle: bool = False,
                    skipped: list[str] | None = None) -> Path | None:  # fmt: skip
    """The newest ``*.ckpt`` under ``folders`` of a step at most ``max_step`` whose tensors match its
    stored fingerprint, or None; weights-only ones are passed over (nothing to resume). Each file
    passed over is appended to ``skipped`` with the reason."""
    best: tuple[int, float, Path] | None = None
    skipped = [] if skipped is None else skipped
    for folder in map(Path, folders):
        for path in sorted(folder.glob("*.ckpt")) if folder.is_dir() else []:
            try:  # a hostile or odd file is passed over, never raised: the caller's ranks wait for the answer
                obj = load_torch(path, trust_pickle)
                step = int(obj.get("global_step", -1)) if isinstance(obj, dict) else -1
                changed = changed_tensors(obj) if 0 <= step <= max_step else None
                mtime = path.stat().st_mtime
            except Exception as err:  # unreadable, odd step, unusable fingerprint
                skipped.append(f"{path}: {err}")
                continue
            if 0 <= step <= max_step and "optimizer_states" not in obj:  # Lightning save_weights_only
                skipped.append(f"{path}: weights only (no optimizer state to roll back to)")
                continue
            if step < 0 or step > max_step or changed != []:
                if step <= max_step:
                    why = "no fingerprint" if changed is None else f"changed tensors {changed[:3]}"
                    skipped.append(f"{path}: {why}" if step >= 0 else f"{path}: no global_step")
                continue
            key = (step, mtime, path)
            best = key if best is None or key[:2] > best[:2] else best
    return best[2] if best else None
