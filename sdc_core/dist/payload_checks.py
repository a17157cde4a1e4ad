"""The shapes a peer's payload must have: ``validate`` functions for ``topology.exchange``, which turns their
``ValueError`` into ``PayloadError`` on every rank. Cost: a walk over the containers, no data read."""

from __future__ import annotations

from typing import Any

import torch

from sdc_core.dist.topology import TRANSFER_ERROR


def check_replay_payload(payload: Any) -> None:
    """``validate`` for the ring replay's exchanges (``replay.ring``): ``ValueError`` for another shape."""
    if not isinstance(payload, dict):
        raise ValueError(f"a replay payload is a {type(payload).__name__}, not a dict")
    if TRANSFER_ERROR in payload:
        if set(payload) != {TRANSFER_ERROR} or not isinstance(payload[TRANSFER_ERROR], str):
            raise ValueError("a replay transfer error is not one text")
        return
    keys = set(payload)
    if not keys or not keys <= {"micro", "digest", "replay"} or ("micro" in keys) != ("digest" in keys):
        raise ValueError(f"a replay payload has the keys {sorted(map(str, payload))}")
    micro = payload.get("micro", [])
    if not isinstance(micro, list) or not all(_named(m, "MicroBatch") for m in micro):
        raise ValueError("a replay payload's micro-batches are not a list of MicroBatch")
    for key in ("digest", "replay"):
        if key in payload:
            _check_digest(payload[key], key)


def _named(obj: Any, name: str) -> bool:
    return type(obj).__name__ == name and type(obj).__module__.startswith("sdc_core.")


def _check_digest(d: Any, key: str) -> None:
    if not _named(d, "Digest"):
        raise ValueError(f"a replay payload's {key} is a {type(d).__name__}, not a Digest")
    parts = {"sums": torch.float64, "norms": torch.float64, "fps": torch.int64, "numels": torch.float64}
    lengths = set()
    for field, dtype in parts.items():
        t = getattr(d, field)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
            raise ValueError(f"a replay payload's {key}.{field} is not a 1-D {dtype} tensor")
        lengths.add(t.numel())
    if len(lengths) != 1 or not isinstance(d.loss, float):
        raise ValueError(f"a replay payload's {key} has tensors of lengths {sorted(lengths)} or a loss not a float")


def check_update_payload(payload: Any) -> None:
    """``validate`` for the update audit's exchanges (``sharded.update_audit``): ``ValueError`` for another shape."""
    if not isinstance(payload, dict):
        raise ValueError(f"an update payload is a {type(payload).__name__}, not a dict")
    if TRANSFER_ERROR in payload or "skipped" in payload:
        if len(payload) != 1:
            raise ValueError("an update payload mixes a skip or an error with data")
        return
    groups, after = payload.get("groups"), payload.get("after")
    if set(payload) != {"groups", "after"} or not isinstance(groups, list) or not isinstance(after, list):
        raise ValueError(f"an update payload has the keys {sorted(map(str, payload))}")
    count = 0
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get("hyper"), dict) or not isinstance(g.get("items"), list):
            raise ValueError("an update payload's group is not {'hyper': dict, 'items': list}")
        for item in g["items"]:
            p = item.get("param") if isinstance(item, dict) else None
            if not isinstance(p, torch.Tensor) or not isinstance(item.get("name"), str):
                raise ValueError("an update payload's item lacks a name or a parameter tensor")
            grad, state = item.get("grad"), item.get("state")
            if grad is not None and (not isinstance(grad, torch.Tensor) or grad.shape != p.shape):
                raise ValueError(f"an update payload's gradient of {item['name']} does not match its parameter")
            if not isinstance(state, dict):
                raise ValueError(f"an update payload's state of {item['name']} is not a dict")
            count += 1
    if len(after) != count or not all(isinstance(a, int) and not isinstance(a, bool) for a in after):
        raise ValueError(f"an update payload lists {len(after)} digests for {count} tensors")


__all__ = ["check_replay_payload", "check_update_payload"]
