"""FLOPs, TFLOP/s and MFU (train/parts/observe/perf.py), and the compilation watch."""

from __future__ import annotations

import pytest
import torch

from models.registry import load_backbone
from train.distributed.parallelize import CompileStats, compile_unavailable
from train.parts.observe import perf
from train.parts.observe.observe_config import PerfConfig
from train.parts.observe.perf import CompileWatch, FlopMeter, Peak, PhaseTimer, device_peak, perf_metrics


@pytest.fixture(scope="module")
def flux(tiny_flux_dir):
    backbone = load_backbone("flux", tiny_flux_dir, dtype="float32", device="cpu")
    backbone.transformer.requires_grad_(True)
    cond = backbone.encode(["a red circle", "a blue square", "two shapes"])
    z = backbone.initial_noise(3, height=32, width=32, generator=torch.Generator().manual_seed(0))
    return backbone, z, torch.full((3,), 0.5), cond


def test_flops_are_linear_in_rows_and_a_backward_adds_about_twice(flux):
    """The meter counts one row and multiplies: exact, since every matmul and attention of the
    transformer is computed per row (measured here on 1 and 3 rows). A call with gradients adds the
    backward: about twice the forward's matmuls (the weights' and the activations' gradients), less
    the input gradient of the first layer (z needs none)."""
    backbone, z, t, cond = flux
    meter = FlopMeter(backbone)
    one = cond.index([0])
    for grad in (False, True):
        assert meter.measure(z, t, cond, grad=grad) == 3 * meter.measure(z[:1], t[:1], one, grad=grad)
    forward, both = meter.measure(z, t, cond, grad=False), meter.measure(z, t, cond, grad=True)
    assert 2.5 * forward < both <= 3 * forward


def test_each_row_shape_is_measured_once(flux, monkeypatch):
    backbone, z, t, cond = flux
    meter = FlopMeter(backbone)
    perf._ROW_FLOPS.clear()
    calls = []
    measure = meter.measure
    monkeypatch.setattr(meter, "measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    with torch.no_grad():
        meter.count(z, t, cond)
        meter.count(z[:2], t[:2], cond.index([0, 1]))
    per_row = meter.total // 5
    assert len(calls) == 1 and meter.total == 5 * per_row
    with torch.enable_grad():
        meter.count(z, t, cond)
    assert len(calls) == 2 and meter.total > 8 * per_row  # a new key: with gradients
    assert all(p.grad is None for p in backbone.transformer.parameters())  # the twin's backward touches nothing real


def test_the_timer_gives_each_phase_its_flops():
    class Counted:
        total = 0

    meter = Counted()
    timer = PhaseTimer("cpu", meter)  # type: ignore[arg-type]  # anything with a running total
    with timer.phase("step"):
        with timer.phase("rollout"):
            meter.total += 10
        with timer.phase("update"):
            meter.total += 30
        with timer.phase("reward"):
            pass
    out = timer.pop()
    assert (out["flops/rollout"], out["flops/update"], out["flops/step"]) == (10, 30, 40)
    assert "flops/reward" not in out and "time/reward" in out


def test_perf_metrics_divide_flops_by_time_and_peak():
    metrics = {"time/update": 2.0, "flops/update": 4e12, "time/reward": 1.0, "flops/rollout": 1e12}
    out = perf_metrics(metrics, Peak(4.0, "perf.peak_tflops"))
    assert out == {"perf/tflops/update": 2.0, "perf/mfu/update": 0.5}  # rollout has no time: nothing
    assert perf_metrics(metrics, Peak(None, "unknown")) == {"perf/tflops/update": 2.0}


def test_peak_from_the_setting_the_gpu_table_or_a_cpu_measurement(monkeypatch):
    assert device_peak(PerfConfig(peak_tflops=123.0), torch.device("cpu")) == Peak(123.0, "perf.peak_tflops")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert device_peak(PerfConfig(), torch.device("cuda")) == Peak(989.0, "H100 bf16 dense")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA T4")
    assert device_peak(PerfConfig(), torch.device("cuda")).tflops is None
    cpu = device_peak(PerfConfig(), torch.device("cpu"))
    assert cpu.source == "measured float32 matmul" and 1e-4 < cpu.tflops < 1e3


def test_compile_watch_warns_once_when_compiling_goes_on(monkeypatch):
    graphs = iter([0, 5, 5, 5, 5, 5, 5, 6, 6, 7])  # (begin, end) per step: step 0 compiles 5, steps 3 and 4 one each
    monkeypatch.setattr(perf, "compile_stats", lambda: CompileStats(graphs=next(graphs), seconds=0.0))
    warnings: list[str] = []
    monkeypatch.setattr(perf.log, "warning", lambda message, *args: warnings.append(message % args))
    watch = CompileWatch(settle_steps=3)
    counts = []
    for step in range(5):
        watch.begin()
        counts.append(watch.end(step)["count/compilations"])
    assert counts == [5, 5, 5, 6, 7]
    assert len(warnings) == 1 and "model.compile: step 3 compiled 1 more graph" in warnings[0]


def test_no_cpp_compiler_is_named():
    from torch._inductor import config

    # config.patch, not monkeypatch: a setattr undone on inductor's config leaves cpp.cxx hidden for later readers
    with config.patch({"cpp.cxx": (None, "no-such-compiler++")}):
        why = compile_unavailable("cpu")
    assert why is not None and "C++ compiler" in why and "no-such-compiler++" in why
