"""Backbone adapters on tiny offline pipelines: parity with diffusers' own pipelines, loading
errors, prompt truncation, conditioning batching, registry and tiny builder."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file
from torch import nn

from models import backbone_names, load_backbone, register_backbone
from models.flux import FluxBackbone
from models.qwenimage import QwenImageConditioning
from models.registry import get_backbone_class
from models.tiny import build_tiny
from samplers.rollout import rollout
from samplers.sampler_config import SamplerConfig
from samplers.schedule import shifted_sigmas

PROMPTS = ["a photo of a cat", "a red dog with a blue hat on the grass"]


@pytest.fixture(scope="module")
def folders(tiny_dir):
    return {name: tiny_dir(name) for name in backbone_names()}


@pytest.mark.parametrize("name", backbone_names())
def test_ode_rollout_and_decode_match_the_diffusers_pipeline(name, folders, backbones):
    """Same prompts, seed, steps and scheduler: our ODE rollout is the pipeline's Euler loop, so
    final latents and images agree to float32 rounding (noise, sigmas, conditioning, packing,
    timestep convention and VAE scaling all have to match for this)."""
    backbone = backbones[name]
    pipe = DiffusionPipeline.from_pretrained(folders[name])  # the class named in the folder's model_index.json
    pipe.set_progress_bar_config(disable=True)
    kwargs = {"max_sequence_length": backbone.max_sequence_length, "num_inference_steps": 4, "height": 32, "width": 32}
    if name == "qwenimage":  # the pipeline hard-codes the released tokenizer's prefix length (34)
        pipe.prompt_template_encode_start_idx = backbone.template_drop
        kwargs["true_cfg_scale"] = 1.0
    expected = {
        kind: pipe(PROMPTS, generator=torch.Generator().manual_seed(0), output_type=kind, **kwargs)[0]
        for kind in ("latent", "pt")
    }
    noise = backbone.initial_noise(len(PROMPTS), height=32, width=32, generator=torch.Generator().manual_seed(0))
    sigmas = backbone.sigmas(4, height=32, width=32)
    traj = rollout(backbone.predict, backbone.encode(PROMPTS), noise, SamplerConfig(sde="ode"), sigmas=sigmas)
    final = traj.latents[:, -1]
    torch.testing.assert_close(final.flatten(1, 2), expected["latent"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(backbone.decode(final, height=32, width=32), expected["pt"], rtol=1e-5, atol=1e-5)
    assert not torch.equal(final, noise)  # the transformer did move the latents


def test_fixed_shift_schedule_is_the_dance_schedule(backbones):
    torch.testing.assert_close(backbones["flux"].sigmas(6, height=32, width=32, shift=3.0), shifted_sigmas(6, 3.0))


@pytest.mark.parametrize("name", backbone_names())
def test_shapes_dtypes_and_bfloat16_compute(name, folders):
    backbone = load_backbone(name, folders[name], dtype="bfloat16")
    noise = backbone.initial_noise(3, height=32, width=48, generator=torch.Generator().manual_seed(0))
    assert noise.shape == (3, 8, 12, 16) and noise.dtype == torch.float32  # vae factor 2, 2x2 packing, 4 channels
    cond = backbone.encode(PROMPTS[:1]).repeat(3)
    v = backbone.predict(noise, torch.full((3,), 0.5), cond)
    assert v.shape == noise.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    images = backbone.decode(noise)
    assert images.shape == (3, 3, 32, 48) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    with pytest.raises(ValueError, match="decode to 32x48"):
        backbone.decode(noise, height=32, width=32)
    with pytest.raises(ValueError, match="multiples of 4"):
        backbone.initial_noise(1, height=30, width=32)


@pytest.mark.parametrize("name", backbone_names())
def test_the_image_multiple_read_from_the_configs_is_what_the_loaded_backbone_samples(name, folders, backbones):
    """image_multiple reads the VAE's config.json alone; the loaded backbone's smallest image is that size."""
    multiple = get_backbone_class(name).image_multiple(folders[name])
    backbone = backbones[name]
    noise = backbone.initial_noise(1, height=multiple, width=2 * multiple)
    assert noise.shape[1:3] == (1, 2) and backbone.decode(noise).shape[-2:] == (multiple, 2 * multiple)
    with pytest.raises(ValueError, match=rf"multiples of {multiple} \(the VAE's {multiple // 2} pixels"):
        backbone.initial_noise(1, height=multiple + 1, width=multiple)


@pytest.mark.parametrize("name", backbone_names())
def test_the_transformer_skeleton_read_from_the_config_is_the_loaded_one(name, folders, backbones):
    """Built on the meta device from config.json: the names LoRA's targets are checked against at start-up."""
    skeleton = get_backbone_class(name).transformer_skeleton(folders[name])
    assert [n for n, _ in skeleton.named_modules()] == [n for n, _ in backbones[name].transformer.named_modules()]
    shapes = {n: p.shape for n, p in backbones[name].transformer.named_parameters()}
    assert {n: p.shape for n, p in skeleton.named_parameters()} == shapes


def test_qwenimage_padding_does_not_change_a_prompt(backbones):
    """A prompt batched with a longer one is zero-padded and masked: its velocity is unchanged."""
    backbone = backbones["qwenimage"]
    alone, both = backbone.encode(PROMPTS[:1]), backbone.encode(PROMPTS)
    assert alone.prompt_embeds.shape[1] < both.prompt_embeds.shape[1]
    assert alone.mask.all() and not both.mask[0].all()
    z = backbone.initial_noise(1, height=32, width=32, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.7])
    v_alone = backbone.predict(z, t, alone)
    v_padded = backbone.predict(z.expand(2, -1, -1, -1), t.expand(2), both)[:1]
    torch.testing.assert_close(v_padded, v_alone, rtol=1e-5, atol=1e-5)


def test_conditioning_repeat_index_cat():
    a = QwenImageConditioning(torch.arange(2 * 2 * 3.0).view(2, 2, 3), torch.ones(2, 2, dtype=torch.long))
    b = QwenImageConditioning(torch.ones(1, 4, 3), torch.tensor([[1, 1, 1, 0]]))
    both = QwenImageConditioning.cat([a, b])
    assert both.prompt_embeds.shape == (3, 4, 3) and both.mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert both.prompt_embeds[:2, 2:].abs().sum() == 0  # padding is zero
    assert both.trim().mask.shape == (3, 3)
    rep = a.repeat(2)
    torch.testing.assert_close(rep.prompt_embeds[1], a.prompt_embeds[0])  # repeat_interleave order
    torch.testing.assert_close(rep.prompt_embeds[2], a.prompt_embeds[1])
    torch.testing.assert_close(both.index([2, 0]).prompt_embeds[1], both.prompt_embeds[0])
    half = both.to(dtype=torch.float16)
    assert half.prompt_embeds.dtype == torch.float16 and half.mask.dtype == torch.long


def test_long_prompts_are_truncated_with_a_warning(backbones, folders):
    long_prompt = " ".join(["a red dog"] * 60)  # > 77 CLIP tokens and > 32 T5 tokens
    with pytest.warns(UserWarning) as caught:
        cond = backbones["flux"].encode([long_prompt, "a cat"])
    messages = [str(w.message) for w in caught]
    assert any("CLIP" in m and "truncated to 77" in m for m in messages)
    assert any("T5" in m and "truncated to 32" in m for m in messages)
    assert cond.prompt_embeds.shape[:2] == (2, 32) and cond.pooled.shape == (2, 32)
    qwen = load_backbone("qwenimage", folders["qwenimage"], dtype="float32", max_sequence_length=16)
    with pytest.warns(UserWarning, match="truncated"):
        cond = qwen.encode([long_prompt])
    assert cond.prompt_embeds.shape[1] == 16


def _copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


def test_missing_component_names_component_and_path(folders, tmp_path):
    copy = _copy(folders["flux"], tmp_path)
    (copy / "text_encoder_2" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"'text_encoder_2'.*" + str(copy / "text_encoder_2")):
        load_backbone("flux", copy, dtype="float32")
    with pytest.raises(ValueError, match="no folder for component 'transformer'"):
        load_backbone("flux", None, dtype="float32")


def test_mismatched_component_class_names_component_and_path(folders, tmp_path):
    with pytest.raises(ValueError, match=r"'vae' at .*qwenimage/vae is a AutoencoderKLQwenImage"):
        load_backbone("flux", folders["flux"], dtype="float32", vae=folders["qwenimage"] / "vae")


# (backbone/component, a key of its config.json and another value, the error): components of mismatched sizes
# name both; weights that do not fit their config name the component
CHANGED_CONFIGS = [
    ("flux/text_encoder_2", "d_model", 48, r"T5 width.*'transformer' at .* has 32, 'text_encoder_2' at .* has 48"),
    ("qwenimage/transformer", "num_attention_heads", 4, r"could not load component 'transformer' from .*transformer"),
]


@pytest.mark.parametrize("component, key, value, match", CHANGED_CONFIGS)
def test_a_changed_component_config_names_the_component(component, key, value, match, folders, tmp_path):
    name, folder = component.split("/")
    config_path = _copy(folders[name], tmp_path) / folder / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), key: value}))
    with pytest.raises(ValueError, match=match):
        load_backbone(name, config_path.parents[1], dtype="float32")


def test_component_override_and_option_validation(folders, tmp_path):
    vae_copy = shutil.copytree(folders["flux"] / "vae", tmp_path / "my_vae")
    backbone = load_backbone("flux", folders["flux"], dtype="float32", vae=vae_copy, guidance=2.0)
    assert backbone.folders["vae"] == vae_copy and backbone.guidance == 2.0
    with pytest.raises(ValueError, match=r"unknown model option\(s\) \['guidanse'\].*guidance"):
        load_backbone("flux", folders["flux"], dtype="float32", guidanse=2.0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_backbone("flux", folders["flux"], dtype="float8")


def test_registry(folders):
    assert {"flux", "qwenimage"} <= set(backbone_names())
    with pytest.raises(ValueError, match="name must be one of"):
        load_backbone("sd3", folders["flux"])
    with pytest.raises(ValueError, match="registered twice"):
        register_backbone("flux")(type("OtherFlux", (FluxBackbone,), {}))


@pytest.mark.parametrize("name", backbone_names())
def test_block_classes_and_lora_targets_exist(name, backbones):
    transformer = backbones[name].transformer
    classes = {type(m) for m in transformer.modules()}
    assert set(backbones[name].block_classes) <= classes
    linear_names = [n for n, m in transformer.named_modules() if isinstance(m, nn.Linear)]
    for target in backbones[name].lora_target_modules:
        assert any(n.endswith("." + target) for n in linear_names), target


def test_tiny_build_is_deterministic_and_cached(tiny_flux_dir, tmp_path):
    again = build_tiny("flux", tmp_path / "again")
    weights = "transformer/diffusion_pytorch_model.safetensors"
    first, second = load_file(tiny_flux_dir / weights), load_file(again / weights)
    assert all(torch.equal(first[k], second[k]) for k in first)
    stamp = (again / weights).stat().st_mtime_ns
    assert build_tiny("flux", again) == again and (again / weights).stat().st_mtime_ns == stamp  # reused
    other = load_file(build_tiny("flux", tmp_path / "seed1", seed=1) / weights)
    assert not all(torch.equal(first[k], other[k]) for k in first)
    with pytest.raises(ValueError, match="another tiny build"):
        build_tiny("flux", again, seed=1)
    with pytest.raises(ValueError, match="size must be one of"):
        build_tiny("flux", tmp_path / "x", size="huge")
