"""Fire drill for Hugging Face Trainer users: a tiny GPT-2 on 3 CPU ranks, one rank made faulty.

    torchrun --nproc-per-node 3 examples/hf_trainer_demo.py                      # compute fault on rank 1
    torchrun --nproc-per-node 3 examples/hf_trainer_demo.py --fault weights --faulty-rank 2
    torchrun --nproc-per-node 3 examples/hf_trainer_demo.py --fault none         # a clean run
    (or: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 3 examples/hf_trainer_demo.py)

The only SDC line a real script needs is ``callbacks=[SDCTrainerCallback()]``; the fault injector
is the drill. The model is built from a config (no download). Incidents go to
``runs/hf_trainer_demo/sdc/incidents/`` (the ``output_dir``). Exit status 0 when the faulty rank
was named (or, with ``--fault none``, when nothing fired).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

from accelerate_sdc import SDCError
from accelerate_sdc.transformers import SDCTrainerCallback
from sdc_core import Fault, FaultInjector

FAULTS = {
    "compute": lambda r: Fault("module_output", rank=r, step=3, target="transformer.h.1.mlp.c_fc", factor=1000.0),
    "weights": lambda r: Fault("weight_bit_flip", rank=r, step=4, target="transformer.h.0.mlp.c_proj.weight", bit=20),
    "nan": lambda r: Fault("nonfinite_gradient", rank=r, step=5, target="transformer.h.0.attn.c_attn.weight"),
}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 512, length: int = 32) -> None:
        self.ids = torch.randint(0, 1000, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Drill(TrainerCallback):
    """Simulates the faulty rank (a fire drill; never in production)."""

    def __init__(self, faults: list[Fault]) -> None:
        self.injector = FaultInjector(faults)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:  # fmt: skip
        self.injector.install(model, int(os.environ.get("RANK", 0)))
        inner = optimizer.optimizer
        inner.register_step_post_hook(lambda *_: self.injector.after_step(state.global_step, model, [inner]))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.injector.set_step(state.global_step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=[*FAULTS, "none"], default="compute")
    parser.add_argument("--faulty-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64))
    training = TrainingArguments(
        output_dir="runs/hf_trainer_demo",  # incidents: runs/hf_trainer_demo/sdc/incidents/
        use_cpu=True,
        report_to=["tensorboard"],  # the sdc/* metrics go to every tracker named here (e.g. "mlflow" too)
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        logging_steps=5,
        save_strategy="no",
        disable_tqdm=True,
    )
    drill = [Drill([FAULTS[args.fault](args.faulty_rank)])] if args.fault != "none" else []
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(),
                      callbacks=[*drill, SDCTrainerCallback(replay_every_n_steps=1)])  # fmt: skip
    try:
        trainer.train()
    except SDCError as err:
        if trainer.is_world_process_zero():
            print(f"\nDETECTED on every rank: {err}\n  check={err.check} step={err.step} rank={err.rank} "
                  f"suspects={err.suspects} hosts={err.hosts}\n"
                  f"  incident: {getattr(err, 'incident', 'runs/hf_trainer_demo/sdc/incidents')}; sdc/* metrics: "
                  "TensorBoard, runs/hf_trainer_demo/runs\n  next: sdc report runs/hf_trainer_demo",
                  flush=True)  # fmt: skip
        return 0 if err.rank == args.faulty_rank and args.fault != "none" else 1
    if trainer.is_world_process_zero():
        print(f"\nNo SDC detected in {trainer.state.global_step} steps.", flush=True)
    return 0 if args.fault == "none" else 1


if __name__ == "__main__":
    sys.exit(main())
