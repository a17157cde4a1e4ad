"""Accelerate hook set for the SDC checks.

```python
sdc = SDCHooks(accelerator)          # settings from `accelerate-sdc config`, ACCELERATE_SDC_*, keywords
sdc.attach(model, optimizer)         # after accelerator.prepare(...)
```

Hugging Face Trainer: ``accelerate_sdc.transformers.SDCTrainerCallback`` (needs the
``transformers`` extra; importing this package does not).
"""

from accelerate_sdc.config import SDCConfigError, SDCSettings
from accelerate_sdc.hooks import SDCHooks
from sdc_core.errors import (
    FingerprintMismatchError,
    NonFiniteGradientError,
    ReplayMismatchError,
    ReplayUnavailableError,
    SDCError,
)

__all__ = [
    "FingerprintMismatchError",
    "NonFiniteGradientError",
    "ReplayMismatchError",
    "ReplayUnavailableError",
    "SDCConfigError",
    "SDCError",
    "SDCHooks",
    "SDCSettings",
]
