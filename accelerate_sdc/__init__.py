"""Accelerate hook set for the SDC checks.

```python
sdc = SDCHooks(accelerator)          # settings from `accelerate-sdc config`, ACCELERATE_SDC_*, keywords
sdc.attach(model, optimizer)         # after accelerator.prepare(...)
```

Hugging Face Trainer: ``accelerate_sdc.transformers.SDCTrainerCallback`` (needs the ``transformers`` extra; importing
this package does not)."""

from sdc_core._lazy import lazy_exports

_EXPORTS = {  # imported on first use: ``accelerate-sdc --help`` imports neither torch nor Accelerate
    "accelerate_sdc.config": ("SDCConfigError", "SDCSettings"),
    "accelerate_sdc.hooks": ("SDCHooks",),
    "sdc_core.errors": ("FingerprintMismatchError", "NonFiniteGradientError", "ReplayMismatchError",
                        "ReplayUnavailableError", "SDCError"),
}  # fmt: skip
__getattr__, __dir__ = lazy_exports("accelerate_sdc", globals(), _EXPORTS)

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
