"""Lightning callbacks for silent-data-corruption checks in DDP training.

```python
trainer = L.Trainer(strategy="ddp", callbacks=[NonFiniteGradientCheck(),
                    RingReplayAudit(every_n_steps=100), WeightFingerprintCheck(every_n_steps=1)])
```

Opt-in: ``MatmulChecksumCheck()`` verifies every matrix product against a checksum, so a wrong
multiply is caught on the rank and in the step where it happens (``sdc_core.matmul``).

Lightning Fabric: ``lightning_sdc.fabric.SDCHooks``. Without code changes: ``SDC_CHECKS=1``
(``lightning_sdc.auto``, through the ``lightning.pytorch.callbacks_factory`` entry point).
"""

from lightning_sdc.callbacks import (
    FaultInjector,
    MatmulChecksumCheck,
    NonFiniteGradientCheck,
    RingReplayAudit,
    WeightFingerprintCheck,
)
from sdc_core import Fault
from sdc_core.errors import (
    ChecksumMismatchError,
    FingerprintMismatchError,
    NonFiniteGradientError,
    ReplayMismatchError,
    ReplayUnavailableError,
    SDCError,
)

__all__ = [
    "ChecksumMismatchError",
    "Fault",
    "FaultInjector",
    "FingerprintMismatchError",
    "MatmulChecksumCheck",
    "NonFiniteGradientCheck",
    "NonFiniteGradientError",
    "ReplayMismatchError",
    "ReplayUnavailableError",
    "RingReplayAudit",
    "SDCError",
    "WeightFingerprintCheck",
]
