"""The documents a user reads first: every relative link and anchor in README.md and docs/*.md
resolves, CHANGELOG.md keeps the Keep a Changelog form (one section per release, each heading
once, one line per change), and the README's python blocks run as written."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ROOT, torchrun_cmd, worker_env

from sdc_core.cli import main as sdc_main

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_and_anchor_resolves() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code blocks are code
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_changelog_is_in_keep_a_changelog_form() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^\]]+)\]", text, flags=re.M)
    assert releases[0] == "Unreleased" and "0.1.0" in releases and len(releases) == len(set(releases))
    for body in re.split(r"^## ", text, flags=re.M)[1:]:
        headings = re.findall(r"^### (.+)$", body, flags=re.M)
        assert len(headings) == len(set(headings)), headings  # each heading once per release
        assert set(headings) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, headings
    lines = text.splitlines()
    continued = [line for line in lines if line.startswith("  ") and line.strip()]
    assert not continued, continued[:3]  # one line per change


def test_every_route_in_the_readme_points_to_an_example_a_test_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    examples = sorted(set(re.findall(r"examples/(\w+\.py)", readme)))
    assert len(examples) >= 6, examples  # Lightning, plain, Accelerate, Trainer, Fabric, zero-code
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in examples:
        assert (ROOT / "examples" / name).is_file(), name
        assert f'"{name}"' in tests or f"'{name}'" in tests or f"/{name}" in tests, f"no test runs examples/{name}"
    assert "bash scripts/test.sh" in readme  # CI's .ci/run calls it


# The README's python blocks, run as written: each is the block's text, with a line that is only
# `...` (the reader's loop) replaced by a short loop, between a set-up that defines what the block
# takes as given (model, optimizer, loader, ...) and a check of what it promises. A README that
# drifts from the API (a renamed import, keyword or method) fails here.
_NET = """
import torch
from torch.nn import functional as F


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x, y):
        return F.mse_loss(self.lin(x), y)


torch.manual_seed(0)
batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
"""
SNIPPETS: dict[str, tuple[str, str, str, str]] = {  # route: (marker in the block, set-up, loop, after)
    "plain": ("hooks.before_save()", _NET + """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
net = Net()
model = DistributedDataParallel(net)
optimizer = torch.optim.AdamW(model.parameters())
path = f"last.rank{dist.get_rank()}.pt"
""", """
for x, y in batches:
    model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
""", "dist.destroy_process_group()\n"),
    "accelerate": ("Accelerator(", _NET + """
from accelerate import Accelerator

model = Net()
optimizer = torch.optim.AdamW(model.parameters())
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randn(12, 2)),
                                     batch_size=4)
""", """
for x, y in loader:
    accelerator.backward(model(x, y))
    optimizer.step()
    optimizer.zero_grad()
""", "accelerator.end_training()\n"),
    "fabric": ("SDCHooks(fabric", _NET + """
from lightning.fabric import Fabric

fabric = Fabric(accelerator="cpu", devices=1)
model = Net()
model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
""", """
for x, y in batches:
    fabric.backward(model(x, y))
    optimizer.step()
    optimizer.zero_grad()
""", ""),
}
NOT_RUN_HERE = {  # marker: what runs that route instead (8 devices, or the transformers import)
    "L.Trainer(": "examples/lightning_ddp_demo.py (test_examples.py), tests/test_lightning_ddp.py",
    "SDCTrainerCallback()": "examples/hf_trainer_demo.py (test_examples.py), tests/test_hf_trainer.py",
}


def _readme_script(route: str) -> str:
    marker, setup, loop, after = SNIPPETS[route]
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
                if marker in b]  # fmt: skip
    lines = [loop if line.split("#")[0].strip() == "..." else line + "\n" for line in block.splitlines()]
    assert loop in lines, f"the README's {route} block has no `...` line for the loop"
    return setup + "".join(lines) + after


def test_every_python_block_of_the_readme_is_run_or_named() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    markers = [m for m, *_ in SNIPPETS.values()] + list(NOT_RUN_HERE)
    assert [sum(m in b for m in markers) for b in blocks] == [1] * len(blocks), "a README block none of these names"


def test_readme_snippets_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain block under torchrun (2 gloo ranks) while the Accelerate and Fabric blocks run
    here, one process each needs no launcher; then what each promises: a checkpoint `sdc`
    verifies, `sdc/*` tags in TensorBoard (the init_trackers line), the hook set's state in the
    Fabric file."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no accelerate config of this machine's user
    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", os.devnull)
    for route in SNIPPETS:
        (tmp_path / route).mkdir()
        (tmp_path / route / "snippet.py").write_text(_readme_script(route))
    plain = subprocess.Popen(torchrun_cmd("snippet.py", None, None, 2), cwd=tmp_path / "plain", env=worker_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        for route in ("accelerate", "fabric"):
            monkeypatch.chdir(tmp_path / route)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # one process: the replica checks say they are inactive
                runpy.run_path("snippet.py", run_name="__main__")
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)  # later tests make their own Accelerator
        out, _ = plain.communicate(timeout=240)
    assert plain.returncode == 0, out[-6000:]
    for rank in (0, 1):  # the plain recipe's file: verified clean against the fingerprint under "sdc"
        assert sdc_main(["verify-checkpoint", str(tmp_path / "plain" / f"last.rank{rank}.pt")]) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / "accelerate" / "runs" / "train").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert any(tag.startswith("sdc/") for tag in acc.Tags()["scalars"]), acc.Tags()
    state = torch.load(tmp_path / "fabric" / "last.ckpt", weights_only=True)
    assert state["sdc"]["step"] == 3 and set(state) == {"model", "optimizer", "sdc"}
