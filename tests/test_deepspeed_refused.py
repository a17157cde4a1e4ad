"""DeepSpeed is refused on every route, in one process as in many, with one line naming what is
supported: its engine reduces the gradients and steps the optimizer itself, where no check sees them.
(DeepSpeed itself is not installed here: the run is what accelerate reports under a DeepSpeed plugin.)"""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from accelerate_sdc import SDCHooks


class _UnderDeepSpeed:
    """A real single-process ``Accelerator`` that reports what ``accelerate launch --use_deepspeed`` sets."""

    distributed_type = DistributedType.DEEPSPEED

    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> object:
        return getattr(self._accelerator, name)


def test_accelerate_one_process_deepspeed_is_refused_in_one_line() -> None:
    accelerator = _UnderDeepSpeed(Accelerator(cpu=True))
    assert accelerator.num_processes == 1  # the single-process path, which used to check nothing here
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = SDCHooks(accelerator)
    with pytest.raises(ValueError) as caught:
        hooks.attach(model, optimizer)
    message = str(caught.value)
    assert "\n" not in message and "DeepSpeed (distributed_type=DEEPSPEED)" in message
    assert message.startswith("SDCHooks supports DDP (DistributedDataParallel), FSDP2 (fully_shard)")


def test_accelerate_without_deepspeed_still_attaches_in_one_process() -> None:
    model = torch.nn.Linear(4, 2)
    hooks = SDCHooks(Accelerator(cpu=True))
    with pytest.warns(UserWarning, match="single process"):
        hooks.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert hooks.nonfinite is not None
