"""The matrix-product checksum check in one process: the rounding bound (clean products never
alarm, an error of the stated size always does), the hooks on real autograd, attention coverage,
faults inside products, verdict delivery. Multi-rank runs: tests/test_matmul_ddp.py."""

from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from sdc_core.checks.matmul import MatmulChecksum, MatmulChecksumConfig
from sdc_core.checks.matmul_bound import (
    LinearBound,
    operand,
    plain_arithmetic,
    rounding,
    visible_error_sizes,
    worst_ratio,
)
from sdc_core.checks.matmul_sites import product_node
from sdc_core.errors import ChecksumMismatchError, SDCError
from sdc_core.faults.inject import Fault, FaultInjector

FAST = settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
PRECISIONS = ("fp32", "fp64", "bf16_autocast", "fp16_autocast", "bf16_weights")
PATTERNS = ("normal", "positive", "constant", "mixed_scale")


def _tensor(shape: tuple[int, ...], pattern: str, scale: float, gen: torch.Generator) -> torch.Tensor:
    if pattern == "constant":  # every rounding error has the same sign: the worst case the bound must hold
        return torch.full(shape, scale * (1 + 2**-9))
    t = torch.randn(shape, generator=gen) * scale
    if pattern == "positive":
        return t.abs()
    if pattern == "mixed_scale":  # rows of very different magnitudes
        return t * torch.logspace(-4, 4, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
    return t


def _run(model: nn.Module, x: torch.Tensor, precision: str, dy_scale: float, gen: torch.Generator,
         check: MatmulChecksum) -> dict:  # fmt: skip
    """One armed forward and backward; the check's worst ratio per (site, product)."""
    check.arm(0)
    dtype = {"bf16_autocast": torch.bfloat16, "fp16_autocast": torch.float16}.get(precision)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = model(x)
    y.backward(torch.randn(y.shape, generator=gen).to(y.dtype) * dy_scale)
    return check.worst()


@FAST
@given(
    n=st.integers(1, 96), k=st.integers(1, 300), m=st.integers(1, 300),
    precision=st.sampled_from(PRECISIONS), pattern=st.sampled_from(PATTERNS),
    x_exp=st.integers(-12, 12), w_exp=st.integers(-6, 6), dy_exp=st.integers(-12, 12),
    bias=st.booleans(), layout=st.sampled_from(["2d", "3d", "3d_transposed"]), block=st.sampled_from([0, 5, 32]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
@example(n=6, k=8, m=5, precision="bf16_autocast", pattern="mixed_scale", x_exp=0, w_exp=0, dy_exp=0, bias=True,
         layout="2d", block=0, seed=19833)  # the check's own arithmetic once ran under autocast
@example(n=1, k=2, m=1, precision="bf16_autocast", pattern="normal", x_exp=-11, w_exp=0, dy_exp=-12, bias=False,
         layout="2d", block=0, seed=0)  # 2-norms of values near 1e-23 underflow
def test_clean_products_never_alarm(n, k, m, precision, pattern, x_exp, w_exp, dy_exp, bias, layout, block, seed):
    """Random shapes, magnitudes from 1e-12 to 1e12, all-positive and constant data (correlated
    rounding errors), every precision: the forward, input-gradient and weight-gradient checks of a
    correct product stay within the bound (products that may overflow fp16 are not judged)."""
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, m, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(_tensor((m, k), pattern, 10.0**w_exp / math.sqrt(k), gen))
        if bias:
            layer.bias.copy_(_tensor((m,), pattern, 10.0**w_exp, gen))
    shape = {"2d": (n, k), "3d": (2, n, k), "3d_transposed": (n, 2, k)}[layout]
    x = _tensor(shape, pattern, 10.0**x_exp, gen)
    if layout == "3d_transposed":
        x = x.transpose(0, 1)
    if precision == "fp64":
        layer, x = layer.double(), x.double()
    elif precision == "bf16_weights":
        layer, x = layer.bfloat16(), x.bfloat16()
    x.requires_grad_(True)
    check = MatmulChecksum(MatmulChecksumConfig(block=block))
    check.attach(layer)
    worst = _run(layer, x, precision, 10.0**dy_exp, gen, check)
    assert {p for _, p in worst} == {"output", "input_gradient", "weight_gradient"}
    assert all(v <= 1.0 for v in worst.values()), worst


@FAST
@given(
    n=st.integers(1, 64), k=st.integers(2, 256), m=st.integers(2, 256), precision=st.sampled_from(PRECISIONS),
    phase=st.sampled_from(["output", "input_gradient", "weight_gradient"]), sign=st.sampled_from([1.0, -1.0]),
    margin=st.floats(1.01, 1e6), block=st.sampled_from([0, 7, 32]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_error_of_the_stated_size_always_alarms(n, k, m, precision, phase, sign, margin, block, seed):
    """One element of a product made wrong by more than the stated threshold (``*_threshold``:
    what the clean product's bound guarantees, allowing for the wrong element raising the bound)
    is always caught, in whole rows and in blocks."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = {"fp32": torch.float32, "fp64": torch.float64, "fp16_autocast": torch.float16}
    dtype = dtypes.get(precision, torch.bfloat16)
    x = torch.randn(n, k, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(m, k, generator=gen, dtype=torch.float64) / math.sqrt(k)).to(dtype)
    b = torch.randn(m, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(n, m, generator=gen, dtype=torch.float64).to(dtype)
    rnd = rounding(dtype, "cpu")
    lb = LinearBound.of(w, b, dtype, rnd, block=block)
    acc = rnd.acc_dtype
    x2 = operand(x, dtype, acc, k)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = F.linear(xr, wr, b)
    found = product_node(y)
    assert found is not None
    grads: dict[str, torch.Tensor] = {}
    found[0].register_hook(lambda gi, go: grads.update(dx=gi[found[1]], dwt=gi[found[1] + 1]))
    y.backward(dy)
    y = y.detach()
    i, j, l_ = (int(torch.randint(size, (1,), generator=gen)) for size in (n, m, k))
    _, x_norms, x_block_norms, x_block_sums = lb.forward_ratio(x2, y, need_blocks=True)
    dy2 = dy.to(acc)
    dy_norms = torch.linalg.vector_norm(dy2, dim=-1)
    if phase == "output":
        out, at, cell = y.clone(), (i, j), (i, j // lb.bf)
        threshold = lb.forward_threshold(x_norms, y)[cell]
    elif phase == "input_gradient":
        out, at, cell = grads["dx"].clone(), (i, l_), (i, l_ // lb.bx)
        threshold = lb.input_grad_threshold(dy_norms, grads["dx"])[cell]
    else:
        out, at, cell = grads["dwt"].clone(), (l_, j), (j, l_ // lb.bx)
        threshold = lb.weight_grad_threshold(x_block_norms, dy_norms, grads["dwt"])[cell]
    threshold = float(threshold)
    if not math.isfinite(threshold) or threshold * margin > torch.finfo(dtype).max / 4:
        return  # an error that large is not representable in this dtype, or the row is not judged
    before = out[at].to(torch.float64)
    out[at] = (before + sign * threshold * margin).to(dtype)
    if abs(float(out[at].to(torch.float64) - before)) <= threshold:  # rounding to the dtype ate the margin
        return
    if phase == "output":
        ratio = lb.forward_ratio(x2, out)[0]
    elif phase == "input_gradient":
        ratio = lb.input_grad_ratio(dy2, out, dy_norms)
    else:
        ratio = lb.weight_grad_ratio(dy2, out, x_block_sums, x_block_norms, dy_norms)
    assert not float(ratio[cell]) <= 1.0, (phase, float(ratio[cell]), threshold)


def test_visible_error_sizes_relative_to_the_output():
    """What the stated sizes mean for a layer of the benchmark transformer's width (docs/coverage.md):
    with checksums over blocks of 32 a wrong element a few percent of its row's largest is caught
    in fp32, and one of about a third of it in bf16; whole-row checksums see less."""
    blocks = visible_error_sizes(256, torch.float32, rows=256)
    rows = visible_error_sizes(256, torch.float32, rows=256, block=0)
    bf16 = visible_error_sizes(256, torch.bfloat16, rows=256)
    assert blocks["output_vs_max"] < 0.05 and blocks["input_gradient_vs_max"] < 0.05
    assert blocks["weight_gradient_vs_max"] < 0.5
    assert bf16["output_vs_max"] < 1.0
    assert rows["output_vs_max"] > 5 * blocks["output_vs_max"]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


@pytest.mark.parametrize("phase,product", [("forward", "output"), ("input_grad", "input_gradient"),
                                           ("weight_grad", "weight_gradient")])  # fmt: skip
def test_a_wrong_element_inside_a_product_is_named_at_its_step(phase, product):
    model = _mlp()
    check = MatmulChecksum()
    check.attach(model)
    injector = FaultInjector([Fault("matmul_output", rank=0, step=2, target="2", index=77, bit=30, mode="once",
                                    phase=phase)])  # fmt: skip
    injector.install(model, 0)
    x = torch.randn(32, 16)
    with pytest.raises(ChecksumMismatchError) as caught:
        for step in range(5):
            injector.set_step(step)
            check.arm(step)
            model(x).pow(2).mean().backward()
            check.verdict(step)
            assert check.pending_step == step  # read one step later: no host wait in the step
    err = caught.value
    assert (err.step, err.rank, err.module, err.details["product"]) == (2, 0, "2", product)
    assert err.phase == ("forward" if phase == "forward" else "backward")
    assert err.suspects == (0,) and "2" in str(err) and err.check == "matmul_checksum"
    assert injector.fired and injector.fired[0]["step"] == 2
    assert check.stats.failures == 1 and check.stats.last_verified_step == 1


def test_a_mantissa_sized_error_and_warn_policy():
    """A wrong element 3x its value (no bit flip) in the forward is caught; ``warn`` goes on."""
    model = _mlp()
    check = MatmulChecksum(MatmulChecksumConfig(on_failure="warn"))
    check.attach(model)
    injector = FaultInjector([Fault("matmul_output", rank=0, step=1, target="0", index=5, factor=-3.0, mode="once")])
    injector.install(model, 0)
    x = torch.randn(32, 16)
    with pytest.warns(RuntimeWarning, match="matmul_checksum"):
        for step in range(3):
            injector.set_step(step)
            check.arm(step)
            model(x).sum().backward()
            check.verdict(step, now=True)
    assert check.stats.failures == 1 and check.stats.runs == 3


def test_clean_training_is_bit_identical_and_every_n_steps():
    """The check only reads: parameters after training with it equal those without, bit for bit;
    with every_n_steps=3 only steps 0, 3, ... are checked."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), nn.Linear(16, 8))
    runs = []
    for every in (None, 1, 3):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        check = MatmulChecksum(MatmulChecksumConfig(every_n_steps=every or 1))
        if every:
            check.attach(model)
        gen = torch.Generator().manual_seed(1)
        for step in range(5):
            check.arm(step)
            model(torch.randn(4, 6, 16, generator=gen)).square().mean().backward()
            check.verdict(step)
            opt.step()
            opt.zero_grad()
        check.resolve()
        check.detach()
        runs.append(([p.detach().clone() for p in model.parameters()], check.stats.runs))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[2][0], strict=True))
    assert runs[1][1] == 5 and runs[2][1] == 2


def test_attention_projections_are_covered_and_f_linear_is_restored():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "enc": nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
        "cross": nn.MultiheadAttention(32, 4, batch_first=True),
        "kdim": nn.MultiheadAttention(32, 4, kdim=16, vdim=16),
    })  # fmt: skip
    check = MatmulChecksum()
    sites = check.attach(model)
    assert F.linear is not torch._C._nn.linear  # the checking wrapper, while attached
    assert {"enc.self_attn.in_proj", "enc.self_attn.out_proj", "enc.linear1", "enc.linear2", "cross.in_proj[q]",
            "cross.in_proj[kv]", "kdim.q_proj", "kdim.k_proj", "kdim.v_proj"} <= set(sites)  # fmt: skip
    assert "enc.self_attn.out_proj" not in check.uncovered
    check.arm(0)
    x, mem = torch.randn(2, 5, 32, requires_grad=True), torch.randn(2, 7, 32, requires_grad=True)
    out = model["enc"](x).sum() + model["cross"](x, mem, mem)[0].sum()
    kv = torch.randn(7, 2, 16, requires_grad=True)
    out = out + model["kdim"](x.transpose(0, 1), kv, kv * 2)[0].sum()
    out.backward()
    worst = check.worst()
    for site in ("enc.self_attn.in_proj", "enc.self_attn.out_proj", "enc.linear1", "cross.in_proj[q]",
                 "cross.in_proj[kv]", "cross.out_proj", "kdim.k_proj", "kdim.v_proj"):  # fmt: skip
        assert {p for s, p in worst if s == site} == {"output", "input_gradient", "weight_gradient"}, site
    assert all(v <= 1 for v in worst.values())
    check.verdict(0, now=True)
    check.detach()
    assert F.linear is torch._C._nn.linear


def test_what_is_not_covered_is_listed():
    class LoRA(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), LoRA(4, 4), nn.MultiheadAttention(4, 2))
    check = MatmulChecksum(MatmulChecksumConfig(attention=False))
    assert check.attach(model) == ["0"]
    assert set(check.uncovered) == {"1", "2"}
    assert F.linear is torch._C._nn.linear  # attention off: nothing patched


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """Worst forward ratio of one ``y = F.linear(x, weight, bias)`` (0-d; > 1: wrong), as the check bounds it."""
    rnd = rounding(y.dtype, y.device.type)
    with torch.no_grad(), plain_arithmetic(y.device.type):
        lb = LinearBound.of(weight, bias, y.dtype, rnd, 2.0, 32)
        x2 = operand(x.detach(), y.dtype, rnd.acc_dtype, weight.shape[1])
        return worst_ratio(lb.forward_ratio(x2, y.detach().reshape(-1, weight.shape[0]))[0])


def test_check_linear_and_a_non_finite_result_of_finite_operands():
    x, w, b = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4)
    y = F.linear(x, w, b)
    assert float(check_linear(x, w, b, y)) <= 1
    y[3, 1] = float("inf")
    assert float(check_linear(x, w, b, y)) > 1
    y[3, 1] = float("nan")
    assert math.isnan(float(check_linear(x, w, b, y)))
    assert float(check_linear(x * float("nan"), w, b, y)) == 0  # non-finite inputs: not this product's fault


def test_fp16_overflow_is_not_judged():
    """Products that may overflow fp16 legitimately (inputs near its range) are skipped, not flagged."""
    x = torch.full((4, 64), 200.0)
    w = torch.full((8, 64), 10.0)
    with torch.autocast("cpu", dtype=torch.float16):
        y = F.linear(x, w)
    assert torch.isinf(y).all()
    assert float(check_linear(x, w, None, y)) == 0


def test_error_roundtrip_and_config_validation():
    err = ChecksumMismatchError(step=3, rank=1, suspects=[1], hosts={1: "node-b"}, module="l2", phase="backward",
                                details={"product": "weight_gradient"}, reason="r")  # fmt: skip
    for back in (SDCError.from_dict(err.to_dict()), pickle.loads(pickle.dumps(err))):
        assert isinstance(back, ChecksumMismatchError)
        assert (back.step, back.rank, back.module, back.phase, back.host) == (3, 1, "l2", "backward", "node-b")
    bad_values = ({"on_failure": "skip"}, {"every_n_steps": 0}, {"safety": 0.5}, {"attention": 1}, {"max_names": 0},
                  {"block": -1})  # fmt: skip
    for bad in bad_values:
        with pytest.raises(ValueError, match=next(iter(bad))):
            MatmulChecksumConfig(**bad)
    with pytest.raises(ValueError, match="phase"):
        Fault("matmul_output", rank=0, phase="sideways")


def test_discard_warns_about_its_own_failure_without_collectives():
    model = _mlp()
    check = MatmulChecksum()
    check.attach(model)
    injector = FaultInjector([Fault("matmul_output", rank=0, step=0, target="4", index=0, bit=30, mode="once")])
    injector.install(model, 0)
    check.arm(0)
    model(torch.randn(4, 16)).sum().backward()
    check.verdict(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert check.discard() == 0
    assert any("failed its checksum on this rank" in str(w.message) for w in seen)
    check.resolve()  # nothing pending any more


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reduced_fp32_matmul_precision_widens_the_bound_of_every_dtype(dtype: torch.dtype) -> None:
    """The check's own thin products run in fp32 whatever the product's dtype, so where the backend
    rounds fp32 operands (TF32: ``set_float32_matmul_precision("high")``, ``allow_tf32`` on CUDA) the
    bound counts that rounding for bf16 and fp16 products too, not only for fp32 ones."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert rounding(dtype, "cpu").inp == 0.0
        torch.set_float32_matmul_precision("high")
        assert rounding(dtype, "cpu").inp == 2.0**-11
        assert rounding(torch.float64, "cpu").inp == 0.0  # a float64 check is not rounded
    finally:
        torch.set_float32_matmul_precision(before)
