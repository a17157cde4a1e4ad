"""Lightning callbacks for silent-data-corruption checks in DDP training.

```python
trainer = L.Trainer(strategy="ddp", callbacks=[NonFiniteGradientCheck(),
                    RingReplayAudit(every_n_steps=100), WeightFingerprintCheck(every_n_steps=1)])
```

Opt-in: ``MatmulChecksumCheck()`` verifies every matrix product against a checksum. Lightning Fabric:
``lightning_sdc.fabric.SDCHooks``. Without code changes: ``SDC_CHECKS=1`` (``lightning_sdc.auto``)."""

from sdc_core._lazy import lazy_exports, require

require("lightning", "lightning", "lightning_sdc")  # found, not imported: `sdc campaign --help` stays quick
_EXPORTS = {
    "lightning_sdc.callbacks": ("FaultInjector", "MatmulChecksumCheck", "NonFiniteGradientCheck", "RingReplayAudit",
                                "StepCheckCallback", "WeightFingerprintCheck"),
    "sdc_core.faults.inject": ("Fault",),
    "sdc_core.errors": ("ChecksumMismatchError", "FingerprintMismatchError", "NonFiniteGradientError",
                        "ReplayMismatchError", "ReplayUnavailableError", "SDCError"),
}  # fmt: skip
__getattr__, __dir__ = lazy_exports("lightning_sdc", globals(), _EXPORTS)

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
