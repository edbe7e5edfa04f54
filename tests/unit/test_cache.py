"""The prompt-embedding cache: the precompute script's output reproduces on-the-fly encoding,
and training loads without text encoders."""

from __future__ import annotations

import json

import pytest
import torch

from models import backbone_names, load_backbone
from models.cache import EmbeddingCache
from models.flux import FluxBackbone, FluxConditioning
from scripts.precompute_embeddings import main as precompute

PROMPTS = ["a photo of a cat", "a red dog with a blue hat on the grass", "a bowl of fruit", "a photo of a cat"]


@pytest.fixture(scope="module")
def caches(tiny_dir, tmp_path_factory):
    """name -> (pipeline folder, cache folder) with the cache written by the script."""
    root = tmp_path_factory.mktemp("caches")
    prompt_file = root / "prompts.txt"
    prompt_file.write_text("\n".join(PROMPTS) + "\n")
    out = {}
    for name in backbone_names():
        folder = tiny_dir(name)
        cache = root / name
        args = ["--model", name, "--path", str(folder), "--prompts", str(prompt_file), "--out", str(cache)]
        assert (
            precompute([*args, "--dtype", "float32", "--device", "cpu", "--batch-size", "2", "--rows-per-shard", "2"])
            == 0
        )
        out[name] = (folder, cache)
    return out


@pytest.mark.parametrize("name", backbone_names())
def test_cache_reproduces_on_the_fly_encoding(name, caches):
    folder, cache = caches[name]
    assert len(list(cache.glob("shard-*.safetensors"))) == 2  # 3 distinct prompts, 2 per shard
    assert len(EmbeddingCache(cache)) == 3  # the repeated prompt is stored once
    live = load_backbone(name, folder, dtype="float32")
    cached = load_backbone(name, folder, dtype="float32", embedding_cache=cache)
    with pytest.raises(ValueError, match="component 'text_encoder' is not loaded"):
        cached.part("text_encoder")  # never loaded
    batch = [PROMPTS[2], PROMPTS[1], PROMPTS[0]]  # another batching than the script's
    expected, got = live.encode(batch), cached.encode(batch)
    for field, value in expected.tensors().items():
        assert got.tensors()[field].shape == value.shape, field
        torch.testing.assert_close(got.tensors()[field], value, rtol=1e-5, atol=1e-5)


def test_missing_prompt_and_mismatched_cache_are_refused(caches, tmp_path):
    folder, cache = caches["flux"]
    cached = load_backbone("flux", folder, dtype="float32", embedding_cache=cache)
    with pytest.raises(ValueError, match="'a purple horse'.*precompute_embeddings"):
        cached.encode(["a photo of a cat", "a purple horse"])
    with pytest.raises(ValueError, match="max_sequence_length: cache has 32, model has 16"):
        load_backbone("flux", folder, dtype="float32", embedding_cache=cache, max_sequence_length=16)
    with pytest.raises(ValueError, match="backbone: cache has 'flux', model has 'qwenimage'"):
        load_backbone("qwenimage", caches["qwenimage"][0], dtype="float32", embedding_cache=cache)
    with pytest.raises(ValueError, match=r"not loaded \['text_encoder'\]"):
        load_backbone("flux", folder, dtype="float32", embedding_cache=cache, text_encoder=folder / "text_encoder")
    with pytest.raises(FileNotFoundError, match="index.json does not exist"):
        EmbeddingCache(tmp_path / "nowhere")
    index = json.loads((cache / "index.json").read_text())
    assert index["signature"]["dims"] == {"prompt_embeds": 32, "pooled": 32}


def test_missing_components_are_named(tiny_flux_dir):
    cond = load_backbone("flux", tiny_flux_dir, dtype="float32").encode(["a cat"])
    assert isinstance(cond, FluxConditioning)
    no_text = load_backbone("flux", tiny_flux_dir, dtype="float32", skip=FluxBackbone.text_components)
    with pytest.raises(ValueError, match="not loaded.*embedding_cache"):
        no_text.encode(["a cat"])
    text_only = load_backbone("flux", tiny_flux_dir, dtype="float32", skip=("transformer", "vae"))
    with pytest.raises(ValueError, match="component 'transformer' is not loaded"):
        text_only.predict(torch.zeros(1, 8, 8, 16), torch.ones(1), cond)


def test_precompute_refuses_a_used_folder(caches, tmp_path):
    folder, cache = caches["flux"]
    with pytest.raises(ValueError, match="not empty"):
        precompute(["--model", "flux", "--path", str(folder), "--prompts", "x", "--out", str(cache)])
