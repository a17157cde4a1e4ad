"""``SDCHooks`` on a model Accelerate prepared with its FSDP2 plugin (``fsdp_version=2``).

Accelerate's FSDP2 path applies ``fully_shard`` in place: the prepared model is the user's module
(an ``FSDPModule``) whose parameters are DTensors. The same settings map onto the sharded cores:
the non-finite check reads each rank's local gradients in the FSDP reduce-scatter, the fingerprint
compares shards within their replica groups and re-checks unreplicated shards before each forward;
the ring replay has every rank replay its partner's recorded forward inputs through the sharded
model together (the model's forward hooks record them and the module state, as under DDP);
with ``update_audit_every_n_steps`` a partner recomputes each rank's optimizer update of its shard
(the optimizer's step hooks snapshot and audit it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sdc_core.sharded import ShardedFingerprint, ShardedNonFinite
from sdc_core.sharded_replay import ShardedReplay
from sdc_core.topology import Topology


def attach(hooks: Any, model: nn.Module, optimizer: Any) -> Any:
    """Hook a sharded ``model`` (every process, after ``prepare``); returns ``hooks``."""
    hooks._module = model
    topo = Topology.gather(local_rank=hooks.accelerator.local_process_index)
    if hooks.replay is not None:
        from accelerate_sdc.hooks import ACCELERATE_ADVICE

        hooks.replay = ShardedReplay(hooks.replay.config, hooks.replay.stats, topo)
        get, load = hooks._replay_state
        if get is None and load is None:  # as under DDP: the model's own methods, when it has them
            get, load = getattr(model, "sdc_replay_state", None), getattr(model, "sdc_load_replay_state", None)
        hooks.replay.attach(model, get_state=get, load_state=load)
        hooks.replay.advice = ACCELERATE_ADVICE
        hooks._handles.append(model.register_forward_pre_hook(hooks._before_forward, with_kwargs=True))
        hooks._handles.append(model.register_forward_hook(hooks._after_forward, with_kwargs=True))
    if hooks.nonfinite is not None:
        hooks.nonfinite = ShardedNonFinite(hooks.nonfinite.config, hooks.nonfinite.stats, topo)
        hooks.nonfinite.attach(model)
    if hooks.fingerprint is not None:
        fingerprint = hooks.fingerprint = ShardedFingerprint(hooks.fingerprint.config, hooks.fingerprint.stats, topo)

        def before_forward(module: nn.Module, args: Any) -> None:
            if module.training:
                fingerprint.before_use()

        hooks._handles.append(model.register_forward_pre_hook(before_forward))
    hooks.update_audit = audit = hooks.settings.update_audit()
    if audit is not None:  # wrong updates of shards without replicas: a partner recomputes them
        audit.topology = topo
        audit.attach(optimizer, model)
        inner = getattr(optimizer, "optimizer", optimizer)  # the hooks run on sync steps only

        def before(opt: Any, *_: Any) -> None:
            audit.before_update(hooks.step, opt)

        def after(opt: Any, *_: Any) -> None:  # runs after the audit's own digest hook (registered first)
            hooks._verdict(audit, lambda: audit.audit(hooks.step), "raise")

        hooks._handles += [inner.register_step_pre_hook(before), inner.register_step_post_hook(after)]
    hooks._wrap_step(optimizer)
    hooks._model, hooks._optimizer = model, optimizer
    acc = hooks.accelerator
    if hooks.nonfinite is not None:  # no checkpoint after a step whose verdict is unread
        hooks._handles.append(acc.register_save_state_pre_hook(lambda *_: hooks._resolve_nonfinite()))
    # shards are compared before a save; the saved state (DTensor shards) carries no fingerprint
    hooks._handles.append(acc.register_save_state_pre_hook(lambda *_: hooks._check_now()))
    return hooks
