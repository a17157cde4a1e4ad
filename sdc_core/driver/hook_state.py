"""What a hook set's checkpoint holds of it: the counters as plain data (``counters``,
``restore_counters``) and the fingerprint of the model and optimizer state (``saved_tensors``),
taken before a save (``take_fingerprint``) and checked after a load (``verify_loaded``).

The fingerprint taken before a save travels under ``FINGERPRINT_KEY`` with the counters, so the
tensors loaded with them can be verified (``sdc_core.io.checkpoints.check_loaded_checkpoint``). No
pickle: every value is a number, a string, a list or a dict. No communication.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sdc_core.checks.screen import GradientScreen
from sdc_core.driver.framework import inner_optimizer
from sdc_core.io.checkpoints import FINGERPRINT_KEY, check_loaded_checkpoint, fingerprint_checkpoint
from sdc_core.sharded.checks import is_sharded


def counters(step: int, updates: int, checks: list[Any], fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """The hook set's state: its step and update counts, each check's counters and, when one was
    taken, the fingerprint of the saved model and optimizer state."""
    state: dict[str, Any] = {
        "step": step,
        "updates": updates,
        "checks": {c.stats.check: c.stats.state_dict() for c in checks},
        "screen_bands": {c.stats.check: c.state_dict() for c in checks if isinstance(c, GradientScreen)},
    }
    if fingerprint is not None:
        state[FINGERPRINT_KEY] = fingerprint
    return state


def restore_counters(state: dict[str, Any], checks: list[Any]) -> tuple[int, int, Any]:
    """Each of ``checks`` gets its counters back from ``state`` (``counters``' form); returns the
    step and update counts and the fingerprint saved with them (or None). ``ValueError`` for a
    state that is not of that form."""
    try:
        step, updates, saved = int(state["step"]), int(state["updates"]), dict(state["checks"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"corrupted SDCHooks state: {err!r} in {state!r}") from err
    for check in checks:
        if check.stats.check in saved:
            check.stats.load_state_dict(saved[check.stats.check])
        band = state.get("screen_bands", {}).get(check.stats.check)  # absent in earlier checkpoints
        if isinstance(check, GradientScreen) and isinstance(band, dict):
            check.load_state_dict(band)
    return step, updates, state.get(FINGERPRINT_KEY)


def saved_tensors(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The state a checkpoint of the hook set's model holds: the unwrapped model's and the torch optimizer's."""
    return {"model": module.state_dict(), "optimizer": inner_optimizer(optimizer).state_dict()}


def take_fingerprint(module: nn.Module | None, optimizer: Any) -> dict[str, Any] | None:
    """The fingerprint of the state a checkpoint of ``module`` holds (DDP or one process); None
    before ``attach`` and for a ``fully_shard`` model (its DTensor shards are compared, not fingerprinted)."""
    if module is None or is_sharded(module):
        return None
    return fingerprint_checkpoint(saved_tensors(module, optimizer))


def verify_loaded(module: nn.Module | None, optimizer: Any, stored: dict[str, Any], step: int) -> None:
    """Raise ``FingerprintMismatchError`` when the loaded state of ``module`` and ``optimizer``
    differs from ``stored``, the fingerprint saved with it (every process loads the same files)."""
    assert module is not None
    check_loaded_checkpoint({**saved_tensors(module, optimizer), FINGERPRINT_KEY: stored}, step)


__all__ = ["counters", "restore_counters", "saved_tensors", "take_fingerprint", "verify_loaded"]
