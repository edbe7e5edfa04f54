"""Single-process checkpoints (round trip, keep_last, atomicity, resume resolution) and exports
reloaded with from_pretrained / load_lora_adapter / PeftModel.from_pretrained (the sharded round
trip and export run in test_distributed_fsdp.py)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from flux_toys import tiny_flux_transformer as tiny_flux
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

import train.parts.checkpoint.manager as checkpoint
from train.distributed.parallelize import parallelize
from train.ground.errors import CheckpointError
from train.parts.checkpoint.checkpoint_config import CheckpointConfig
from train.parts.checkpoint.export import export_model
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.optim.ema import EMA


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    out = model(
        hidden_states=torch.randn(2, 16, 4),
        encoder_hidden_states=torch.randn(2, 8, 32),
        pooled_projections=torch.randn(2, 32),
        timestep=torch.rand(2),
        img_ids=torch.rand(16, 3),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )[0]
    optimizer.zero_grad()
    out.pow(2).mean().backward()
    optimizer.step()


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


@pytest.fixture
def trained() -> tuple[FluxTransformer2DModel, torch.optim.Optimizer, EMA]:
    model = tiny_flux()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer)
    ema = EMA(model.parameters(), decay=0.9)
    ema.update()
    return model, optimizer, ema


def test_round_trip_restores_model_optimizer_ema_rng_and_extra(tmp_path, trained) -> None:
    model, optimizer, ema = trained
    manager = CheckpointManager(tmp_path)
    extra = {"ema": ema.state_dict(), "step": 5, "data": {"epoch": 1, "index": 3}, "table": torch.arange(3)}
    path = manager.save(5, model=model, optimizer=optimizer, extra=extra)
    after_save = (torch.rand(4), np.random.rand(2), random.random())
    weights, adam, shadow = snapshot(model), optimizer.state_dict(), [s.clone() for s in ema.shadow]

    train_step(model, optimizer)  # move everything away from the saved state
    ema.update()
    assert not torch.equal(model.proj_out.weight, weights["proj_out.weight"])

    loaded = manager.load(path, model=model, optimizer=optimizer)
    torch.testing.assert_close(torch.rand(4), after_save[0], rtol=0, atol=0)  # RNG states restored
    np.testing.assert_array_equal(np.random.rand(2), after_save[1])
    assert random.random() == after_save[2]
    assert_same(snapshot(model), weights)
    for state, saved in zip(optimizer.state_dict()["state"].values(), adam["state"].values(), strict=True):
        assert_same(state, saved)
    ema.load_state_dict(loaded["ema"])
    for s, saved in zip(ema.shadow, shadow, strict=True):
        torch.testing.assert_close(s, saved, rtol=0, atol=0)
    assert loaded["step"] == 5 and loaded["data"] == {"epoch": 1, "index": 3}
    assert torch.equal(loaded["table"], torch.arange(3))


def test_keep_last_and_latest(tmp_path, trained) -> None:
    model, optimizer, _ = trained
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=2))
    assert manager.latest() is None
    for step in (10, 20, 30):
        manager.save(step, model=model, optimizer=optimizer, extra={"step": step})
    assert [p.name for p in manager.complete()] == ["step_00000020", "step_00000030"]
    assert manager.latest() == tmp_path / "checkpoints" / "step_00000030"
    marker = json.loads((manager.latest() / "COMPLETE").read_text())
    assert (marker["step"], marker["world_size"], marker["settings"]) == (30, 1, None)
    # every other file of the folder, with its size and SHA-256
    files = {p.name: p.stat().st_size for p in manager.latest().iterdir() if p.name != "COMPLETE"}
    assert {name: info["size"] for name, info in marker["files"].items()} == files
    assert all(len(info["sha256"]) == 64 for info in marker["files"].values())
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig(keep_last=0)


def test_crash_mid_save_leaves_previous_checkpoint_usable(tmp_path, trained, monkeypatch) -> None:
    model, optimizer, _ = trained
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, model=model, optimizer=optimizer, extra={"step": 1})
    weights = snapshot(model)
    real_save = checkpoint.dcp.save

    def crash_after_writing(state, **kwargs):
        real_save(state, **kwargs)  # the shard files are on disk ...
        raise RuntimeError("node lost")  # ... and the process dies before the rename

    train_step(model, optimizer)
    monkeypatch.setattr(checkpoint.dcp, "save", crash_after_writing)
    with pytest.raises(RuntimeError, match="node lost"):
        manager.save(2, model=model, optimizer=optimizer, extra={"step": 2})
    monkeypatch.undo()
    leftover = tmp_path / "checkpoints" / "step_00000002.tmp"
    assert (leftover / ".metadata").is_file()
    (tmp_path / "checkpoints" / "step_00000003").mkdir()  # a folder without COMPLETE is not a checkpoint
    assert manager.latest() == good
    assert manager.usable("auto")[0] == good
    assert manager.load(good, model=model, optimizer=optimizer)["step"] == 1
    assert_same(snapshot(model), weights)
    manager.save(4, model=model, optimizer=optimizer, extra={"step": 4})
    assert not leftover.exists()  # the next save cleans interrupted ones
    assert manager.latest().name == "step_00000004"


def test_a_save_whose_folder_was_taken_over_replaces_and_prunes_nothing(tmp_path, trained) -> None:
    """The folder became another run's during the save (a holder suspended mid-save): ``check_owner`` raises
    before the save replaces the checkpoint of its step or prunes an older one."""
    model, optimizer, _ = trained
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=1))
    first, second = (manager.save(step, model=model, optimizer=optimizer, extra={"step": step}) for step in (1, 2))
    assert not first.exists()
    before = {p.name: p.read_bytes() for p in second.iterdir()}

    def taken_over() -> None:
        raise RuntimeError("the folder is another run's")

    for step in (2, 3):
        with pytest.raises(RuntimeError, match="another run's"):
            manager.save(step, model=model, optimizer=optimizer, extra={"step": step}, check_owner=taken_over)
    assert [p.name for p in manager.complete()] == ["step_00000002"]
    assert {p.name: p.read_bytes() for p in second.iterdir()} == before


def test_usable_checkpoints_of_resume(tmp_path, trained) -> None:
    model, optimizer, _ = trained
    manager = CheckpointManager(tmp_path)
    assert manager.usable(None) == [] and manager.usable("") == []
    assert manager.usable("auto") == []  # nothing to resume from yet
    path = manager.save(3, model=model, optimizer=optimizer, extra={})
    assert manager.usable("auto") == [path]
    assert manager.usable(str(path)) == [path]
    with pytest.raises(CheckpointError, match="nowhere: it is not a folder"):
        manager.usable(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="nowhere was deleted after this command found it"):
        manager.load(tmp_path / "nowhere", model=model, optimizer=optimizer)


def test_model_only_checkpoint(tmp_path, trained) -> None:
    model, _, _ = trained
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, model=model, optimizer=None, extra={"note": "eval"})
    weights = snapshot(model)
    with torch.no_grad():
        model.proj_out.weight.zero_()
    assert manager.load(path, model=model, optimizer=None) == {"note": "eval"}
    assert_same(snapshot(model), weights)


def test_export_full_model_reloads_with_from_pretrained(tmp_path, trained) -> None:
    model, _, _ = trained
    out = export_model(model, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["_class_name"] == "FluxTransformer2DModel"
    assert_same(snapshot(FluxTransformer2DModel.from_pretrained(out)), snapshot(model))


def test_export_checkpointed_model_keeps_diffusers_names(tmp_path, trained) -> None:
    model, _, _ = trained
    weights = snapshot(model)
    blocks = (FluxTransformerBlock, FluxSingleTransformerBlock)
    parallelize(model, block_classes=blocks, param_dtype=torch.float32, activation_checkpointing=True)
    out = export_model(model, tmp_path / "export", dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(out / "diffusion_pytorch_model.safetensors").values()} == {torch.bfloat16}
    reloaded = FluxTransformer2DModel.from_pretrained(out, torch_dtype=torch.bfloat16)
    assert_same(snapshot(reloaded), {k: v.to(torch.bfloat16) for k, v in weights.items()})


def lora_config() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights="gaussian")


def lora_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters() if "lora_" in k}


def test_export_diffusers_lora_adapter(tmp_path) -> None:
    model = tiny_flux()
    model.add_adapter(lora_config())
    trained_lora = lora_weights(model)
    out = export_model(model, tmp_path / "lora")
    tensors = load_file(out / "pytorch_lora_weights.safetensors")
    assert tensors and all(k.startswith("transformer.") and "lora_" in k for k in tensors)
    fresh = tiny_flux()
    fresh.load_lora_adapter(str(out), prefix="transformer", adapter_name="default", use_safetensors=True)
    assert_same(lora_weights(fresh), trained_lora)
    assert fresh.peft_config["default"].lora_alpha == 8  # read from the metadata (inferred, it would be r = 4)


def test_export_peft_model_adapter(tmp_path) -> None:
    model = get_peft_model(tiny_flux(), lora_config())
    trained_lora = lora_weights(model)
    out = export_model(model, tmp_path / "peft")
    assert (out / "adapter_config.json").is_file()
    reloaded = PeftModel.from_pretrained(tiny_flux(), out)
    assert_same(lora_weights(reloaded), trained_lora)


def test_export_rejects_plain_modules(tmp_path) -> None:
    with pytest.raises(ValueError, match="ModelMixin"):
        export_model(torch.nn.Linear(2, 2), tmp_path)


def test_load_with_other_world_size_keeps_state_but_not_rng(tmp_path, trained) -> None:
    model, optimizer, _ = trained
    manager = CheckpointManager(tmp_path)
    path = manager.save(2, model=model, optimizer=optimizer, extra={"step": 2})
    marker = path / "COMPLETE"
    marker.write_text(json.dumps({"step": 2, "world_size": 4}))  # as if saved by 4 ranks
    weights = snapshot(model)
    train_step(model, optimizer)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with pytest.warns(RuntimeWarning, match="world size 4"):
        assert manager.load(path, model=model, optimizer=optimizer) == {"step": 2}
    assert_same(snapshot(model), weights)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)  # RNG left as it was


def test_a_resume_may_change_the_settings_that_keep_the_same_numbers() -> None:
    """reward.chunk_groups, like batch.micro_batch, changes only the batch shapes of the same computation: a
    checkpoint does not record it, so a resume with another value compares equal, and allow_changed need not name
    it; reward.combine, which changes the rewards, is recorded and compared."""
    from train.parts.checkpoint.settings import changed_keys, not_allowable, recorded_settings
    from train.parts.config.schema import TrainConfig

    saved = recorded_settings(TrainConfig(), prompts="digest")
    chunked, micro = TrainConfig(), TrainConfig()
    chunked.reward.chunk_groups, micro.batch.micro_batch = 2, 1
    assert "reward.chunk_groups" not in saved and "reward.combine" in saved
    for now in (chunked, micro):
        assert changed_keys(saved, recorded_settings(now, prompts="digest"), []) == []
    assert "may change on resume without it" in str(not_allowable("reward.chunk_groups", saved))
    chunked.reward.combine = "advantage"  # type: ignore[assignment]
    assert changed_keys(saved, recorded_settings(chunked, prompts="digest"), []) == ["reward.combine"]


def test_a_resume_refuses_other_inner_epochs_unless_allowed() -> None:
    """grpo.inner_epochs changes what a step computes (its passes over the rollout): recorded, compared, and
    allowed only by name."""
    from train.parts.checkpoint.settings import changed_keys, not_allowable, recorded_settings
    from train.parts.config.schema import TrainConfig

    saved = recorded_settings(TrainConfig(), prompts="digest")
    now = TrainConfig()
    now.grpo.inner_epochs = 2
    assert saved["grpo.inner_epochs"] == 1
    assert changed_keys(saved, recorded_settings(now, prompts="digest"), []) == ["grpo.inner_epochs"]
    assert changed_keys(saved, recorded_settings(now, prompts="digest"), ["grpo.inner_epochs"]) == []
    assert not_allowable("grpo.inner_epochs", saved) is None


def test_a_resume_compares_the_reward_components_argument_by_argument() -> None:
    """Each argument of a scorer is its own key (an argument given on one side only against "(not set)", a scorer
    added as one key), so that allow_changed may name one; a judge's address, deadline and concurrency are noted."""
    from train.parts.checkpoint.settings import NOTED_SETTINGS, changed_keys, covered, recorded_settings
    from train.parts.config.schema import TrainConfig

    before, after = TrainConfig(), TrainConfig()
    before.reward.components = {"judge": {"base_url": "http://a/v1", "model": "m", "timeout_s": 5}}
    after.reward.components = {
        "judge": {"base_url": "http://b/v1", "model": "n", "seed": 1},
        "jpeg_compressibility": {},
    }
    saved, now = recorded_settings(before, prompts="d"), recorded_settings(after, prompts="d")
    keys = ["reward.components.jpeg_compressibility"] + [
        f"reward.components.judge.{name}" for name in ("base_url", "model", "seed", "timeout_s")
    ]
    assert changed_keys(saved, now, []) == keys
    assert changed_keys(saved, now, ["reward.components.judge.model", "reward.components.jpeg_compressibility"]) == [
        keys[1],
        keys[3],
        keys[4],
    ]
    assert [key for key in keys if covered(key, NOTED_SETTINGS)] == [keys[1], keys[4]]


def test_a_write_past_the_file_size_limit_names_the_limit(tmp_path) -> None:
    """``ulimit -f``: Python ignores SIGXFSZ, so the write fails with EFBIG, which names the limit and its fix,
    not "make it writable"."""
    import errno

    from train.ground.disk import write_failure

    failed = write_failure(OSError(errno.EFBIG, "File too large"), tmp_path, "the checkpoint of step 2")
    assert failed is not None
    assert "refused a file past this process's file-size limit while the checkpoint of step 2" in str(failed)
    assert "ulimit -f unlimited" in str(failed) and "writable" not in str(failed)
