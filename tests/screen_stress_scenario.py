"""A clean Accelerate run the every-step screen once misjudged: 3 CPU ranks under ``accelerate launch``, an MLP with
the loss computed in the loop, SGD (lr 0.5, momentum 0.9), one batch in about twelve made hard (inputs x5-x50, random
labels). Its weights grow to about 1e9 in all while the loss stays near 2.3; at step 29 an ordinary batch of rank 0
gives a loss 2^28 above the other ranks', and its own update fits it back into the band. Rank 0 prints one JSON line:
the error (None) and the screen's and replay's counters.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 3 tests/screen_stress_scenario.py [STEPS]
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from accelerate_sdc import SDCHooks
from sdc_core.errors import SDCError


def samples(batches: int, seed: int = 14) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` batches of 16 samples, laid end to end (Accelerate deals batch i to rank i % 3)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        x = torch.randn(16, 32, generator=g)
        y = x[:, :10].argmax(1)
        if torch.rand(1, generator=g).item() < 0.08:
            x = x * (5 + 45 * torch.rand(1, generator=g).item())
            y = torch.randint(0, 10, (16,), generator=g)
        out += [(x[i], y[i]) for i in range(16)]
    return out


def main(steps: int) -> None:
    acc = Accelerator()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    loader = DataLoader(samples(3 * steps + 9), batch_size=16)
    sdc = SDCHooks(acc)
    net, opt, loader = acc.prepare(net, opt, loader)
    sdc.attach(net, opt)
    error, step = None, 0
    try:
        for x, y in loader:
            acc.backward(nn.functional.cross_entropy(net(x), y))
            opt.step()
            opt.zero_grad()
            step += 1
            if step == steps:
                break
        sdc.finish()
    except SDCError as err:
        error = str(err)
    checks = sdc.state_dict()["checks"]
    if acc.is_main_process:
        print(json.dumps({"steps": step, "error": error, "screen": checks["gradient_screen"]["extra"],
                          "replay": checks["ring_replay"]["extra"]}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 31)
