"""Score vLLM engines' greedy tokens (benchmarks/vllm_engines.py's engine.json) against fp32 references.

The tiny models are random, so their next-token logits are nearly tied and two correct engines that differ
only by rounding soon pick different tokens: comparing greedy texts says little. Instead each engine's own
sequence (prompt + its generated tokens) is fed, teacher-forced, through the same model in float32
(transformers) with two KV caches of reference:
- `bf16 KV`: keys and values rounded to bf16, as vLLM's bf16 cache holds them;
- `NVFP4 KV`: the same, then NVFP4-quantized and dequantized (plugin's reference.py, global scale 1), as the
  plugin's cache holds them (every attention read, prefill included, goes through the cache).
For each engine: the fraction of its generated tokens that are the reference's argmax, and the mean logit gap
(reference max logit − logit of the engine's token). An engine computing what its cache implies agrees best with
the reference of its own cache. Runs on the CPU (no GPU needed): the tiny models are rebuilt by
`tools.models.tiny_llama_path` with the same seed; the scores themselves show whether the weights match (a bf16
engine scored ~100% against the bf16 reference cannot come from other weights).

    python benchmarks/score_engines.py ENGINE_JSON [ENGINE_JSON ...]   (e.g. a GPU run and a --cpu run)
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AttentionInterface, AutoTokenizer, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vllm_nvfp4_plugin.tools.models import tiny_llama_path
from vllm_nvfp4_plugin.reference import nvfp4_decode, nvfp4_encode

from vllm_engines import BATCHES, agreement

REFERENCES = ("bf16 KV", "NVFP4 KV")


def _cache_round_trip(x: torch.Tensor, nvfp4: bool) -> torch.Tensor:
    """`[B, heads, S, head]` keys or values as the KV cache returns them, in float32."""
    x = x.to(torch.bfloat16)
    if nvfp4:
        return nvfp4_decode(*nvfp4_encode(x, 1.0), 1.0)
    return x.float()


def _attention(nvfp4: bool):
    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, _cache_round_trip(key, nvfp4), _cache_round_trip(value, nvfp4),
                                      attention_mask, **kwargs)
    return attention


AttentionInterface.register("bf16_kv", _attention(nvfp4=False))
AttentionInterface.register("nvfp4_kv", _attention(nvfp4=True))


@torch.no_grad()
def score(model: LlamaForCausalLM, prompts: list[list[int]], outputs: list[dict]) -> tuple[float, float, int]:
    """(top-1 agreement, mean logit gap, positions) of the outputs' generated tokens under `model`."""
    agree, gaps = [], []
    for prompt, out in zip(prompts, outputs):
        generated = out["token_ids"]
        ids = torch.tensor([prompt + generated])
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()  # the logits that chose each generated token
        chosen = logits.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1)
        agree += (logits.argmax(1) == torch.tensor(generated)).tolist()
        gaps += (logits.max(1).values - chosen).tolist()
    return sum(agree) / len(agree), sum(gaps) / len(gaps), len(agree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_json", nargs="+")
    args = parser.parse_args()
    runs = {}
    for path in args.engine_json:
        runs.update(json.loads(open(path).read()))
    print("Each cell: top-1 agreement of the engine's greedy tokens with the reference, mean logit gap.\n")
    print("| head | engine | positions | vs fp32 model, bf16 KV | vs fp32 model, NVFP4 KV |")
    print("| --- | --- | --- | --- | --- |")
    for head in (64, 128, 256):
        path = tiny_llama_path(head_dim=head)
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer(p)["input_ids"] for batch in BATCHES for p in batch]
        models = {ref: LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl).eval()
                  for ref, impl in zip(REFERENCES, ("bf16_kv", "nvfp4_kv"))}
        for key, run in runs.items():
            name = key.split("-", 1)[1]
            if not key.startswith(f"{head}-") or "outputs" not in run:
                continue
            lens = [out["prompt_len"] for out in run["outputs"]]
            if lens != [len(p) for p in prompts]:
                raise SystemExit(f"{head}-{name}: prompt lengths {lens} differ from the tokenizer's here")
            cells = [score(models[ref], prompts, run["outputs"]) for ref in REFERENCES]
            print(f"| {head} | {name} | {cells[0][2]} | "
                  + " | ".join(f"{a:.1%}, gap {g:.3f}" for a, g, _ in cells) + " |")
    # Greedy tokens of the same cache dtype across devices (when a --cpu run is given too).
    pairs = [(f"{head}-{gpu}", f"{head}-cpu-{gpu.split('-')[0]}") for head in (64, 128, 256)
             for gpu in ("nvfp4", "nvfp4-core", "bf16")]
    rows = [f"| {a} | {b} | {agreement(runs[a], runs[b])} |" for a, b in pairs
            if "outputs" in runs.get(a, {}) and "outputs" in runs.get(b, {})]
    if rows:
        print("\n| engine | same cache dtype on the CPU | greedy tokens |\n| --- | --- | --- |")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
