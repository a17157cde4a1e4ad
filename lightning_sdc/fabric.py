"""``SDCHooks`` for Lightning Fabric: the core loop driver (``sdc_core.SDCHooks``) through a Fabric seam.

```python
model, optimizer = fabric.setup(model, optimizer)
hooks = SDCHooks(fabric).attach(model, optimizer)  # settings as sdc_core.SDCHooks; then train as usual
hooks.finish()
fabric.save(path, {"model": model, "optimizer": optimizer, "sdc": hooks})  # counters and fingerprint
```

Settings as for Accelerate users (keywords over ``ACCELERATE_SDC_*`` over the ``accelerate-sdc config`` file);
Accelerate is not needed. ``fabric.save`` compares the replicas and fingerprints the saved state first; ``fabric.load``
verifies the restored tensors. Details: docs/integrations.md (Lightning Fabric)."""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.fabric.wrappers import is_wrapped
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from sdc_core.driver.framework import Framework, LossFn
from sdc_core.driver.hooks import SDCHooks as _HookSet
from sdc_core.driver.settings import Sources


def _settings_file() -> Path | None:
    """The ``accelerate-sdc config`` file (accelerate's config folder), when Accelerate is installed."""
    try:
        from accelerate.commands.config.config_args import default_yaml_config_file
    except ImportError:
        return None
    return Path(default_yaml_config_file).with_name("sdc_config.yaml")


SOURCES = Sources("ACCELERATE_SDC_", _settings_file)  # the same sources as the Accelerate seam, without importing it


class FabricFramework(Framework):
    """The hook set's seam for a ``Fabric`` object (public Fabric API only); the plain loop's answers hold for the
    rest (every ``optimizer.step()`` is a sync step, ``fabric.backward`` does not divide the loss)."""

    def __init__(self, fabric: Fabric, run_dir: str | None = None) -> None:
        super().__init__(run_dir)
        self.fabric = fabric
        self._pre_save: OrderedDict[int, Callable[..., None]] = OrderedDict()  # RemovableHandle holds it weakly
        self._save_wrapped = False  # once per seam: a re-attach after detach must not wrap (and run the hooks) twice

    @property
    def world_size(self) -> int:
        return self.fabric.world_size

    @property
    def local_rank(self) -> int:
        return self.fabric.local_rank

    @property
    def is_main(self) -> bool:
        return self.fabric.is_global_zero

    def ddp_model(self, model: nn.Module) -> DistributedDataParallel | None:
        return next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)

    def describe(self, model: nn.Module) -> str:
        if not is_wrapped(model):
            return f"a {type(model).__name__} that fabric.setup did not prepare: call attach after fabric.setup"
        return (f"strategy {type(self.fabric.strategy).__name__} (only DDP and a single device are supported; FSDP, "
                "DeepSpeed and model-parallel strategies are not)")  # fmt: skip

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if is_wrapped(model) else model

    @property
    def scaler(self) -> Any:
        return getattr(self.fabric.strategy.precision, "scaler", None)

    def to_device(self, batch: Any, device: Any = None) -> Any:
        return self.fabric.to_device(batch)

    def replay_context(self) -> AbstractContextManager[Any]:
        return self.fabric.autocast()

    def replay_model(self, module: nn.Module) -> Any:
        return _PrecisionModel(module, self.fabric.strategy.precision)

    @property
    def run_dir(self) -> str:
        if self._run_dir is not None:
            return self._run_dir
        folders = (getattr(lg, "log_dir", None) or getattr(lg, "root_dir", None) for lg in self.fabric.loggers)
        return next((str(folder) for folder in folders if folder), ".")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.fabric.log_dict(metrics, step=step)

    def flush(self) -> None:
        if self.fabric.is_global_zero:
            for logger in self.fabric.loggers:
                logger.save()

    def before_checkpoint(self, fn: Callable[..., None]) -> Any:
        """Run ``fn(models, None, path)`` before ``fabric.save`` (every process) writes anything."""
        if not self._save_wrapped:
            self._save_wrapped, original = True, self.fabric.save

            def save(path: Any, state: dict[str, Any], filter: Any = None) -> Any:
                models = [v for v in state.values() if isinstance(v, nn.Module)]
                for hook in list(self._pre_save.values()):
                    hook(models, None, path)
                return original(path, state, filter=filter)

            self.fabric.save = save  # type: ignore[method-assign]
        handle = RemovableHandle(self._pre_save)
        self._pre_save[handle.id] = fn
        return handle

    def after_load(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Run ``fn(state)`` (held weakly) after ``fabric.load(path, state)`` restored every object of ``state``;
        ``fabric._sdc_loading`` is non-zero inside the load."""
        fabric = self.fabric
        if "load" not in vars(fabric):  # once per Fabric
            original = fabric.load
            fabric._sdc_after_load = []
            fabric._sdc_loading = 0

            def load(path: Any, state: dict[str, Any] | None = None, strict: bool = True, **kwargs: Any) -> Any:
                fabric._sdc_loading += 1
                try:
                    remainder = original(path, state, strict, **kwargs)
                finally:
                    fabric._sdc_loading -= 1
                for ref in list(fabric._sdc_after_load):
                    hook = ref()
                    if hook is not None:
                        hook(state or {})
                return remainder

            fabric.load = load  # type: ignore[method-assign]
        alive = [ref for ref in fabric._sdc_after_load if ref() is not None]
        fabric._sdc_after_load = [*alive, weakref.WeakMethod(fn)]  # type: ignore[arg-type]


class _PrecisionModel:
    """The unwrapped module as ``fabric.setup`` presents it, minus DDP: inputs, forward and outputs under the
    precision plugin. Attribute access reaches the module."""

    def __init__(self, module: nn.Module, precision: Any) -> None:
        self._module = module
        self._precision = precision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._precision.convert_input((args, kwargs))
        with self._precision.forward_context():
            outputs = self._module(*args, **kwargs)
        return self._precision.convert_output(outputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class SDCHooks(_HookSet):
    """The SDC checks for a Fabric loop; settings as ``sdc_core.SDCHooks``.

    Args:
        fabric: the launched ``Fabric`` of the run.
        loss_fn: as ``sdc_core.SDCHooks``.
        run_dir: where incidents go (``<run_dir>/sdc/incidents``); default: the first logger's
            ``log_dir``, else the working directory.
        **settings: any field of ``sdc_core.SDCSettings``.

    Call ``attach(model, optimizer)`` on every process after ``fabric.setup`` and ``finish()`` after the loop. Cost:
    that of the core hook set."""

    def __init__(self, fabric: Fabric, loss_fn: LossFn | None = None, run_dir: str | None = None,
                 **settings: Any) -> None:  # fmt: skip
        if not isinstance(fabric, Fabric):
            raise TypeError(f"lightning_sdc.fabric.SDCHooks needs a launched Fabric, got {type(fabric).__name__}")
        self.fabric = fabric
        framework = FabricFramework(fabric, run_dir)
        super().__init__(loss_fn, framework=framework, sources=SOURCES, **settings)
        framework.after_load(self._after_load)

    def attach(self, model: nn.Module, optimizer: Any, loss_fn: LossFn | None = None) -> SDCHooks:
        """Hook the model and optimizer ``fabric.setup`` returned (every process)."""
        strategy = self.fabric.strategy
        if not isinstance(strategy, DDPStrategy | SingleDeviceStrategy) or isinstance(strategy, DeepSpeedStrategy):
            raise ValueError(
                f"lightning_sdc.fabric.SDCHooks supports strategy 'ddp' (and its variants) or a single device; got "
                f"{type(strategy).__name__} (FSDP, DeepSpeed and model-parallel strategies are not supported)")
        super().attach(model, optimizer, loss_fn)
        self.fabric._sdc_hooks = weakref.ref(self)  # the hook set clip_gradients consults
        if "clip_gradients" not in vars(self.fabric):  # once per Fabric
            # fabric.clip_gradients raises a plain RuntimeError on NaN/Inf gradients before optimizer.step reads the
            # verdict: then the verdict is read at once, so the NonFiniteGradientError naming the rank leaves
            # instead, on every process (all see the same reduced gradients, so all raise)
            fabric, original = self.fabric, self.fabric.clip_gradients

            def clip_gradients(*args: Any, **kwargs: Any) -> Any:
                try:
                    return original(*args, **kwargs)
                except RuntimeError:
                    hooks = fabric._sdc_hooks()  # the hook set attached last (one Fabric may serve several runs)
                    if hooks is not None and hooks.module is not None:
                        hooks.check_gradients_now()  # raises the SDC verdict when the gradients are non-finite
                    raise

            fabric.clip_gradients = clip_gradients  # type: ignore[method-assign]
        return self

    def _verify_loaded(self) -> None:
        """Inside ``fabric.load`` the model or optimizer may not be restored yet: verified by ``_after_load``."""
        if not getattr(self.fabric, "_sdc_loading", 0):
            super()._verify_loaded()

    def _after_load(self, state: dict[str, Any]) -> None:
        """After ``fabric.load``: the restored state verified against the fingerprint loaded with the counters (on
        every process: each loads the same file); before ``attach``, ``attach`` verifies it."""
        if self._loaded_fingerprint is None or self._module is None:
            return
        models = [v for v in state.values() if isinstance(v, nn.Module)]
        if not models or not self.owns(models):
            self._loaded_fingerprint = None
            warnings.warn("the SDC fingerprint loaded by fabric.load is not verified: the state loaded with it does "
                          "not hold the model this hook set is attached to", UserWarning, stacklevel=3)  # fmt: skip
            return
        self._verify_loaded()
