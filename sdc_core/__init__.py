"""sdc_core: the framework-neutral silent-data-corruption checks (torch and torch.distributed only).

The data-parallel replicas witness each other: ``NonFiniteGradient`` (NaN/Inf in a rank's local gradients, before the
all-reduce), ``RingReplay`` (a partner recomputes a rank's micro-batches) and ``WeightFingerprint`` (exact weight
fingerprints compared after a step). A failure raises an ``SDCError`` on every rank in the same step, naming the faulty
rank and host when the evidence allows. ``SDCHooks`` drives the checks in a plain loop; the framework adapters are seams
over it."""

from sdc_core._lazy import lazy_exports
from sdc_core.ops import process_exit  # first: its exit handler runs after those registered later

_EXPORTS = {  # imported on first use (PEP 562): ``import sdc_core`` (and ``sdc --help``) does not import torch
    "sdc_core.errors": ("FingerprintMismatchError", "NonFiniteGradientError", "ReplayMismatchError",
                        "ReplayUnavailableError", "SDCError"),
    "sdc_core.faults.inject": ("Fault", "FaultInjector", "flip_bit"),
    "sdc_core.checks.digest": ("tensor_digest", "tensor_digests"),
    "sdc_core.checks.fingerprint": ("FingerprintConfig", "WeightFingerprint", "vote"),
    "sdc_core.checks.gradient_tap": ("GradientTap",),
    "sdc_core.checks.gradients": ("NonFiniteConfig", "NonFiniteGradient"),
    "sdc_core.driver.framework": ("Framework",),
    "sdc_core.driver.hooks": ("SDCHooks",),
    "sdc_core.dist.payload": ("PayloadError",),
    "sdc_core.replay.ring": ("ReplayConfig", "RingReplay"),
    "sdc_core.replay.state": ("StateCapture",),
    "sdc_core.driver.settings": ("SDCConfigError", "SDCSettings"),
    "sdc_core.stats": ("CheckStats",),
    "sdc_core.dist.topology": ("Topology", "ring_partners"),
    "sdc_core.ops.incidents": ("Incident", "load_incidents"),
}  # fmt: skip
__getattr__, __dir__ = lazy_exports("sdc_core", globals(), _EXPORTS)

__version__ = "0.1.0"

__all__ = ["process_exit", *(name for names in _EXPORTS.values() for name in names)]
