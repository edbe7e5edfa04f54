"""model.compile=true against eager on the tiny Flux pipeline (CPU, inductor).

Every test here compiles, and inductor's first compilation of the tiny blocks takes minutes on 2
cores: the module is marked slow, its runs share one process (compiled code is reused across runs
and tests: torch guards on the block classes, not on the instances) and the session's first test
pays for most of it.

Tolerance: inductor fuses and reorders the same float32 operations, as another CPU's kernels do; a
velocity or gradient element then differs from eager's by a few units of float32 rounding
(2^-23 ~ 1.2e-7) times the depth of the sums behind it. The bound is 1e-5 of the largest element
(about 100 float32 ulps at that scale): a missing term, a wrong row or a stale weight moves an element
by its own size. The trainer's metrics use the golden test's tolerances (tests/e2e/test_trainer.py,
GOLDEN_KEYS), which were measured between two CPUs' float32 kernels.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import (
    GOLDEN_KEYS,
    GOLDEN_RUN,
    MULTI_RANK,
    SMALL,
    assert_same_training,
    replayed_keys,
    smooth_reward,
    train,
)
from two_ranks import HELPERS, run_torchrun

from models.registry import load_backbone
from train.algorithm.jagg import UPDATE_MODES, backward_segment
from train.distributed.parallelize import compile_blocks, parallelize

pytestmark = [pytest.mark.slow, pytest.mark.long]  # minutes of compiling: make test-long

# the golden dance-jagg run with a KL term, evaluated before and after each step on 3 rows per call
# (the rollout runs 4, the JAGG endpoints 4 with gradients, the exact steps 2): steps feed the blocks
# several row counts
RUN = [*GOLDEN_RUN, "num_steps=3", "grpo.kl_beta=0.1", "eval.every=1", "eval.batch_size=3"]
RUN += ["eval.num_steps=3", "eval.num_prompts=3", "+eval.scorers.jpeg_compressibility={}"]


def training_rows(rows: list[dict]) -> list[dict]:
    """The training steps' rows of a metrics.jsonl (the evaluations log rows of their own)."""
    return [m for m in rows if "time/step" in m]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def runs(tiny_flux_dir, tiny_clip_dir, tmp_path_factory, monkeypatch_module):
    """The same 3-step run eager and compiled (compiled first: it pays the session's compilation)."""
    root, reward = tmp_path_factory.mktemp("compile"), smooth_reward(tiny_clip_dir)
    compiled = training_rows(train(root / "compiled", tiny_flux_dir, [*reward, *RUN, "model.compile=true"]))
    eager = training_rows(train(root / "eager", tiny_flux_dir, [*reward, *RUN]))
    return {"compiled": compiled, "eager": eager, "root": root}


@pytest.fixture(scope="module")
def monkeypatch_module():
    from test_trainer import ROOT

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)  # the demo's prompt file is relative to the repository root
        yield patch


def test_compiled_run_has_eager_metrics_and_stops_compiling(runs):
    compiled, eager = runs["compiled"], runs["eager"]
    assert [m["step"] for m in compiled] == [0, 1, 2]
    for a, b in zip(eager, compiled):
        for key, (rtol, atol) in GOLDEN_KEYS.items():
            assert b[key] == pytest.approx(a[key], rel=rtol, abs=atol), (a["step"], key)
        assert b["flops/step"] == a["flops/step"]  # counted on the eager model either way
    counts = [m["count/compilations"] for m in compiled]
    assert counts[0] > 0 and counts[1:] == counts[:1] * 2  # after the first step nothing compiles
    assert compiled[0]["time/compile"] > 0 and compiled[1]["time/compile"] == 0
    assert "count/compilations" not in eager[0]


def test_resume_with_compile_replays_exactly(runs, tiny_flux_dir, tiny_clip_dir):
    """A compiled run stopped after step 1 and resumed logs what the uninterrupted compiled run logged."""
    root, reward = runs["root"], smooth_reward(tiny_clip_dir)
    common = [*reward, *RUN, "model.compile=true", "checkpoint.every=1"]
    train(root / "resumed", tiny_flux_dir, [*common, "num_steps=1"])
    resumed = training_rows(train(root / "resumed", tiny_flux_dir, [*common, "resume=auto"]))
    assert [m["step"] for m in resumed] == [0, 1, 2]
    for a, b in zip(runs["compiled"], resumed):
        keys = replayed_keys(a) - {"time/compile"}
        assert keys == replayed_keys(b) - {"time/compile"}
        for key in sorted(keys):
            assert a[key] == b[key], (a["step"], key)


@pytest.fixture(scope="module")
def backbones(tiny_flux_dir):
    eager = load_backbone("flux", tiny_flux_dir, dtype="float32", device="cpu")
    eager.transformer.requires_grad_(True).train()
    compiled = eager.with_parts(transformer=copy.deepcopy(eager.transformer), vae=copy.deepcopy(eager.vae))
    parallelize(compiled.transformer, block_classes=compiled.block_classes, param_dtype=torch.float32, compile=True)
    compile_blocks(compiled.decoder_units())
    return eager, compiled


def test_compiled_decoder_matches_eager(backbones):
    """The VAE decode of 4 latents, then 3 (the dynamic-batch graph), as eager's within rounding."""
    eager, compiled = backbones
    z = eager.initial_noise(4, height=32, width=32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for rows in (4, 3):
            assert relative_error(compiled.decode(z[:rows]), eager.decode(z[:rows])) < 1e-5, rows
    assert compiled.vae.decoder._compiled_call_impl is not None and eager.vae.decoder._compiled_call_impl is None


def test_compiled_velocities_and_every_update_path_match_eager(backbones):
    eager, compiled = backbones
    cond = eager.encode(["a red circle", "a blue square"]).repeat(2)  # 4 rows, as the runs' rollout
    gen = torch.Generator().manual_seed(0)
    z = [eager.initial_noise(4, height=32, width=32, generator=gen) for _ in range(4)]
    t = torch.tensor([0.9, 0.7, 0.5, 0.3])
    target = [torch.randn(z[0].shape, generator=gen) for _ in range(4)]
    with torch.no_grad():
        for rows in (4, 3):
            v_eager = eager.predict(z[0][:rows], t[:1].expand(rows), cond.index(range(rows)))
            v_compiled = compiled.predict(z[0][:rows], t[:1].expand(rows), cond.index(range(rows)))
            assert relative_error(v_compiled, v_eager) < 1e-5, rows
    for mode in UPDATE_MODES:
        grads = []
        for backbone in (eager, compiled):
            backbone.transformer.zero_grad(set_to_none=True)

            def predict(zz, tt, backbone=backbone):  # JAGG's batched endpoints: 8 rows, the 4 prompts twice
                return backbone.predict(zz, tt, cond.index([i % 4 for i in range(zz.shape[0])]))

            def step_loss(j, v):
                return ((v - target[j]) ** 2).mean(), {}

            backward_segment(mode, predict, step_loss, z, t)
            grads.append({n: p.grad.clone() for n, p in backbone.transformer.named_parameters()})
        for name, g_eager in grads[0].items():
            g_compiled = grads[1][name.replace("._checkpoint_wrapped_module", "")]
            assert relative_error(g_compiled, g_eager) < 1e-5, (mode, name)
    blocks = [m for m in compiled.transformer.modules() if isinstance(m, compiled.block_classes)]
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)


def test_two_compiled_ranks_train_as_one_eager_process(tiny_flux_dir, tiny_clip_dir, tmp_path):
    """2 gloo ranks x 1 prompt with compiled blocks under FSDP2 against 1 eager process x 2 prompts, two
    steps of full fine-tuning with KL (the frozen reference compiled too): every logged value and the
    exported weights agree within the multi-rank test's tolerances (test_trainer.assert_same_training),
    which hold the compiled blocks' rounding (above) as well as the ranks' reduction order."""
    name, reward = "full-jagg-flow", smooth_reward(tiny_clip_dir)
    common = [*MULTI_RANK[name], "num_steps=2", "grpo.kl_beta=0.1", *reward]
    two = [f"model.path={tiny_flux_dir}", *SMALL, *common, "model.compile=true", f"run_dir={tmp_path / 'two'}"]
    (tmp_path / "cases.json").write_text(json.dumps({name: two}))
    result = run_torchrun(str(HELPERS / "trainer_worker.py"), str(tmp_path / "cases.json"), timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    compiled = training_rows([json.loads(line) for line in rows])
    assert all(m["count/compilations"] > 0 for m in compiled)  # the ranks did run compiled blocks
    one = ["batch.prompts_per_rank=2", "batch.gradient_accumulation_steps=8"]
    train(tmp_path / "one", tiny_flux_dir, [*common, *one])
    base = load_file(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert_same_training(tmp_path / "one", tmp_path / "two", base, name)
