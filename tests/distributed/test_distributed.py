"""Single-process behaviour of train/distributed/ (the 2-process checks are in test_distributed_fsdp.py)."""

from __future__ import annotations

import pytest
import torch
from collective_counter import count_collectives
from diffusers import FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from flux_toys import tiny_flux_transformer
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from train.distributed.collectives import (
    all_gather_tensor,
    all_reduce_sum,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    init_distributed,
)
from train.distributed.parallelize import clip_grad_norm_, parallelize

BLOCKS = (FluxTransformerBlock, FluxSingleTransformerBlock)


def tiny_flux() -> FluxTransformer2DModel:
    return tiny_flux_transformer()


def flux_loss(model: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    out = model(
        hidden_states=torch.randn(2, 16, 4, generator=g),
        encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
        pooled_projections=torch.randn(2, 32, generator=g),
        timestep=torch.rand(2, generator=g),
        img_ids=torch.rand(16, 3, generator=g),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )[0]
    return out.pow(2).mean()


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_init_single_process_needs_no_process_group(no_torchrun_env: None) -> None:
    info = init_distributed()
    assert (info.rank, info.world_size, info.local_rank, info.is_main) == (0, 1, 0, True)
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert info.device == expected
    assert not torch.distributed.is_initialized()
    assert (get_rank(), get_world_size()) == (0, 1)


def test_init_rejects_incomplete_env_and_impossible_backend(
    no_torchrun_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK"):
        init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "1")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nccl"):
            init_distributed(backend="nccl")


def test_helpers_are_identities_in_one_process() -> None:
    x = torch.tensor([1.0, 2.0])
    summed = all_reduce_sum(x)
    assert torch.equal(summed, x) and summed is not x  # a new tensor, the input is untouched
    assert torch.equal(all_gather_tensor(x[None]), x[None])
    assert broadcast_object({"a": 1}) == {"a": 1}
    barrier()


def test_parallelize_one_process_checkpoints_blocks_without_changing_math() -> None:
    reference = tiny_flux()
    flux_loss(reference).backward()
    model = parallelize(tiny_flux(), block_classes=BLOCKS, param_dtype=torch.bfloat16, activation_checkpointing=True)
    assert isinstance(model.transformer_blocks[0], CheckpointWrapper)
    assert isinstance(model.single_transformer_blocks[0], CheckpointWrapper)
    assert next(model.parameters()).dtype == torch.float32  # no casting without FSDP
    # state-dict keys keep their diffusers names (the wrapper prefix is stripped)
    assert get_model_state_dict(model).keys() == reference.state_dict().keys()
    flux_loss(model).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-7)


def test_parallelize_rejects_missing_block_classes() -> None:
    with pytest.raises(ValueError, match="block_classes is empty"):
        parallelize(tiny_flux(), block_classes=(), param_dtype=torch.float32)
    with pytest.raises(ValueError, match="Linear"):
        parallelize(torch.nn.Sequential(torch.nn.ReLU()), block_classes=(torch.nn.Linear,), param_dtype=torch.float32)


def test_clip_grad_norm_matches_torch_in_one_process() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
    ours = clip_grad_norm_(a.parameters(), 0.1)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    torch.testing.assert_close(ours, theirs)
    assert ours > 0.1  # clipping was active
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    grads = [p.grad.clone() for p in a.parameters()]
    clip_grad_norm_(a.parameters(), 100.0)  # below the limit: untouched
    for p, g in zip(a.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


def test_clip_grad_norm_hand_computed() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(1))
    p.grad, q.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    norm = clip_grad_norm_([p, q], 1.0)  # sqrt(9 + 16) = 5, so every gradient is scaled by 1/5
    assert float(norm) == pytest.approx(5.0)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(q.grad, torch.tensor([0.8]), atol=1e-6, rtol=0)


def test_count_collectives_sees_none_in_one_process() -> None:
    with count_collectives() as counts:
        flux_loss(tiny_flux()).backward()
    assert (counts.num_all_gathers, counts.num_reduce_scatters, counts.num_all_reduces, counts.by_op) == (0, 0, 0, {})
