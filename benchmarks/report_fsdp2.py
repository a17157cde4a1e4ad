# ruff: noqa: E501  (the page text is a Markdown template; its table rows are long)
"""The FSDP2 section of benchmarks/results/performance-history.md, rendered from ``benchmarks/results/performance-fsdp2.json``
(``torchrun --nproc-per-node 4 -m benchmarks.fsdp2_lightning --out benchmarks/results/performance-fsdp2.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "benchmarks" / "results" / "performance-fsdp2.json"

TEXT = """## 5. FSDP2

### Measured: Lightning `ModelParallelStrategy`, pure FSDP on 4 CPU ranks ({params:,} parameters)

`torchrun --nproc-per-node 4 -m benchmarks.fsdp2_lightning --out benchmarks/results/performance-fsdp2.json`:
each `Linear` and the root `fully_shard`-ed over gloo, AdamW, batch 128 per rank, {steps} steps per
configuration (first 5 dropped), configurations alternating in one process group, {rounds} rounds. Four
ranks share two cores here: every collective also waits for a descheduled peer, so read a
difference smaller than the per-round range as noise.

{table}

An audited replay step took {replay_ratio:.2f}x a normal step (the normal step plus one forward and backward of
the partner's micro-batch with the all-gathers of training and no reduce-scatter); an update-audit
step {update_ratio:.2f}x (a shard snapshot, its transfer and one optimizer step on the shard). The
clean-step work is one `aminmax` per parameter group in the reduce-scatter (the flag rides in
its input: no collective of its own), one or two reads of the local shards for the fingerprint
and 16 bytes of traffic.

Traffic counted by instrumenting the checks' calls (FSDP's own all-gathers and reduce-scatters
excluded): a clean step {clean_calls} collectives / {clean_bytes} bytes per rank with the non-finite check and the
fingerprint; an audited replay step {replay_calls} calls / {replay_bytes:,} bytes; an update-audit step {update_calls} calls /
{update_bytes:,} bytes (= {update_factor:.2f} x the rank's {shard_mb:.2f} MB fp32 shard: parameters, gradients, Adam's two moments).

### Formulas, per rank

W ranks, a shard group of F ranks and replica groups of R ranks (HSDP: W = R x F; pure FSDP: R = 1),
P the parameter bytes, S = P / F the bytes of a rank's shards, U = P the bytes of a rank's local
unsharded gradients over a step (reduce dtype), G the FSDP parameter groups, T the tensors, k the
optimizer state tensors per parameter (AdamW: 2), B the bytes of a micro-batch.

| check | clean step: reads | clean step: traffic | extra memory |
|---|---|---|---|
| `NonFiniteGradientCheck` | U (one `aminmax` per group, in the reduce-scatter) | none of its own: the flag rides in the reduce-scatter input (F elements per group changed by x - 0.0) and each rank reads element 0 of its reduced shards, one step later (before the update with skip_step, rollback or a GradScaler); one 4-byte all-reduce over W only where FSDP meshes do not span the world (TP, PP) | 16 B x G + one element per group per micro-batch |
| `WeightFingerprintCheck`, replicated shards (HSDP, TP) | S | 16 B all-reduced in the replica group (R ranks) + 16 B over W | copy of the tensors under 4,096 elements |
| `WeightFingerprintCheck`, unreplicated shards (pure FSDP) | 2 S (after the update, before the next forward) | the same 16 B over W (no replica group) | the same |
| `RingReplayAudit`, audited step | one forward and backward per micro-batch (twice at the first audit: the same-device re-run) | B and the captured state point to point, the all-gathers of a forward and backward ((F - 1)/F x P each), no reduce-scatter, 56 B x W all-gathered (a readiness flag and the verdict row) | the partner's micro-batches and state (buffers, attributes, frozen shards: at most `max_state_mb`); the replay's transient activations and unsharded gradients (as a training micro-batch) |
| update audit, audited step | (2 + k) S copied, one optimizer step on S | (2 + k) S sent and received point to point, 16 B x W all-gathered | 3 (2 + k) S at peak (own snapshot, partner's, recomputation) |

On a mismatch only: per-tensor digests (8 B x T) and names gathered over W; a referee round
resends one snapshot. Averaged over cadences n (replay) and m (update audit) the per-step traffic
is 16 B + (B + 56 W) / n + ((2 + k) S + 16 W) / m: at W = 1,024, n = m = 100, a 1 GB shard and
Adam, the update audit dominates with 40 MB per step, which is why it is off by default and meant
for cadences of hundreds to thousands of steps.
"""


def render(data: dict[str, Any]) -> str:
    from benchmarks.report import ddp_table  # the DDP sections' table (report imports this module)

    shard = data["params"] * 4 / data["world_size"]
    replay, update = data["audit_often_traffic"], data["update_often_traffic"]
    rounds = len(next(iter(data.get("overhead_by_round", {}).values()), [None]))
    return TEXT.format(
        table=ddp_table(data), params=data["params"], steps=data.get("steps", 30), rounds=rounds,
        replay_ratio=data["audit_often_step_vs_normal"],
        update_ratio=data["update_often_step_vs_normal"], clean_calls=replay["clean"][0],
        clean_bytes=replay["clean"][1], replay_calls=replay["audited"][0], replay_bytes=replay["audited"][1],
        update_calls=update["audited"][0], update_bytes=update["audited"][1],
        update_factor=update["audited"][1] / shard, shard_mb=shard / 1e6,
    )  # fmt: skip


def section(path: Path = SOURCE) -> str:
    """The rendered section, or nothing when the FSDP2 benchmark has not been run."""
    return render(json.loads(path.read_text())) if path.exists() else ""
