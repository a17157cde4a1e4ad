"""Accelerate hook set for the SDC checks (see issue: accelerate integration; not built yet).

The exception classes are already shared with the Lightning callbacks.
"""

from sdc_core.errors import FingerprintMismatchError, NonFiniteGradientError, ReplayMismatchError, SDCError

__all__ = ["FingerprintMismatchError", "NonFiniteGradientError", "ReplayMismatchError", "SDCError"]
