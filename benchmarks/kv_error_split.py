"""Where a KV-cache format's perplexity cost comes from: the keys or the values.

The plugin's reference encoders round-trip K and V inside a transformers model's attention (each separately and
together), teacher-forced along the bf16 model's greedy continuations of GSM8K questions (the same positions the
calibration tool measures in vLLM). A format's cost on values alone is a floor for every page that keeps NVFP4
values, whatever its keys. Unit global scales, as the calibration tool uses.

    python benchmarks/kv_error_split.py "$(python -m vllm_nvfp4_plugin.tools.models smollm2)" [--questions 100]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vllm_nvfp4_plugin.tools.calibrate import gsm8k_prompts, restore, restore_fp8, restore_int8


def exact(x):
    return x


def in_dtype(round_trip):
    """The round trip, given back in its input's dtype (attention keeps the model's)."""
    return lambda x: round_trip(x).to(x.dtype)


nvfp4 = in_dtype(lambda x: restore(x, False))
nvfp4_4over6 = in_dtype(lambda x: restore(x, True))
fp8 = in_dtype(restore_fp8)
int8 = in_dtype(restore_int8)


# name: (key round trip, value round trip); attention sees K and V as [batch, heads, tokens, head_size].
TREATMENTS = {
    "bf16": (exact, exact),
    "NVFP4 K + V": (nvfp4, nvfp4),
    "NVFP4 V only": (exact, nvfp4),
    "NVFP4 4over6 V only": (exact, nvfp4_4over6),
    "FP8 K only": (fp8, exact),
    "INT8 K only": (int8, exact),
    "FP8 K + NVFP4 V": (fp8, nvfp4),
    "INT8 K + NVFP4 V": (int8, nvfp4),
    "INT8 K + NVFP4 4over6 V": (int8, nvfp4_4over6),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a local transformers model directory")
    parser.add_argument("--questions", type=int, default=100, help="GSM8K test questions, from the first")
    parser.add_argument("--tokens", type=int, default=64, help="greedy continuation tokens a question")
    args = parser.parse_args()

    active = {"treatment": TREATMENTS["bf16"]}

    def attention(module, query, key, value, mask, **kwargs):
        round_key, round_value = active["treatment"]
        return sdpa_attention_forward(module, query, round_key(key), round_value(value), mask, **kwargs)

    AttentionInterface.register("kv_round_trip", attention)
    AttentionMaskInterface.register("kv_round_trip", sdpa_mask)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 attn_implementation="kv_round_trip").eval()
    start = time.time()
    sequences = []
    with torch.no_grad():
        for prompt in gsm8k_prompts(0, args.questions):
            ids = tokenizer(prompt).input_ids
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False)[0].tolist()
            sequences.append((ids, out[len(ids):]))
    positions = sum(len(cont) - 1 for _, cont in sequences)
    print(f"{args.model}: {args.questions} questions, {positions} positions (each continuation's tokens after its "
          f"first), bf16 weights")
    print()
    print("| K / V treatment | top-1 vs bf16 | mean KL | PPL | PPL vs bf16 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    baseline = None
    for name, treatment in TREATMENTS.items():
        active["treatment"] = treatment
        log_probs = []
        with torch.no_grad():
            for ids, cont in sequences:
                logits = model(torch.tensor([ids + cont])).logits[0].float()
                log_probs.append(logits[len(ids):len(ids) + len(cont) - 1].log_softmax(-1))  # predict cont[1:]
        nll = sum(-lp.gather(1, torch.tensor(cont[1:]).unsqueeze(1)).sum().item()
                  for lp, (_, cont) in zip(log_probs, sequences))
        ppl = math.exp(nll / positions)
        if baseline is None:
            baseline = (log_probs, ppl)
        top1 = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(baseline[0], log_probs)) / positions
        kl = sum((a.exp() * (a - b)).sum().item() for a, b in zip(baseline[0], log_probs)) / positions
        print(f"| {name} | {top1:.3f} | {kl:.4f} | {ppl:.4f} | {100 * (ppl / baseline[1] - 1):+.2f}% |", flush=True)
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
