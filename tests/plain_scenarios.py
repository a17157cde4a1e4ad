"""Plain-PyTorch scenarios (``sdc_core.SDCHooks`` in a hand-written torchrun loop), CPU or GPU.

``torchrun --nproc-per-node 3 tests/plain_scenarios.py --out DIR --only mlp:clean,mlp:nan [--device cuda]``
runs the named scenarios one after the other in one process group; each rank writes
``DIR/<scenario>.rank<r>.json``. A scenario is ``<model>:<kind>``:

* models (DDP): ``mlp`` (fp32), ``own`` (the MLP with its head left to each rank: DDP's
  ``parameters_to_ignore``), ``bf16`` (autocast), ``fp16`` (autocast + GradScaler),
  ``sparse`` (``embedding`` with a sparse gradient), ``attention`` (SDPA; flash and memory-efficient backends
  on CUDA, under bf16 autocast there),
  ``embedding`` (an embedding pooled with ``index_add_`` and ``scatter_add_``), ``compile``
  (``torch.compile`` of the body), ``conv`` (conv + BatchNorm, channels-last); ``fsdp``
  (``fully_shard`` of each layer and the root, 4 ranks or more); ``outside`` (the MLP returning its outputs, a tuple
  with a dict, and the loop computing the loss from them with no ``loss_fn``: the replay recomputes by their gradients;
  ``small``: over ``replay_max_state_mb``, refused with the fix; ``twice``: two forwards before one backward, refused);
  ``outside_bf16`` (``outside`` under bf16 autocast: a wrong head output changes no gradient the partner recomputes);
  ``screened``: a head output 10^6 times too large on rank 2 at step 3, which the replay (every 100 steps) does not
  audit: the screen flags the outputs' projection and the partner's recomputation confirms it;
* kinds: ``off`` (no checks: the reference weights), ``clean`` (every check, the replay at every
  second step), ``nan`` (a NaN in rank 1's local gradient at step 2; at steps 2-4 with the fp16
  GradScaler, which skips a lone overflow itself), ``activation`` (a wrong
  output element of one module on rank 2 from step 2: the replay names it), ``flip`` (a bit flip
  in rank 1's weights after step 2: the fingerprint names it), ``flip_audited`` (the same after
  step 1, before the audited step 2: reported as the weight fault it is, not as a compute fault;
  ``flip_audited_nofp`` without the fingerprint check, ``flip_audited_heal`` with it healing),
  ``compiled`` and ``compiled_<kind>`` (``clean`` or that kind with the DDP model compiled before attach),
  ``accumulate`` (two micro-batches a step, the first under ``no_sync``, FSDP2: with gradient sync off as
  Accelerate does; ``accumulate_synced``: both all-reduced, which DDP's replay cannot read and says so;
  ``accumulate_activation``: ``accumulate`` with the ``activation`` fault; ``accumulate_off``: without checks),
  ``zero`` (a clean run under torch's ``ZeroRedundancyOptimizer``: the fingerprint warns that it cannot
  see weight faults there), ``update`` (FSDP: a wrong update of rank 1's shard at step 4, named by the update audit),
  ``matmul``/``matmul_clean``/``matmul_backward`` (``matmul_checksum`` on; a wrong element inside
  rank 2's ``head`` product, forward or weight gradient, at step 3, which the replay does not
  audit), ``save`` (a clean run, then ``before_save``, a checkpoint written and loaded back, verified by a
  fresh hook set; a changed weight refused), ``evaluated`` (``clean`` with an evaluation forward in eval mode after each
  update, under ``no_grad`` or with autograd on and no backward, as validation loops run), ``discarded`` (a forward in
  training mode, never back-propagated, before each step's: refused at the first audit with the fix), ``nan_skip``,
  ``bad_data`` and ``overflow_skip`` (``on_failure="skip_step"``: a NaN in rank 1's local gradient at step 3, a NaN in
  one of its input samples, a finite input of 1e38 its partner's recomputation overflows on too: the last two name no
  rank), ``bad_data_raise`` (the NaN input sample at the default ``"raise"``: no rank named either), ``diverging``
  (SGD at a learning rate that diverges the run, rank 1's inputs x12: its local gradients alone overflow, at step 4;
  no rank named).

With several ranks on one GPU the process group is gloo (NCCL refuses two ranks on a device);
``--backend`` overrides. Each result holds the error (``SDCError.to_dict()``), the weights'
digest, the counters and the incidents written.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import run_each

from sdc_core import Fault, FaultInjector, SDCError, SDCHooks, flip_bit
from sdc_core.checks.digest import combine, tensor_digests
from sdc_core.errors import ReplayUnavailableError
from sdc_core.sharded.checks import local

STEPS = 6


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        h = self.body(x)
        out = self.head(h)
        return (out, {"features": h}) if y is None else F.mse_loss(out.float(), y)  # no labels: ``outside``


def outside_loss(outputs: Any, y: torch.Tensor, world: int) -> torch.Tensor:
    """A loss computed in the loop, as most hand-written loops do: scaled by the world size, with a term on the
    features (both outputs carry gradients)."""
    out, more = outputs
    return F.mse_loss(out.float(), y) * world + 1e-3 * more["features"].float().pow(2).mean()


class Attention(nn.Module):
    """One pre-norm attention block on SDPA, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        h = x + self.proj(h.transpose(1, 2).reshape(b, t, 32))
        return F.mse_loss(self.head(h).float().mean(1), y)


class Embedding(nn.Module):
    """Token embeddings pooled per sequence with ``index_add_`` and ``scatter_add_`` (atomic adds on GPUs); ``sparse``:
    the embedding's gradient is a sparse tensor (which the checks do not read)."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32, sparse=sparse)
        self.head = nn.Linear(64, 4)

    def forward(self, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        e = self.emb(tokens).reshape(b * t, 32)
        seq = torch.arange(b, device=tokens.device).repeat_interleave(t)
        pooled = torch.zeros(b, 32, device=e.device, dtype=e.dtype).index_add_(0, seq, e)
        scattered = torch.zeros(b, 32, device=e.device, dtype=e.dtype).scatter_add_(
            0, seq[:, None].expand(-1, 32), e * 0.5
        )
        return F.mse_loss(self.head(torch.cat([pooled, scattered], 1)).float(), y)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x))).mean((2, 3))
        return F.mse_loss(self.head(h).float(), y)


class Sharded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(torch.relu(self.body(x))), y)


def batches(model: str, device: torch.device, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` batches for this rank (different on each rank, the same in every run)."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(STEPS):
        if model in ("embedding", "sparse"):
            x = torch.randint(0, 100, (8, 12), generator=g)
        elif model == "attention":
            x = torch.randn(8, 16, 32, generator=g)
        elif model == "conv":
            x = torch.randn(8, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
        else:
            x = torch.randn(8, 16, generator=g)
        out.append((x.to(device), torch.randn(8, 4, generator=g).to(device)))
    return out


def build(model: str, device: torch.device) -> nn.Module:
    torch.manual_seed(7)  # every rank starts from the same weights (FSDP2 does not broadcast them)
    sparse = functools.partial(Embedding, sparse=True)
    net: nn.Module = {"embedding": Embedding, "sparse": sparse, "attention": Attention, "conv": Conv, "fsdp": Sharded
                      }.get(model, MLP)()  # fmt: skip
    net = net.to(device)
    if model == "conv":
        net = net.to(memory_format=torch.channels_last)
    if model == "compile":
        net.body.compile(backend="inductor" if device.type == "cuda" else "aot_eager")
    return net


def autocast(model: str, device: torch.device) -> AbstractContextManager[Any]:
    if model in ("bf16", "outside_bf16") or (model == "attention" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if model == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    return nullcontext()


def sdpa_backends(model: str, device: torch.device) -> AbstractContextManager[Any]:
    if model != "attention" or device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


FAULT_TARGETS = {  # (gradient parameter, module whose output goes wrong, weight to flip)
    "embedding": ("head.weight", "head", "emb.weight"),
    "sparse": ("head.weight", "head", "emb.weight"),
    "attention": ("qkv.weight", "proj", "qkv.weight"),
    "conv": ("conv.weight", "head", "head.weight"),  # a channels-last conv weight is not contiguous
}


def faults(model: str, kind: str) -> list[Fault]:
    grad, module, weight = FAULT_TARGETS.get(model, ("body.0.weight", "head", "body.3.weight"))
    if kind == "nan_skip":
        return [Fault("nonfinite_gradient", rank=1, step=3, target=grad)]  # a step not audited: its batches kept
    if kind == "nan":  # with a GradScaler one overflow is the scaler's business: three in a row are not
        steps = (2, 3, 4) if model == "fp16" else (2,)
        return [Fault("nonfinite_gradient", rank=1, step=s, target=grad) for s in steps]
    if kind in ("nan_deferred", "nan_early_deferred"):  # no replay: every verdict read one step later
        return [Fault("nonfinite_gradient", rank=1, step=3 if kind == "nan_deferred" else 1, target=grad)]
    if kind in ("activation", "accumulate_activation"):
        return [Fault("module_output", rank=2, step=2, target=module, factor=1.5, index=3)]
    if kind == "screened":  # a wrong output far out of band at a step the replay does not audit
        return [Fault("module_output", rank=2, step=3, target=module, factor=1e6, index=3)]
    if kind == "flip":
        return [Fault("weight_bit_flip", rank=1, step=2, target=weight, index=5, bit=27)]
    if kind in ("matmul", "matmul_backward"):  # a wrong element inside a product, once, at a step not audited
        phase = "forward" if kind == "matmul" else "weight_grad"
        # bf16 on CUDA: split-K partial sums may be reduced in bf16 (PyTorch's default), which widens the bound
        # by 16 output roundings; x(-3) of this element stays under it there (seen on an H200), x(-100) does not
        factor = -100.0 if model == "bf16" else -3.0
        return [Fault("matmul_output", rank=2, step=3, target="head", index=3, factor=factor, mode="once", phase=phase)]
    if kind.startswith("flip_audited"):  # after update 1, digested already; step 2 is audited: the replay sees it first
        return [Fault("weight_bit_flip", rank=1, step=1, target=weight, index=5, bit=27)]
    return []


def evaluate(forward: Callable[..., torch.Tensor], model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             step: int) -> float:
    """An evaluation forward between two steps, in eval mode and with no backward: under ``no_grad`` after even steps,
    with autograd on (a metric read with ``float``, as loops that forget ``no_grad`` do) after odd ones."""
    model.eval()
    try:
        with torch.no_grad() if step % 2 == 0 else nullcontext():
            return float(forward(x, y))
    finally:
        model.train()


def train(name: str, out: Path, device: torch.device) -> dict[str, Any]:
    model_name, kind = name.split(":")
    bucket_view = model_name.endswith("_bv")  # the gradients live in DDP's buckets (what a memory-tight audit uses)
    model_name = model_name.removesuffix("_bv")
    compiled = kind.startswith("compiled")  # torch.compile of the DDP model, before attach
    kind = {"compiled": "clean"}.get(kind, kind.removeprefix("compiled_"))
    rank, world = dist.get_rank(), dist.get_world_size()
    net = build(model_name, device)
    if model_name == "own":  # the head is each rank's own (DDP ignores it, as it would local experts): it differs
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["head.weight", "head.bias"])
        with torch.no_grad():
            net.head.bias.add_(rank)
    sharded = model_name == "fsdp"
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        fully_shard(net.body, mesh=mesh)
        fully_shard(net.head, mesh=mesh)
        wrapped: nn.Module = fully_shard(net, mesh=mesh)
    else:
        wrapped = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None,
                                          gradient_as_bucket_view=bucket_view)  # fmt: skip
    if compiled:  # the compiled wrapper is what the loop calls and attach is given
        wrapped = torch.compile(wrapped, backend="aot_eager" if device.type == "cpu" else "inductor")
    if kind == "zero":  # torch's ZeRO: each rank updates its shard of the parameters and broadcasts it
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer: Any = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    elif kind == "diverging":  # a learning rate that diverges the run: every rank's loss grows toward overflow
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.8)
    else:  # Adam takes no sparse gradient
        optimizer = (torch.optim.SGD if model_name == "sparse" else torch.optim.AdamW)(wrapped.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type) if model_name == "fp16" else None
    metrics: list[tuple[int, dict[str, float]]] = []
    hooks = None
    at_attach: list[warnings.WarningMessage] = []
    step = 0
    if sharded and kind == "update":  # a wrong update of rank 1's shard: a step post-hook that runs first

        def wrong(opt: Any, *_: Any) -> None:
            if rank == 1 and step == 4:
                flip_bit(local(net.body.weight), 0, 22)

        optimizer.register_step_post_hook(wrong)
    if not kind.endswith("off"):
        settings: dict[str, Any] = {"replay_every_n_steps": 2, "fingerprint_every_n_steps": 1, "log_every_n_steps": 1}
        if kind == "update":
            settings |= {"replay_every_n_steps": 0, "fingerprint_every_n_steps": 0, "update_audit_every_n_steps": 2}
        if kind.startswith("matmul"):
            settings |= {"matmul_checksum": True}
        if kind.endswith("_deferred"):
            settings |= {"replay_every_n_steps": 0}
        if kind == "screened":  # the replay at its default cadence: step 0 audited, the screen on every step
            settings |= {"replay_every_n_steps": 100}
        if kind == "flip_audited_nofp":  # no fingerprint check: a one-off comparison names the weight fault
            settings |= {"fingerprint_every_n_steps": 0}
        if kind == "flip_audited_heal":  # the weight fault healed: the replay's symptom drops the step
            settings |= {"fingerprint_on_failure": "heal"}
        if kind.startswith("accumulate"):  # two micro-batches a step, each loss divided by 2
            settings |= {"accumulation_steps": 2}
        if kind in ("nan_skip", "bad_data", "overflow_skip"):  # the non-finite verdict read before the update
            settings |= {"on_failure": "skip_step"}
        if kind == "small":  # outputs over the replay's state budget
            settings |= {"replay_max_state_mb": 0.001}
        hooks = SDCHooks(run_dir=out / name.replace(":", "-"), log=lambda m, s: metrics.append((s, m)), **settings)
        with warnings.catch_warnings(record=True) as at_attach:
            warnings.simplefilter("always")
            hooks.attach(wrapped, optimizer, scaler=scaler)
    injector = FaultInjector(faults(model_name, kind) if not sharded or kind.endswith("activation") else [])
    injector.install(net, rank)
    error = None
    saved: dict[str, Any] | None = None

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # ``outside``: the loss computed here
        if kind == "twice":  # two views of the batch through the model before one backward
            return outside_loss(wrapped(x), y, world) + outside_loss(wrapped(x * 0.5), y, world)
        return outside_loss(wrapped(x), y, world) if model_name.startswith("outside") else wrapped(x, y)
    with warnings.catch_warnings(record=True) as warned:  # what the checks warn while training
        warnings.simplefilter("always")
        try:
            for step, (x, y) in enumerate(batches(model_name, device, rank) * (3 if kind == "diverging" else 1)):
                injector.set_step(step)
                if kind.startswith("accumulate"):  # the first half unsynchronised (``accumulate_synced``: not)
                    quiet = kind != "accumulate_synced"
                    if sharded:
                        wrapped.set_requires_gradient_sync(not quiet)
                    with wrapped.no_sync() if quiet and not sharded else nullcontext():
                        (forward(x[:4], y[:4]) / 2).backward()
                    if sharded:
                        wrapped.set_requires_gradient_sync(True)
                    x, y = x[4:], y[4:]
                if kind.startswith(("bad_data", "overflow")) and rank == 1 and step == 3:  # one sample of rank 1's
                    x = x.clone()
                    x[0, 0] = 1e38 if kind.startswith("overflow") else float("nan")
                if kind == "diverging" and rank == 1:  # larger inputs: this rank's values overflow first
                    x = x * 12
                if kind == "discarded":  # a forward in training mode whose result is never back-propagated
                    float(forward(x, y))
                with autocast(model_name, device), sdpa_backends(model_name, device):
                    loss = forward(x, y) / (2 if kind.startswith("accumulate") else 1)
                if sharded and kind == "nan" and rank == 1 and step == 2:
                    loss = loss * float("nan")
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    optimizer.step()
                optimizer.zero_grad()
                injector.after_step(step, net, [optimizer])
                if kind == "evaluated":
                    evaluate(forward, wrapped, x, y, step)
                if sharded and kind == "flip" and rank == 1 and step == 2:
                    flip_bit(local(net.body.weight), 5, 22)  # at rest, after the update
            if hooks is not None:
                hooks.finish()
            if kind == "save":
                saved = save_and_load(net, wrapped, optimizer, hooks, out / "saved.pt")
        except SDCError as err:
            error = err.to_dict()
        except (ReplayUnavailableError, ValueError) as err:  # not a verdict: the replay could not run
            error = {"type": type(err).__name__, "step": hooks.step if hooks is not None else None, "rank": None,
                     "message": str(err)}  # fmt: skip
    params = [local(t).detach() for t in (*net.parameters(), *net.buffers())]
    incidents = sorted(p.name for p in (out / name.replace(":", "-")).glob("sdc/incidents/*.json"))
    result = {
        "error": error,
        "step": hooks.step if hooks is not None else step + 1,
        "weights": int(combine(tensor_digests([p.cpu() for p in params]))),
        "finite": all(bool(torch.isfinite(p.float()).all()) for p in params if p.is_floating_point()),
        "state": hooks.state_dict() if hooks is not None else None,
        "metrics": metrics[-1] if metrics else None,
        "incidents": incidents,
        "fired": injector.fired,
        "device": str(device),
        "saved": saved,
        "warnings": [m for m in map(str, [w.message for w in [*at_attach, *warned]]) if "SDC" in m or "inactive" in m],
    }
    if hooks is not None:
        hooks.detach()
    injector.remove()
    return result


def save_and_load(net: nn.Module, wrapped: nn.Module, optimizer: Any, hooks: Any, path: Path) -> dict[str, Any]:
    """``before_save`` compares the replicas and fingerprints the state; the file round-trips; a
    fresh hook set verifies what is loaded (and refuses it, on every rank, once a weight changed)."""
    hooks.before_save()
    if dist.get_rank() == 0:
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "sdc": hooks.state_dict()}, path)
    dist.barrier()
    state = torch.load(path, weights_only=True)
    fresh = SDCHooks(replay_every_n_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh.attach(wrapped, optimizer)
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    fresh.load_state_dict(state["sdc"])  # verified: no error
    restored = fresh.step
    with torch.no_grad():
        net.head.weight.view(-1)[0] += 1.0  # the loaded weights no longer match what was saved
    refused = None
    try:
        fresh.load_state_dict(state["sdc"])
    except SDCError as err:
        refused = err.to_dict()
    fresh.detach()
    return {"restored_step": restored, "refused": refused}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    else:
        device = torch.device("cpu")
    world = int(os.environ["WORLD_SIZE"])
    backend = args.backend or ("nccl" if device.type == "cuda" and torch.cuda.device_count() >= world else "gloo")
    dist.init_process_group(backend)
    run: Callable[[str], Any] = lambda name: train(name, args.out, device)  # noqa: E731
    try:
        run_each(args.only, run, args.out, dist.get_rank())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
