"""A small transformer's training step in one process: no checks, each check's work, all three,
and ``torch.autograd.detect_anomaly`` (Lightning's ``Trainer(detect_anomaly=True)``).

One process has no replicas, so the checks' work is timed through the core functions they run:
``nonfinite`` is the verdict on ``.grad`` (per-tensor ``aminmax`` plus one host read: more kernels
than the per-bucket DDP path); ``fingerprint`` digests and combines every parameter and reads the
result (the DDP path adds a 16-byte all-reduce and reads one batch later); ``replay`` is one
extra forward and backward on detached aliases with digests, timed alone and amortised over its
cadence. Configurations run in alternating rounds.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from benchmarks.common import summary, sync
from sdc_core.checks.digest import combine, grouped_digests
from sdc_core.checks.gradients import NonFiniteGradient
from sdc_core.replay.compare import grad_digest
from sdc_core.replay.rerun import replay_gradients
from sdc_core.replay.ring import ReplayConfig
from sdc_core.replay.rng import capture_rng
from sdc_core.replay.state import MicroBatch


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 2000, d: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.encoder(self.embed(tokens[:, :-1])))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def run(device: torch.device, steps: int, replay_every: int = ReplayConfig().every_n_steps,
        batch: int = 16, seq: int = 64) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, 2000, (batch, seq + 1), device=device)
    names = [n for n, _ in model.named_parameters()]
    nonfinite = NonFiniteGradient()
    counter = {"step": 0}

    work: dict[str, list[float]] = {"nonfinite_work": [], "fingerprint_work": []}

    def timed(name: str, fn: Any) -> None:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        work[name].append(time.perf_counter() - t0)

    def step(check: str) -> None:
        opt.zero_grad(set_to_none=True)
        ctx = torch.autograd.detect_anomaly() if check == "detect_anomaly" else contextlib.nullcontext()
        with ctx:
            loss = model(data)
            loss.backward()
        if check in ("nonfinite", "all_three"):
            timed("nonfinite_work", lambda: nonfinite.verdict(counter["step"], model.named_parameters()))
        opt.step()
        if check in ("fingerprint", "all_three"):
            timed("fingerprint_work", lambda: combine(grouped_digests(list(model.parameters()))).item())
        counter["step"] += 1

    def replay_once() -> None:
        cpu, cuda = capture_rng(device)
        loss, grads = replay_gradients(model, names, [MicroBatch(data, 0, cpu, cuda)], lambda b, i: model(b))
        grad_digest(names, grads, loss)

    configs = ["none", "nonfinite", "fingerprint", "all_three", "detect_anomaly"]
    for c in configs:  # warm-up
        step(c)
    times: dict[str, list[float]] = {c: [] for c in [*configs, "replay_audit"]}
    for samples in work.values():
        samples.clear()
    rounds = max(1, steps // 5)
    for _ in range(rounds):
        for c in configs:
            for _ in range(5):
                sync(device)
                t0 = time.perf_counter()
                step(c)
                sync(device)
                times[c].append(time.perf_counter() - t0)
        sync(device)
        t0 = time.perf_counter()
        replay_once()
        sync(device)
        times["replay_audit"].append(time.perf_counter() - t0)
    base = summary(times["none"])["median"]
    times.update(work)
    rows = {c: summary(t) for c, t in times.items()}
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "tensors": len(names),
        "batch": [batch, seq],
        "replay_every_n_steps": replay_every,
        "seconds": rows,
        "overhead": {c: rows[c]["median"] / base - 1 for c in configs if c != "none"},
    }
    replay_amortised = rows["replay_audit"]["median"] / replay_every / base
    out["overhead"]["replay_amortised"] = replay_amortised
    # the checks' own work, timed around the calls: steadier than differences of noisy step times
    out["work_vs_step"] = {
        "nonfinite": rows["nonfinite_work"]["median"] / base,
        "fingerprint": rows["fingerprint_work"]["median"] / base,
        "replay_amortised": replay_amortised,
    }
    out["work_vs_step"]["all_three"] = sum(out["work_vs_step"].values())
    out["replay_audit_vs_step"] = rows["replay_audit"]["median"] / base
    return out
