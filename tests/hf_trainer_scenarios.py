"""Hugging Face Trainer scenarios: a tiny GPT-2 built from a config (no download) on CPU ranks.

``torchrun --nproc-per-node 3 tests/hf_trainer_scenarios.py --out DIR --only a,b`` runs the named
scenarios one after the other; each rank writes ``DIR/<scenario>.rank<r>.json``. Every run uses
the Trainer's defaults that matter here: loss scaled by the number of processes
(``average_tokens_across_devices``), gradient accumulation (2), gradient clipping, gradient
checkpointing and its own ``compute_loss``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import parse, run_each
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

from accelerate_sdc import SDCConfigError, SDCError
from accelerate_sdc.transformers import SDCTrainerCallback
from sdc_core import Fault, FaultInjector
from sdc_core.checks.contract import StepCheck
from sdc_core.checks.digest import combine, tensor_digests

STEPS = 4
BF16 = False


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 96, length: int = 32) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 1000, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Inject(TrainerCallback):
    """Fire drill: faults on one rank (module outputs, gradients, weights after the update)."""

    def __init__(self, faults: list[Fault]) -> None:
        self.injector = FaultInjector(faults)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:  # fmt: skip
        self.injector.install(model, dist.get_rank())
        inner = optimizer.optimizer
        inner.register_step_post_hook(lambda *_: self.injector.after_step(state.global_step, model, [inner]))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.injector.set_step(state.global_step)


class CountUpdates(StepCheck):
    """A check of one's own (``SDCTrainerCallback(checks=[...])``): counts the updates it is asked about."""

    def __init__(self) -> None:
        super().__init__("count_updates")

    def before_update(self, step: Any) -> bool:
        self.stats.runs += 1
        return False


def run(out: Path, name: str, sdc: bool = True, faults: list[Fault] = (), report_to: list[str] = (),
        label_smoothing: float = 0.0, save: bool | str = False, resume: str | None = None, catch: bool = True,
        compile: bool = False, **settings: Any) -> dict[str, Any]:  # fmt: skip
    set_seed(3)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64))
    args = TrainingArguments(
        output_dir=str(out / name),
        use_cpu=True,
        report_to=list(report_to),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=1e-3,
        save_strategy=save if isinstance(save, str) else ("steps" if save else "no"),
        save_steps=2,
        disable_tqdm=True,
        seed=3,
        bf16=BF16,
        label_smoothing_factor=label_smoothing,  # compute_loss then pops "labels" from its inputs
        torch_compile=compile,  # the Trainer compiles the model it wraps
        torch_compile_backend="aot_eager" if compile else None,
    )
    inject = Inject(list(faults))
    callbacks: list[Any] = [inject] if faults else []
    sdc_cb = SDCTrainerCallback(**settings) if sdc else None
    if sdc_cb is not None:
        callbacks.append(sdc_cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
        error = None
        try:
            trainer.train(resume_from_checkpoint=resume)
        except SDCError as err:
            if not catch:
                raise
            error = err.to_dict()
    hooks = sdc_cb.hooks if sdc_cb is not None else None
    return {
        "error": error,
        "global_step": trainer.state.global_step,
        "weights": int(combine(tensor_digests(list(trainer.model.parameters())))),
        "state": hooks.state_dict() if hooks is not None else None,
        "log_steps": [e["step"] for e in trainer.state.log_history if "sdc/ring_replay/runs" in e],
        "order": [type(cb).__name__ for cb in trainer.callback_handler.callbacks],
        "fired": inject.injector.fired[:3],
        "checkpoints": sorted(p.name for p in (out / name).glob("checkpoint-*")),
    }


def bad_settings() -> dict[str, Any]:
    try:
        SDCTrainerCallback(replay_rtol=5)
    except SDCConfigError as err:
        return {"message": str(err)}
    return {"message": None}


def resume_corrupted(out: Path) -> dict[str, Any]:
    """``sdc corrupt-checkpoint`` flips one entry of the tied embedding (``lm_head.weight`` is not
    in model.safetensors) of the ``save`` checkpoint (rank 0); every rank's resume raises."""
    from sdc_core.cli import main as sdc

    bad = out / "corrupted"
    if dist.get_rank() == 0:
        sdc(["corrupt-checkpoint", str(out / "save" / "checkpoint-2"), "-o", str(bad), "--pattern", "wte",
             "--seed", "2"])  # fmt: skip
    dist.barrier()
    return run(out, "resume_corrupted", resume=str(bad), replay_every_n_steps=1)


def scenarios(out: Path) -> dict[str, Any]:
    return {
        "bad_settings": bad_settings,
        "plain": lambda: run(out, "plain", sdc=False),
        "clean": lambda: run(out, "clean", report_to=["mlflow", "tensorboard"], replay_every_n_steps=1,
                             checks=[CountUpdates()]),
        "smoothing": lambda: run(out, "smoothing", label_smoothing=0.1, replay_every_n_steps=1),
        "compiled": lambda: run(out, "compiled", compile=True, replay_every_n_steps=1),
        "save": lambda: run(out, "save", save=True, replay_every_n_steps=1),
        "resume": lambda: run(out, "resume", resume=str(out / "save" / "checkpoint-2"), replay_every_n_steps=1),
        "resume_corrupted": lambda: resume_corrupted(out),
        "weights": lambda: run(out, "weights", replay_every_n_steps=0, faults=[
            Fault("weight_bit_flip", rank=2, step=1, target="transformer.h.0.mlp.c_proj.weight", index=7, bit=20)]),
        # a save decided at the epoch's end (4 steps per epoch): the replicas are compared before it
        "epoch_flip": lambda: run(out, "epoch_flip", save="epoch", replay_every_n_steps=0, faults=[
            Fault("weight_bit_flip", rank=2, step=3, target="transformer.h.0.mlp.c_proj.weight", index=7, bit=20)]),
        "nan": lambda: run(out, "nan", replay_every_n_steps=0, faults=[
            Fault("nonfinite_gradient", rank=1, step=1, target="transformer.h.0.attn.c_attn.weight")]),
        "activation": lambda: run(out, "activation", replay_every_n_steps=1, faults=[
            Fault("module_output", rank=0, step=2, target="transformer.h.1.mlp.c_fc", factor=1000.0)]),
        # --uncaught: the verdict leaves the script (rank 0 owns the MLflow run; rank 1 is faulty)
        "mlflow_verdict": lambda: run(out, "mlflow_verdict", report_to=["mlflow"], catch=False,
                                      replay_every_n_steps=0, faults=[
            Fault("nonfinite_gradient", rank=1, step=1, target="transformer.h.0.attn.c_attn.weight")]),
    }  # fmt: skip


def main() -> None:
    def extra(p: Any) -> None:
        p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
        p.add_argument("--uncaught", action="store_true", help="run one scenario; its SDCError leaves the script")

    args = parse(extra=extra)
    global BF16
    BF16 = args.bf16
    table = scenarios(args.out)
    if args.uncaught:
        table[args.only]()
        return
    run_each(args.only, lambda name: table[name](), args.out, int(os.environ["RANK"]))


if __name__ == "__main__":
    main()
