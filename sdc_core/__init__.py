"""sdc_core: the framework-neutral silent-data-corruption checks (torch and torch.distributed only).

Three checks use the data-parallel replicas as witnesses of each other:

* ``NonFiniteGradient``: NaN/Inf in a rank's LOCAL gradients, before the all-reduce;
* ``RingReplay``: a partner rank recomputes a rank's micro-batches and compares;
* ``WeightFingerprint``: replicas compare exact fingerprints of their weights after a step.

A failure raises an ``SDCError`` subclass on every rank, in the same step, naming the faulty rank
and host when the evidence allows. ``SDCHooks`` drives all three in a plain PyTorch loop (DDP or
``fully_shard``); the Lightning, Fabric, Accelerate and Hugging Face Trainer adapters are thin
seams over the same driver.
"""

from sdc_core import shutdown  # first: its exit handler runs after those registered later
from sdc_core.errors import (
    FingerprintMismatchError,
    NonFiniteGradientError,
    ReplayMismatchError,
    ReplayUnavailableError,
    SDCError,
)
from sdc_core.faults import Fault, FaultInjector, flip_bit
from sdc_core.fingerprint import FingerprintConfig, WeightFingerprint, tensor_digest, tensor_digests, vote
from sdc_core.gradients import GradientTap, NonFiniteConfig, NonFiniteGradient
from sdc_core.hooks import Framework, SDCHooks
from sdc_core.payload import PayloadError
from sdc_core.replay import ReplayConfig, RingReplay, StateCapture
from sdc_core.settings import SDCConfigError, SDCSettings
from sdc_core.stats import CheckStats
from sdc_core.topology import Topology, ring_partners

__version__ = "0.1.0"

__all__ = [
    "CheckStats",
    "Fault",
    "FaultInjector",
    "FingerprintConfig",
    "FingerprintMismatchError",
    "Framework",
    "GradientTap",
    "NonFiniteConfig",
    "NonFiniteGradient",
    "NonFiniteGradientError",
    "PayloadError",
    "ReplayConfig",
    "ReplayMismatchError",
    "ReplayUnavailableError",
    "RingReplay",
    "SDCConfigError",
    "SDCError",
    "SDCHooks",
    "SDCSettings",
    "StateCapture",
    "Topology",
    "WeightFingerprint",
    "flip_bit",
    "ring_partners",
    "shutdown",
    "tensor_digest",
    "tensor_digests",
    "vote",
]
