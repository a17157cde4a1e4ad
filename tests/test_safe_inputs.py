"""Safe with any file and any input: no code runs from a file, no traceback, no input changed,
outputs and incidents written atomically, one rule for settings (issue 12)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import yaml
from conftest import worker_env
from ddp_scenarios import Net, loader
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sdc import FingerprintMismatchError, WeightFingerprintCheck
from sdc_core import cli
from sdc_core.cli import EXIT_CHANGED, EXIT_NO_FINGERPRINT, EXIT_OK, EXIT_UNREADABLE, EXIT_USAGE
from sdc_core.cli import main as sdc
from sdc_core.io.checkpoints import FINGERPRINT_KEY
from sdc_core.io.safe_files import atomic_write_text


class Payload:
    """Unpickling it creates the file ``marker``: the stand-in for code hidden in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def malicious(path: Path, marker: Path, step: int = 1) -> Path:
    """A plausible Lightning checkpoint (weights, step, a fingerprint) that runs code when unpickled."""
    obj = {"state_dict": {"body.weight": torch.ones(4)}, "global_step": step, "hyper_parameters": Payload(marker)}
    obj[FINGERPRINT_KEY] = {"version": 1, "tensors": {}}
    torch.save(obj, path)
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("safe")
    t = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[WeightFingerprintCheck()], logger=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)  # fmt: skip
    t.fit(Net(optimizer="adam"), loader())
    t.save_checkpoint(root / "run.ckpt")
    return root / "run.ckpt"


# ------------------------------------------------------------------------------ no code from files


def test_no_command_runs_code_from_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "PAYLOAD_RAN"
    evil = malicious(tmp_path / "evil.ckpt", marker)
    folder = tmp_path / "accelerate_state"
    folder.mkdir()
    torch.save({"w": torch.ones(2), "x": Payload(marker)}, folder / "pytorch_model.bin")
    for target in (evil, folder):
        before = digest(evil)
        assert sdc(["verify-checkpoint", str(target)]) == EXIT_UNREADABLE
        assert sdc(["verify-checkpoint", str(target), "--json"]) == EXIT_UNREADABLE
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["status"] == "unreadable"
        assert sdc(["corrupt-checkpoint", str(target), "-o", str(tmp_path / "out")]) == EXIT_UNREADABLE
        err = capsys.readouterr().err
        assert "--trust-pickle" in err and str(target) in err and len(err.strip().splitlines()) == 1
        assert not marker.exists() and not (tmp_path / "out").exists() and digest(evil) == before
    # the explicit opt-in loads it (and says so, loudly)
    assert sdc(["verify-checkpoint", str(evil), "--trust-pickle"]) == EXIT_CHANGED  # its fingerprint lists no tensor
    assert marker.exists() and "full unpickling" in capsys.readouterr().err


def test_rollback_passes_over_a_malicious_checkpoint(ckpt: Path, tmp_path: Path, monkeypatch: Any) -> None:
    from lightning_sdc._common import rollback

    marker = tmp_path / "PAYLOAD_RAN"
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (folder / "good.ckpt").write_bytes(ckpt.read_bytes())  # step 3, fingerprinted
    malicious(folder / "newer.ckpt", marker, step=4)  # the newest candidate: rollback would take it
    module = Net(optimizer="adam")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=folder)])  # fmt: skip
    trainer.fit(module, loader())
    error = FingerprintMismatchError(step=5, rank=None, suspects=())
    monkeypatch.delenv("SDC_TRUST_PICKLE", raising=False)
    result = rollback(trainer, module, error, max_step=10)
    assert not marker.exists()
    assert result.details["action"].startswith(f"rolled back to {folder / 'good.ckpt'}")
    assert any("newer.ckpt" in s and "--trust-pickle" in s for s in result.details["rollback_skipped"])
    monkeypatch.setenv("SDC_TRUST_PICKLE", "1")  # the opt-in: the payload runs (the file has no usable weights)
    with pytest.warns(UserWarning, match="full unpickling"):
        rollback(trainer, module, error, max_step=10)
    assert marker.exists()


# ------------------------------------------------------------------------------------- exit codes


def test_verify_exit_codes_are_distinct(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert sdc(["verify-checkpoint", str(ckpt)]) == EXIT_OK
    plain = tmp_path / "plain.pt"
    torch.save(Net().state_dict(), plain)
    assert sdc(["verify-checkpoint", str(plain)]) == EXIT_NO_FINGERPRINT
    folder = tmp_path / "garbage_folder"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert sdc(["verify-checkpoint", str(folder)]) == EXIT_UNREADABLE
    assert "model.safetensors is not a readable safetensors file" in capsys.readouterr().err
    assert sdc(["verify-checkpoint", str(tmp_path / "missing.ckpt")]) == EXIT_UNREADABLE
    assert sdc(["verify-checkpoint"]) == EXIT_USAGE
    obj = torch.load(ckpt, weights_only=True)
    for garbled, code in (("not a dict", EXIT_CHANGED), ({"version": 1, "tensors": {"a": "x"}}, EXIT_CHANGED),
                          ({"version": 1, "tensors": []}, EXIT_CHANGED), ({**obj[FINGERPRINT_KEY], "version": 99},
                                                                          EXIT_NO_FINGERPRINT)):  # fmt: skip
        torch.save({**obj, FINGERPRINT_KEY: garbled}, tmp_path / "g.ckpt")
        assert sdc(["verify-checkpoint", str(tmp_path / "g.ckpt")]) == code, garbled
        out = capsys.readouterr().out
        assert ("damaged" in out) == (code == EXIT_CHANGED) and ("version 99" in out) == (code != EXIT_CHANGED)


def test_a_garbled_fingerprint_does_not_resume_unchecked(ckpt: Path, tmp_path: Path) -> None:
    obj = torch.load(ckpt, weights_only=True)
    name = next(iter(obj["state_dict"]))
    obj["state_dict"][name].view(-1)[0] += 1.0  # a corrupted tensor, and a fingerprint that can no longer tell
    obj[FINGERPRINT_KEY] = {"version": 1, "tensors": str(obj[FINGERPRINT_KEY]["tensors"])}
    torch.save(obj, tmp_path / "garbled.ckpt")
    t = L.Trainer(accelerator="cpu", devices=1, max_steps=5, callbacks=[WeightFingerprintCheck()], logger=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(FingerprintMismatchError, match="damaged"):
        t.fit(Net(optimizer="adam"), loader(), ckpt_path=tmp_path / "garbled.ckpt")


def test_outputs_never_touch_the_input(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "in.ckpt"
    src.write_bytes(ckpt.read_bytes())
    before = digest(src)
    link = tmp_path / "link.ckpt"
    os.link(src, link)
    assert sdc(["corrupt-checkpoint", str(src), "-o", str(link)]) == EXIT_USAGE  # the same file by another name
    assert "--in-place" in capsys.readouterr().err
    os.link(src, tmp_path / "o.ckpt.flips.json")  # the flip log's name is another name of the input
    assert sdc(["corrupt-checkpoint", str(src), "-o", str(tmp_path / "o.ckpt")]) == EXIT_USAGE
    assert "would overwrite the input" in capsys.readouterr().err and not (tmp_path / "o.ckpt").exists()
    os.unlink(tmp_path / "o.ckpt.flips.json")
    assert sdc(["corrupt-checkpoint", str(src), "-o", str(tmp_path / "o.ckpt")]) == EXIT_OK
    assert json.loads((tmp_path / "o.ckpt.flips.json").read_text())["flips"]
    os.link(src, tmp_path / "hard.ckpt")  # an atomic write replaces a hard link, never writes through it
    atomic_write_text(tmp_path / "hard.ckpt", "new")
    assert digest(src) == before and (tmp_path / "hard.ckpt").read_text() == "new"
    (tmp_path / "a.ckpt.flips.json").write_bytes(ckpt.read_bytes())  # an input named like the log of -o a.ckpt
    assert sdc(["corrupt-checkpoint", str(tmp_path / "a.ckpt.flips.json"), "-o", str(tmp_path / "a.ckpt")]) == 2
    assert "would overwrite the input" in capsys.readouterr().err
    for out, code, words in ((tmp_path, EXIT_UNREADABLE, "is a folder"),
                             (tmp_path / "no" / "x.ckpt", EXIT_UNREADABLE, "does not exist"),
                             (tmp_path / "x.ckpt", EXIT_USAGE, "not a regular expression")):  # fmt: skip
        args = ["--pattern", "("] if code == EXIT_USAGE else []
        assert sdc(["corrupt-checkpoint", str(src), "-o", str(out), *args]) == code
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1
    assert digest(src) == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary left behind
    assert sdc(["corrupt-checkpoint", str(src), "--in-place", "--seed", "3"]) == EXIT_OK  # asked for: changes it
    assert digest(src) != before and digest(link) == before  # replaced by rename: the other link keeps the old


def _bad_files(tmp_path: Path, ckpt: Path) -> dict[str, Path]:
    files = {}

    def put(name: str, data: bytes) -> None:
        files[name] = tmp_path / name
        files[name].write_bytes(data)

    put("empty.ckpt", b"")
    put("text.ckpt", b"not a checkpoint")
    put("random.ckpt", os.urandom(4096))
    put("truncated.ckpt", ckpt.read_bytes()[: len(ckpt.read_bytes()) // 2])
    put("incident.json", b'{"check": "x", "suspects": {"0": {"host": "h"}}}')
    loop: list[Any] = []
    loop.append(loop)
    buf = io.BytesIO()
    torch.save({"state_dict": {"w": torch.ones(2)}, "loop": loop}, buf)
    put("selfref.ckpt", buf.getvalue())
    nested: Any = torch.ones(1)
    for _ in range(3000):
        nested = [nested]
    buf = io.BytesIO()
    try:
        torch.save(nested, buf)
        put("deep.ckpt", buf.getvalue())
    except RecursionError:
        pass
    zbuf = io.BytesIO()  # a zip that torch.load recognises but whose data record is missing
    with zipfile.ZipFile(zbuf, "w") as z, zipfile.ZipFile(ckpt) as real:
        for item in real.namelist():
            if not item.endswith("data.pkl"):
                z.writestr(item, real.read(item))
    put("nopickle.ckpt", zbuf.getvalue())
    files["folder"] = tmp_path / "folder"
    files["folder"].mkdir()
    (files["folder"] / "optimizer.bin").write_bytes(b"\x80\x04junk")
    files["missing"] = tmp_path / "missing.ckpt"
    return files


def test_fuzz_every_verb_with_bad_files_gives_one_line_and_a_documented_code(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    files = _bad_files(tmp_path, ckpt)
    digests = {n: digest(p) for n, p in files.items() if p.is_file()}
    verbs = (["verify-checkpoint"], ["verify-checkpoint", "--json"], ["corrupt-checkpoint", "-o", str(tmp_path / "o")],
             ["report"], ["exclude-list"])  # fmt: skip
    for name, path in files.items():
        for verb in verbs:
            code = sdc([verb[0], str(path), *verb[1:]])
            err = capsys.readouterr().err
            assert code in (0, 1, 2, 3, 4), (name, verb, code, err)
            assert "Traceback" not in err and all(line.startswith(f"sdc {verb[0]}: ") for line in err.splitlines())
            if verb[0] in ("report", "exclude-list"):
                assert code == (EXIT_UNREADABLE if name == "missing" else EXIT_OK), (name, verb, err)
    assert {n: digest(files[n]) for n in digests} == digests  # no input changed
    proc = subprocess.run([sys.executable, "-m", "sdc_core.cli", "corrupt-checkpoint", str(files["selfref.ckpt"]),
                           "-o", str(tmp_path / "s.ckpt"), "--target", "all"], env=worker_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_OK and "Traceback" not in proc.stderr  # a self-referencing file is walked once


def test_usage_errors_and_no_abbreviations(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for args in (["corrupt-checkpoint", str(ckpt), "--in-pl"], ["corrupt-checkpoint", str(ckpt), "-o", "x", "--fract",
                 "0.1"], ["corrupt-checkpoint", str(ckpt), "-o", "x", "--count", "0"],
                 ["corrupt-checkpoint", str(ckpt), "-o", "x", "--bits", "3,x"], ["corrupt-checkpoint", str(ckpt)],
                 ["corrupt-checkpoint", str(ckpt), "-o", "x", "--count", "2", "--fraction", "0.1"],
                 ["verify-checkpoint", str(ckpt), "--js"], ["campaign", "--study", "-1"], ["campaign", "--inj", "3"],
                 ["nonsense"]):  # fmt: skip
        assert sdc(args) == EXIT_USAGE, args
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err
    (tmp_path / "file").write_text("x")
    assert sdc(["campaign", "--out", str(tmp_path / "file"), "--injections", "0", "--clean", "0"]) == EXIT_UNREADABLE
    assert "is a file, not a folder" in capsys.readouterr().err


def test_sdc_core_cli_imports_no_framework_and_takes_new_commands(capsys: pytest.CaptureFixture) -> None:
    code = "import sys, sdc_core.cli as c; c.build_parser(); print(any(m.startswith('lightning') for m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr
    seen = []
    cli.register(cli.Command("hello", "test", lambda p: p.add_argument("--name"), lambda a: seen.append(a.name) or 0))
    try:
        assert sdc(["hello", "--name", "x"]) == 0 and seen == ["x"]
    finally:
        cli.COMMANDS.pop("hello")
    assert sdc(["--help"]) == 0
    listing = capsys.readouterr().out
    assert all(c in listing for c in ("verify-checkpoint", "corrupt-checkpoint", "report", "exclude-list", "campaign"))


# -------------------------------------------------------------------------------------- incidents


def _incident(host: str, rank: int | None = 0, **extra: Any) -> dict[str, Any]:
    return {"time": 1.0e9, "time_iso": "2001-09-09T01:46:40Z", "check": "weight_fingerprint", "step": 3, "rank": rank,
            "suspects": {"0": {"host": host, "device": "cpu"}}, "exclude_hosts": [host] if rank is not None else [],
            **extra}  # fmt: skip


def test_report_skips_bad_files_names_them_and_reports_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "run" / "sdc" / "incidents"
    folder.mkdir(parents=True)
    (folder / "good.json").write_text(json.dumps(_incident("node-a")))
    (folder / "string_hosts.json").write_text(json.dumps(_incident("node-b", exclude_hosts="node-b")))
    (folder / "truncated.json").write_text(json.dumps(_incident("node-c"))[:40])
    (folder / "list.json").write_text("[1, 2]")
    (folder / "bad_suspects.json").write_text(json.dumps(_incident("node-d", suspects=["0"])))
    (folder / "bad_rank.json").write_text(json.dumps(_incident("node-e", rank={"a": 1})))
    (tmp_path / "run" / "results.json").write_text('{"summary": {}}')  # stray: not an incident, passed over quietly
    assert sdc(["exclude-list", str(tmp_path / "run")]) == EXIT_OK
    out, err = capsys.readouterr()
    assert out.strip() == "node-a,node-b"  # never 'n,o,d,e,-,b'
    for name in ("truncated.json", "list.json", "bad_suspects.json", "bad_rank.json"):
        assert name in err
    assert "results.json" not in err and len(err.strip().splitlines()) == 4
    assert sdc(["exclude-list", str(tmp_path / "run"), "--strict"]) == EXIT_UNREADABLE
    capsys.readouterr()
    assert sdc(["report", str(tmp_path / "run"), "--json"]) == EXIT_OK
    rows = json.loads(capsys.readouterr().out)
    assert {r["host"] for r in rows} == {"node-a", "node-b"}
    assert sdc(["report", str(tmp_path / "mistyped")]) == EXIT_UNREADABLE
    assert "mistyped does not exist" in capsys.readouterr().err
    assert sdc(["exclude-list", str(tmp_path / "mistyped")]) == EXIT_UNREADABLE


def test_incidents_in_the_same_millisecond_are_two_files(tmp_path: Path, monkeypatch: Any) -> None:
    from sdc_core.dist.topology import Topology
    from sdc_core.ops.incidents import read_incident_dicts, write_incident

    topo = Topology.gather()
    monkeypatch.setattr("sdc_core.ops.incidents.time.time", lambda: 1_700_000_000.0)
    err = FingerprintMismatchError(step=3, rank=0, suspects=(0,), hosts={0: "h"})
    paths = {write_incident(tmp_path, err, topo, {"every_n_steps": 1}, "raise") for _ in range(3)}
    assert len(paths) == 3
    assert len(read_incident_dicts([tmp_path])) == 3
    assert not [p for p in (tmp_path / "sdc" / "incidents").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(("value", "code"), [("", 86), ("  ", 86), ("7", 7), ("0", 0)])
def test_empty_exit_code_setting_is_unset(monkeypatch: Any, value: str, code: int) -> None:
    from sdc_core.ops.process_exit import exit_code

    monkeypatch.setenv("SDC_EXIT_CODE", value)
    assert exit_code() == code


# --------------------------------------------------------------------------------------- campaign


def test_campaign_doc_is_written_without_matplotlib(tmp_path: Path, monkeypatch: Any) -> None:
    from sdc_core.faults.campaign_report import BIT_CLASSES, SITES, report, write_doc

    rows = [{"id": f"{s}{b}", "site": s, "bit_class": b, "rank": 1, "step": 3, "target": "l1.weight", "bit": 30,
             "index": 0, "changed": True, "weight_rel_diff": 0.1, "final_loss": 1.0, "clean_loss": 1.0,
             "diverged": False, "detected_by": "ring_replay", "named_rank": 1, "attributed": True, "latency": 0,
             "outcome": "detected", "crash": ""} for s in SITES for b in BIT_CLASSES]  # fmt: skip
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        report(rows, tmp_path, seed=0, steps=12)
    doc = tmp_path / "docs" / "coverage.md"
    write_doc(tmp_path, doc, "sdc campaign ...")
    text = doc.read_text()
    assert "# Detection coverage, measured" in text and "![" not in text
    assert doc.with_suffix(".csv").exists() and not doc.with_suffix(".png").exists()


# ---------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("value", "ok"), [(True, True), (1, True), ("1", True), ("true", True), ("FALSE", True), (0, True),
                      ("yes", False), ("on", False), (2, False), ("", False)],
)  # fmt: skip
@pytest.mark.parametrize("source", ["file", "env", "keyword"])
def test_one_rule_for_bools_from_every_source(tmp_path: Path, monkeypatch: Any, source: str, value: Any,
                                              ok: bool) -> None:  # fmt: skip
    from accelerate_sdc.config import SDCConfigError, resolve

    path = tmp_path / "sdc.yaml"
    text = yaml.safe_dump({"replay_exact": value}) if not isinstance(value, str) else f"replay_exact: {value}\n"
    path.write_text(text if source == "file" else "")
    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", str(path))
    kwargs = {"replay_exact": value} if source == "keyword" else {}
    if source == "env":
        monkeypatch.setenv("ACCELERATE_SDC_REPLAY_EXACT", str(value))
    if ok:
        assert resolve(**kwargs)[0].replay_exact is (str(value).lower() in ("true", "1"))
    else:
        with pytest.raises(SDCConfigError, match="replay_exact"):
            resolve(**kwargs)


def test_unknown_names_are_rejected_everywhere_with_a_suggestion(tmp_path: Path, monkeypatch: Any) -> None:
    from accelerate_sdc.config import SDCConfigError, resolve

    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("ACCELERATE_SDC_REPLAY_EVERY_N_STEP", "3")
    with pytest.raises(SDCConfigError, match=r"ACCELERATE_SDC_REPLAY_EVERY_N_STEP \(did you mean"):
        resolve()
    monkeypatch.delenv("ACCELERATE_SDC_REPLAY_EVERY_N_STEP")
    with pytest.raises(SDCConfigError, match="did you mean 'max_names'"):
        resolve(max_name=3)
    (tmp_path / "s.yaml").write_text("replay_rtoll: 0.1\n")
    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", str(tmp_path / "s.yaml"))
    with pytest.raises(SDCConfigError, match="did you mean 'replay_rtol'"):
        resolve()
    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", os.devnull)
    with pytest.raises(SDCConfigError, match="replay_rtol"):  # the check is off, its settings are still checked
        resolve(replay_every_n_steps=0, replay_rtol=5)
    assert resolve(replay_every_n_steps="0", max_names="4")[0].max_names == 4  # strings parse the same everywhere


def test_accelerate_sdc_config_never_overwrites_a_file_it_does_not_own(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from accelerate_sdc.cli import main as acli

    acc = tmp_path / "cfg.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n")
    before = acc.read_text()
    assert acli(["config", "--default", "--config_file", str(acc)]) == 2
    assert acc.read_text() == before and "an accelerate config" in capsys.readouterr().err
    mine = tmp_path / "sdc.yaml"
    assert acli(["config", "--default", "--config_file", str(mine)]) == 0
    assert acli(["config", "--max_names", "2", "--config_file", str(mine)]) == 0  # its own file: replaced
    assert yaml.safe_load(mine.read_text())["max_names"] == 2
    assert acli(["config", "--default", "--config_file", str(tmp_path / "f" / "x.yaml")]) == 0
    capsys.readouterr()
    assert acli(["config", "--default", "--config_file", str(acc / "x.yaml")]) == 4  # its folder is a file
    err = capsys.readouterr().err
    assert "cannot create folder" in err and len(err.strip().splitlines()) == 1
    assert acli(["config", "--max_name", "2", "--config_file", str(mine)]) == 2  # no abbreviations
    assert "did you mean '--max_names'" in capsys.readouterr().err


def test_accelerate_folder_copy_is_built_aside_and_keeps_the_safetensors_header(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = tmp_path / "state"
    src.mkdir()
    save_file({"w": torch.randn(8), "b": torch.randn(2)}, str(src / "model.safetensors"), metadata={"format": "pt"})
    torch.save({"state": {0: {"exp_avg": torch.randn(8)}}, "param_groups": []}, src / "optimizer.bin")
    (src / "random_states_0.pkl").write_bytes(b"\x80\x04N.")  # copied as bytes, never unpickled
    before = {f.name: f.read_bytes() for f in src.iterdir()}
    out = tmp_path / "bad"
    assert sdc(["corrupt-checkpoint", str(src), "-o", str(out), "--target", "all", "--count", "2"]) == EXIT_OK
    assert {f.name: f.read_bytes() for f in src.iterdir()} == before
    assert sorted(f.name for f in out.iterdir()) == sorted(before)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert sdc(["corrupt-checkpoint", str(src), "-o", str(out)]) == EXIT_UNREADABLE  # never merged into a folder
    assert "already exists" in capsys.readouterr().err
    assert sdc(["corrupt-checkpoint", str(src), "-o", str(src / "inside")]) == EXIT_USAGE
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
