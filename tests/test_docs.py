"""The documents a user reads first: every relative link and anchor in README.md and docs/*.md
resolves, CHANGELOG.md keeps the Keep a Changelog form (one section per release, each heading
once, one line per change), and every python block of README.md and docs/*.md runs as written here
or points to the example or test that runs it."""

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


# The python blocks of README.md and docs/*.md. Each is either run as written (SNIPPETS: the
# block's text, with a line that is only `...` (the reader's loop) replaced by a short loop,
# between a set-up that defines what the block takes as given (model, optimizer, loader, ...) and
# a check of what it promises), or points to what runs it instead: the paragraph right above or
# right below the block says "Runnable: `<command>`" or "Tested by `tests/<file>.py`", the file
# exists, and a tests/test_examples*.py runs a named example. A page that drifts from the API (a
# renamed import, keyword or method) fails here.
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```python\n(.*?)```", flags=re.S)
POINTER = re.compile(r"(?:runnable|tested by):?\s*`([^`]+)`", flags=re.I)
_NET = """
from types import SimpleNamespace

import torch
from torch.nn import functional as F


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x, y):
        return F.mse_loss(self.lin(x), y)


class OutputNet(Net):  # returns an output with .loss, as a Hugging Face model does
    def forward(self, x, y):
        return SimpleNamespace(loss=super().forward(x, y))


torch.manual_seed(0)
batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
"""
_DDP = """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
"""
_ACCELERATE = """
from accelerate import Accelerator

loader = torch.utils.data.DataLoader([{"x": x, "y": y} for x, y in zip(torch.randn(12, 4), torch.randn(12, 2))],
                                     batch_size=4)
"""
TORCHRUN = ("plain", "plain in full")  # run one after the other in one torchrun of 2 gloo ranks
SNIPPETS: dict[str, tuple[str, str, str, str | None, str]] = {  # name: (page, marker, set-up, loop, after)
    "plain": ("README.md", "hooks.before_save()", _NET + _DDP + """
net = Net()
model = DistributedDataParallel(net)
optimizer = torch.optim.AdamW(model.parameters())
path = f"last.rank{dist.get_rank()}.pt"
""", """
for x, y in batches:
    model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
""", ""),
    "accelerate": ("README.md", "Accelerator(", _NET + """
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
    "fabric": ("README.md", "SDCHooks(fabric", _NET + """
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
    "plain in full": ("docs/integrations.md", "hooks.before_save()", _NET + _DDP + """
from torch.utils.tensorboard import SummaryWriter

net = OutputNet()
optimizer = torch.optim.AdamW(net.parameters())
loader = [{"x": x, "y": y} for x, y in batches]
writer = SummaryWriter(f"tb.rank{dist.get_rank()}")
path = f"full.rank{dist.get_rank()}.pt"
""", None, "writer.close()\n"),
    "accelerate in full": ("docs/integrations.md", "Accelerator(", _NET + _ACCELERATE + """
model = OutputNet()
optimizer = torch.optim.AdamW(model.parameters())
""", None, ""),
    "replayable loss": ("docs/replay-contract.md", "sdc.replayable(", _NET + """
from accelerate import Accelerator
from accelerate_sdc import SDCHooks

accelerator = Accelerator()
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.AdamW(model.parameters())
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,))),
                                     batch_size=4)
sdc = SDCHooks(accelerator)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
sdc.attach(model, optimizer)
z = 0.5  # a constant, as the page asks
""", None, """
sdc.finish()
assert sdc.state_dict()["step"] == 3, sdc.state_dict()
accelerator.end_training()
"""),
    "replay state hook": ("docs/replay-contract.md", "def sdc_replay_state(", """
from types import SimpleNamespace

import lightning.pytorch as L
import torch
""", None, """
from sdc_core.replay.state import StateCapture  # what RingReplayAudit builds from the two methods

model = Model()
model.memory, model.sampler_state = SimpleNamespace(tensor=torch.zeros(3)), SimpleNamespace(position=0)
capture = StateCapture(model, trainable=(), get_state=model.sdc_replay_state, load_state=model.sdc_load_replay_state)
owner = capture.capture()
model.memory.tensor, model.sampler_state.position = torch.ones(3), 7  # the replayer's own state
with capture.applied(owner):  # the replay sees the owner's state ...
    assert model.memory.tensor.eq(0).all() and model.sampler_state.position == 0
assert model.memory.tensor.eq(1).all() and model.sampler_state.position == 7  # ... then its own again
"""),
    "incident fields": ("docs/incidents-and-exit-codes.md", "err.to_dict()", """
from sdc_core import SDCError
from sdc_core.errors import ReplayMismatchError

err = ReplayMismatchError(step=4200, rank=5, suspects=[5], hosts={5: "node-b"}, details={"source": "gradient_screen"})
""", None, """
assert SDCError.from_dict(err.to_dict()).to_dict() == err.to_dict()
"""),
}


def _blocks(page: str) -> list[tuple[str, str, str]]:
    """(the paragraph above, the block, the paragraph below) for every python block of a page."""
    text = (ROOT / page).read_text()
    return [(text[:m.start()].rstrip().split("\n\n")[-1], m.group(1), text[m.end():].lstrip().split("\n\n")[0])
            for m in FENCE.finditer(text)]  # fmt: skip


def _script(name: str) -> str:
    page, marker, setup, loop, after = SNIPPETS[name]
    (block,) = [b for _, b, _ in _blocks(page) if marker in b]
    if loop is None:  # the block has its loop written out
        return setup + block + after
    lines = [loop if line.split("#")[0].strip() == "..." else line + "\n" for line in block.splitlines()]
    assert loop in lines, f"{page}: the {name} block has no `...` line for the loop"
    return setup + "".join(lines) + after


def test_every_python_block_is_run_or_points_to_what_runs_it() -> None:
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_examples*.py"))
    unaccounted, bad = [], []
    for page in PAGES:
        markers = [marker for p, marker, *_ in SNIPPETS.values() if p == page]
        for above, block, below in _blocks(page):
            run = sum(m in block for m in markers)
            pointers = POINTER.findall(" ".join(above.split())) + POINTER.findall(" ".join(below.split()))
            if run > 1 or not (run or pointers):
                unaccounted.append(f"{page}: {block.splitlines()[0]}")
            for command in pointers:
                files = re.findall(r"(?:examples|tests)/[\w/]+\.py", command)
                if not files:
                    bad.append(f"{page}: `{command}` names no example or test")
                for file in files:
                    if not (ROOT / file).is_file():
                        bad.append(f"{page}: {file} does not exist")
                    elif file.startswith("examples/") and Path(file).name not in tests:
                        bad.append(f"{page}: no tests/test_examples*.py runs {file}")
    assert not unaccounted, f"blocks neither run here (SNIPPETS) nor pointing to what runs them: {unaccounted}"
    assert not bad, bad
    for name in SNIPPETS:
        _script(name)  # each marker names exactly one block of its page


def test_the_documented_verdict_checks_are_the_checks() -> None:
    from sdc_core.errors import SDCError

    (listing,) = [b for _, b, _ in _blocks("docs/incidents-and-exit-codes.md") if "err.check" in b]
    documented = set(re.findall(r'"(\w+)"', listing.splitlines()[0]))

    def subclasses(cls: type) -> list[type]:
        return [c for s in cls.__subclasses__() for c in (s, *subclasses(s))]

    assert documented == {c.check for c in subclasses(SDCError)}, documented


def _tags(folder: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in folder.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= {f"{events.parent.relative_to(folder)}/{tag}" for tag in acc.Tags()["scalars"]}
    return tags


def test_snippets_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain blocks under torchrun (2 gloo ranks) while the others run here, one process each
    needs no launcher; then what each promises: checkpoints `sdc` verifies, `sdc/*` scalars in
    TensorBoard (the init_trackers line; the plain loop's `log=` writer), the hook set's state in
    the Fabric file; the replay's state hook and `replayable` loss, the incident's fields."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no accelerate config of this machine's user
    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", os.devnull)
    (tmp_path / "torchrun").mkdir()
    script = 'import torch.distributed as dist\ndist.init_process_group("gloo")\n'
    script += "".join(_script(name) for name in TORCHRUN) + "dist.destroy_process_group()\n"
    (tmp_path / "torchrun" / "snippets.py").write_text(script)
    plain = subprocess.Popen(torchrun_cmd("snippets.py", None, None, 2), cwd=tmp_path / "torchrun", env=worker_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        from accelerate.state import AcceleratorState

        for name in SNIPPETS:
            if name in TORCHRUN:
                continue
            folder = tmp_path / name.replace(" ", "_")
            folder.mkdir()
            (folder / "snippet.py").write_text(_script(name))
            monkeypatch.chdir(folder)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # one process: the replica checks say they are inactive
                    runpy.run_path("snippet.py", run_name="__main__")
            finally:
                AcceleratorState._reset_state(reset_partial_state=True)  # the next one makes its own Accelerator
    finally:
        out, _ = plain.communicate(timeout=240)
    assert plain.returncode == 0, out[-6000:]
    for rank in (0, 1):  # the plain recipes' files: verified clean against the fingerprint under "sdc"
        for file in (f"last.rank{rank}.pt", f"full.rank{rank}.pt"):
            assert sdc_main(["verify-checkpoint", str(tmp_path / "torchrun" / file)]) == 0, file
    assert any(tag.startswith("sdc_") for tag in _tags(tmp_path / "torchrun" / "tb.rank0")), "the log= writer"
    for name in ("accelerate", "accelerate_in_full"):
        assert any("sdc/" in tag for tag in _tags(tmp_path / name / "runs" / "train")), name
    state = torch.load(tmp_path / "fabric" / "last.ckpt", weights_only=True)
    assert state["sdc"]["step"] == 3 and set(state) == {"model", "optimizer", "sdc"}
