"""``SDCHooks`` for hand-written Accelerate training loops (usage: the ``accelerate_sdc`` package): the core hook set
(``sdc_core.SDCHooks``) through an Accelerate seam (``AccelerateFramework``). ``save_state`` compares the replicas and
fingerprints the saved state before anything is written; ``load_state`` verifies the loaded tensors."""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from torch import nn

from sdc_core._lazy import missing

try:
    from accelerate.utils import DDPCommunicationHookType, send_to_device
except ImportError as err:
    raise missing(err, "accelerate", "accelerate", "accelerate_sdc") from None

from accelerate_sdc import config
from sdc_core.driver.framework import Framework, LossFn
from sdc_core.driver.hooks import SDCHooks as _CoreHooks
from sdc_core.errors import SDCError
from sdc_core.io.safe_files import atomic_write_text

STATE_FILE = "sdc_state.json"  # the hook set's counters in a save_state folder
MAX_STATE_BYTES = 64 << 20

__all__ = ["AccelerateFramework", "Framework", "LossFn", "SDCHooks"]


class AccelerateFramework(Framework):
    """The hook set's seam for an ``Accelerator``. None of its members communicates."""

    def __init__(self, accelerator: Any) -> None:
        super().__init__()
        self.accelerator = accelerator
        self._stateful: Any = None  # the hook set whose counters travel with save_state/load_state
        self._write_handle: Any = None
        self._loaded: dict[str, Any] | None = None

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def local_rank(self) -> int:
        return self.accelerator.local_process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def tracker_targets(self) -> list[tuple[str, Any]]:
        """``accelerator.trackers`` that take text: TensorBoard, MLflow (its active run), W&B."""
        targets = {
            "TensorBoardTracker": lambda tracker: ("tensorboard", tracker.writer),
            "MLflowTracker": lambda tracker: ("mlflow", (importlib.import_module("mlflow"), None)),
            "WandBTracker": lambda tracker: ("wandb", tracker.run),
        }
        trackers = getattr(self.accelerator, "trackers", [])
        return [targets[type(t).__name__](t) for t in trackers if type(t).__name__ in targets]

    def unsupported(self, model: nn.Module) -> str | None:
        if getattr(self.accelerator, "distributed_type", None) == "DEEPSPEED":  # DistributedType is a str enum
            return ("DeepSpeed (distributed_type=DEEPSPEED), in any number of processes: its engine runs the "
                    "gradient reduction and the optimizer step itself, where the checks cannot see them; use "
                    "DDP or FSDP2 (fully_shard) with the SDC checks")  # fmt: skip
        return None

    def describe(self, model: nn.Module) -> str:
        if self.unwrap(model) is model:
            return (f"a plain {type(model).__name__} (not the DDP model `accelerator.prepare` returns: attach the "
                    f"prepared model; distributed_type={self.accelerator.distributed_type})")  # fmt: skip
        return (f"distributed_type={self.accelerator.distributed_type} with a {type(model).__name__} model (FSDP1 "
                "and DeepSpeed are not supported; FSDP2 is: fsdp_version: 2 in the Accelerate config)")  # fmt: skip

    def unwrap(self, model: nn.Module) -> nn.Module:  # not a compiled one: Accelerate 1.16 would re-point it past DDP
        return self.accelerator.unwrap_model(getattr(model, "_orig_mod", model))

    @property
    def sync_gradients(self) -> bool:
        return self.accelerator.sync_gradients

    @property
    def loss_divisor(self) -> int:
        return self.accelerator.gradient_accumulation_steps

    @property
    def scaler(self) -> Any:
        return self.accelerator.scaler

    def step_owner(self, optimizer: Any) -> Any:
        return optimizer  # the AcceleratedOptimizer calls the GradScaler itself

    def step_was_skipped(self, optimizer: Any) -> bool:
        return bool(getattr(optimizer, "step_was_skipped", False))

    def to_device(self, batch: Any, device: Any = None) -> Any:
        return send_to_device(batch, self.accelerator.device)

    @property
    def run_dir(self) -> str:
        acc = self.accelerator
        return getattr(acc, "project_dir", None) or getattr(acc, "logging_dir", None) or "."

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.accelerator.log(metrics, step=step)

    def flush(self) -> None:
        for tracker in getattr(self.accelerator, "trackers", []):
            writer = getattr(tracker, "writer", None)
            if writer is not None and hasattr(writer, "flush"):
                writer.flush()

    def register_for_checkpointing(self, obj: Any) -> None:
        """``save_state`` writes ``obj.state_dict()`` to ``sdc_state.json`` (main process, atomically, after the
        pre-save hooks); ``load_state`` gives it back to ``obj.load_state_dict`` after loading the rest. No pickle."""
        self._stateful = obj
        acc = self.accelerator
        acc.register_save_state_pre_hook(self._note_folder)  # runs before the refusing pre-save hooks
        self._write_handle = acc.register_save_state_pre_hook(self._write_state)
        acc.register_load_state_pre_hook(self._read_state)
        if "save_state" not in vars(acc):  # once per accelerator: a refused save leaves no empty folder
            original_save = acc.save_state

            def save_state(output_dir: Any = None, *args: Any, **kwargs: Any) -> Any:
                existed = output_dir is not None and Path(output_dir).exists()
                acc._sdc_save_folder = None
                try:
                    return original_save(output_dir, *args, **kwargs)
                except SDCError:
                    folder = acc._sdc_save_folder  # the folder save_state created before the hooks ran
                    if folder is not None and not existed:
                        with contextlib.suppress(OSError):  # not empty, or another process removed it
                            folder.rmdir()
                    raise

            acc.save_state = save_state
        if "load_state" not in vars(acc):  # once per accelerator: load_state then restores the counters
            original = acc.load_state

            def load_state(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                for fw in list(acc._sdc_frameworks):
                    fw._restore()
                return out

            acc.load_state = load_state
            acc._sdc_frameworks = []
        acc._sdc_frameworks.append(self)

    def _note_folder(self, models: Any, weights: Any, output_dir: str) -> None:
        self.accelerator._sdc_save_folder = Path(output_dir)

    def _write_state(self, models: Any, weights: Any, output_dir: str) -> None:
        if self._stateful is not None and self._stateful.owns(models) and self.accelerator.is_main_process:
            atomic_write_text(Path(output_dir) / STATE_FILE, json.dumps(self._stateful.state_dict(), allow_nan=False))

    def _read_state(self, models: Any, input_dir: str) -> None:
        path = Path(input_dir) / STATE_FILE
        self._loaded = None
        if self._stateful is None or not self._stateful.owns(models) or not path.is_file():
            return  # a folder saved without the hook set (or by a release that pickled it): counters start anew
        if path.stat().st_size > MAX_STATE_BYTES:
            raise ValueError(f"{path} is larger than {MAX_STATE_BYTES} bytes: not an SDC state file")
        try:
            self._loaded = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"corrupted SDC state file {path}: {err}") from None

    def _restore(self) -> None:
        loaded, self._loaded = self._loaded, None
        if loaded is not None and self._stateful is not None:
            self._stateful.load_state_dict(loaded)

    def before_checkpoint(self, fn: Callable[..., None]) -> Any:
        handle = self.accelerator.register_save_state_pre_hook(fn)
        if self._write_handle is not None:  # the state file is written after this hook (the fingerprint)
            self._write_handle.remove()
            self._write_handle = self.accelerator.register_save_state_pre_hook(self._write_state)
        return handle

    def take_comm_hook(self) -> tuple[Any, Any]:
        """Take the hook ``DistributedDataParallelKwargs(comm_hook=...)`` would register, for the tap to register."""
        handler = getattr(self.accelerator, "ddp_handler", None)
        taken = getattr(self.accelerator, "_sdc_taken_comm_hook", None)
        if taken is not None:
            return taken  # taken by an earlier SDCHooks of this accelerator
        if handler is None or handler.comm_hook == DDPCommunicationHookType.NO:
            return None, None
        captured: dict[str, Any] = {}
        handler.register_comm_hook(SimpleNamespace(register_comm_hook=captured.update))  # called with state=, hook=
        handler.comm_hook = DDPCommunicationHookType.NO
        handler.comm_wrapper = DDPCommunicationHookType.NO
        self.accelerator._sdc_taken_comm_hook = (captured.get("hook"), captured.get("state"))
        return self.accelerator._sdc_taken_comm_hook


class SDCHooks(_CoreHooks):
    """The SDC checks for an ``Accelerator`` loop.

    Args:
        accelerator: the ``Accelerator`` of the run.
        loss_fn, replay_state, load_replay_state: as ``sdc_core.SDCHooks``.
        **settings: any field of ``SDCSettings``, over ``ACCELERATE_SDC_*`` over the
            ``accelerate-sdc config`` file; 0 turns a cadence off.

    Call ``attach(model, optimizer)`` on every process after ``accelerator.prepare``, ``finish()`` after the loop, and
    ``save_state`` / ``load_state`` on every process, as Accelerate expects."""

    def __init__(
        self,
        accelerator: Any,
        loss_fn: LossFn | None = None,
        replay_state: Callable[[], Any] | None = None,
        load_replay_state: Callable[[Any], None] | None = None,
        *,
        _framework: Framework | None = None,
        **settings: Any,
    ) -> None:
        self.accelerator = accelerator
        framework = _framework if _framework is not None else AccelerateFramework(accelerator)
        super().__init__(loss_fn, replay_state, load_replay_state, framework=framework, sources=config.SOURCES,
                         **settings)  # fmt: skip
