"""Per-layer KV policies: the calibration file's checks, the smoothing's exactness, and engines that load it."""

import json

import pytest
import torch
from test_vllm_engine import engine_env, llm_args
from vllm_jobs import run_job

from vllm_nvfp4_plugin import kv_calibration
from vllm_nvfp4_plugin.kv_calibration import CalibrationError
from vllm_nvfp4_plugin.tools import calibrate
from vllm_nvfp4_plugin.tools.models import smollm2_path, tiny_llama_path

pytestmark = pytest.mark.vllm


def write(tmp_path, edit=None, num_layers=2, heads=2, head_size=64):
    """A valid file of `num_layers` layers (2 KV heads of 64), then `edit(parsed file)` if given."""
    rows = [{"mode": "nvfp4_4over6" if i % 2 else "nvfp4",
             "key_scales": torch.ones(heads, head_size) * 2 ** i} for i in range(num_layers)]
    path = tmp_path / "calibration.json"
    kv_calibration.save(path, "tiny", heads, head_size, rows)
    if edit is not None:
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return path


def test_round_trip(tmp_path):
    calibration = kv_calibration.load(write(tmp_path))
    assert calibration.num_layers == 2 and calibration.num_kv_heads == 2 and calibration.head_size == 64
    assert [p.mode for p in calibration.layers] == ["nvfp4", "nvfp4_4over6"]
    assert torch.equal(calibration.layers[1].key_scales, torch.full((2, 64), 2.0))


@pytest.mark.parametrize("key_format", ["fp8", "int8"])
def test_round_trip_of_a_byte_key_format(tmp_path, key_format):
    path = tmp_path / "keys.json"
    kv_calibration.save(path, "tiny", 2, 64, [{"mode": "nvfp4_4over6", "key_scales": None}] * 3, key_format)
    calibration = kv_calibration.load(path)
    assert calibration.key_format == key_format and [p.mode for p in calibration.layers] == ["nvfp4_4over6"] * 3


def test_auto_takes_the_page_of_most_capacity_within_budget():
    def row(capacity, ppl_increase, top1):
        return {"capacity_tokens": capacity, "ppl_increase": ppl_increase, "top1": top1,
                "perplexity": 1 + ppl_increase}

    fp8_kv = row(5760, 0.05, 0.93)
    modes = {"nvfp4 auto": row(10240, 0.10, 0.89), "fp8 keys": row(7424, 0.02, 0.94),
             "int8 keys": row(7168, 0.008, 0.95), "fp8 (vLLM)": fp8_kv}
    assert calibrate.choose_page(modes, 0.01, 0.01) == "int8 keys"
    assert calibrate.choose_page(modes, 0.03, 0.01) == "fp8 keys"
    assert calibrate.choose_page(modes, 0.10, 0.05) == "nvfp4 auto"
    assert calibrate.choose_page(modes, 0.001, 0.01) == "int8 keys"  # none within budget: least perplexity
    modes["int8 keys"]["top1"] = 0.90  # more than a point below vLLM's FP8 cache
    assert calibrate.choose_page(modes, 0.01, 0.01) == "int8 keys"
    assert calibrate.choose_page(modes, 0.03, 0.01) == "fp8 keys"


def set_scale(value):
    def fix(data):
        data["layers"][1]["key_scales"][0][3] = value
    return fix


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.__setitem__("format", "something else"), "not a KV calibration"),
    (lambda d: d.__setitem__("num_layers", 3), "layer 2 is missing"),
    (lambda d: d["layers"].pop(0), "layer 0 is missing"),
    (lambda d: d["layers"][1].__setitem__("layer", 0), "layer 0 appears twice"),
    (lambda d: d["layers"][0].__setitem__("mode", "fp4"), "layer 0: mode must be one of"),
    (set_scale(float("nan")), r"layer 1: key_scales\[0\]\[3\] = nan is not a positive finite"),
    (set_scale(-2.0), r"key_scales\[0\]\[3\] = -2.0 is not a positive finite"),
    (set_scale(3.0), "powers of two"),
    (lambda d: d["layers"][0]["key_scales"].pop(), r"key_scales must have shape \[2, 64\]"),
    (lambda d: d.__setitem__("key_format", "int4"), r"key_format must be one of \('nvfp4', 'fp8', 'int8'\)"),
])
def test_bad_files_are_refused_naming_the_file_and_rule(tmp_path, edit, message):
    path = write(tmp_path, edit)
    with pytest.raises(CalibrationError, match=message) as error:
        kv_calibration.load(path)
    assert str(path) in str(error.value)


def test_scales_must_be_tied_across_rope_pairs(tmp_path):
    def untie(data):
        data["layers"][0]["key_scales"][1][5] = 4.0  # its pair partner, channel 37, stays 1
    with pytest.raises(CalibrationError, match="equal on RoPE pairs"):
        kv_calibration.load(write(tmp_path, untie))


def test_model_shape_mismatch_names_the_field(tmp_path):
    calibration = kv_calibration.load(write(tmp_path))
    with pytest.raises(CalibrationError, match="num_layers is 2, but the model has 30"):
        calibration.check_model(30, 2, 64, "calibration.json")
    with pytest.raises(CalibrationError, match="head_size is 64, but the model has 128"):
        calibration.check_model(2, 2, 128, "calibration.json")


def test_rope_pair_scales_are_powers_of_two_tied_across_pairs():
    amax = torch.ones(1, 8)
    amax[0, 1] = 10.0  # pair (1, 5): 2^round(log2 10) = 8
    amax[0, 6] = 3.0  # pair (2, 6): 2^round(log2 3) = 4
    assert kv_calibration.rope_pair_power_of_two_scales(amax, torch.tensor([1.0])).tolist() == [
        [1.0, 8.0, 4.0, 1.0, 1.0, 8.0, 4.0, 1.0]]
    assert kv_calibration.rope_pair_power_of_two_scales(amax, torch.tensor([1.0]), alpha=0.5).tolist() == [
        [1.0, 4.0, 2.0, 1.0, 1.0, 4.0, 2.0, 1.0]]


def bias_outlier_keys():
    """Keys with one pair of bias-like outlier channels per head (|k| ~ 150, as Qwen2's early layers have)."""
    torch.manual_seed(0)
    keys = torch.randn(512, 2, 64)
    keys[..., 3] = 150 + 5 * torch.randn(512, 2)
    keys[..., 35] = -120 + 5 * torch.randn(512, 2)
    return keys.bfloat16().float(), torch.randn(256, 4, 64)  # keys, queries (2 per KV head)


def test_smoothing_is_exact_before_quantization():
    keys, queries = bias_outlier_keys()
    scales = calibrate.smoothing_scales(keys.abs().amax(0), 1.0).bfloat16()
    k = keys.bfloat16()
    assert torch.equal(k / scales * scales, k)  # powers of two: dividing and multiplying back is exact in bf16
    q = queries[:, ::2].bfloat16()
    exact = torch.einsum("nhd,mhd->nmh", q.float(), k.float())
    assert torch.equal(torch.einsum("nhd,mhd->nmh", (q * scales).float(), (k / scales).float()), exact)


def test_calibration_search_finds_a_smoothing_that_cuts_the_logit_error():
    keys, queries = bias_outlier_keys()
    values = torch.randn_like(keys)
    candidates = calibrate.layer_candidates(queries, keys, values, keys.abs().amax(0))
    plain = candidates[0]
    assert (plain["mode"], plain["alpha"]) == ("nvfp4", 0.0)
    best = min(candidates, key=lambda c: c["logit_error"])
    assert best["alpha"] > 0 and best["logit_error"] < 0.85 * plain["logit_error"]
    four_over_six = candidates[1]
    assert four_over_six["value_error"] < plain["value_error"]
    auto = calibrate.choose_auto(candidates, 0.05)
    assert auto["logit_error"] <= 1.05 * best["logit_error"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_path(head_dim=64)


def generation_job(model, **llm):
    return {"model": str(model), "llm": llm_args(**llm), "max_tokens": 8,
            "batches": [["The capital of France is", "Once upon a time"]]}


@pytest.mark.e2e
def test_engine_refuses_a_calibration_for_another_model_naming_the_file(tiny, tmp_path):
    path = write(tmp_path, num_layers=3)  # the tiny model has 2 layers of 2 KV heads of 64
    job = generation_job(tiny, kv_cache_dtype="nvfp4",
                         additional_config={"vllm_nvfp4_plugin": {"kv_calibration": str(path)}})
    with pytest.raises(RuntimeError, match=f"{path}: num_layers is 3, but the model has 2"):
        run_job(job, engine_env(), timeout=600)


@pytest.mark.e2e
def test_engine_refuses_nan_scales_naming_the_file(tiny, tmp_path):
    path = write(tmp_path, set_scale(float("nan")))
    job = generation_job(tiny, kv_cache_dtype="nvfp4",
                         additional_config={"vllm_nvfp4_plugin": {"kv_calibration": str(path)}})
    with pytest.raises(RuntimeError, match="key_scales.0..3. = nan"):
        run_job(job, engine_env(), timeout=600)


@pytest.mark.e2e
def test_engine_with_unit_scales_and_plain_modes_equals_plain_nvfp4(tiny, tmp_path):
    """A calibration of unit scales and "nvfp4" everywhere changes nothing: same greedy tokens as no file."""
    path = tmp_path / "unit.json"
    kv_calibration.save(path, "tiny", 2, 64, [{"mode": "nvfp4", "key_scales": torch.ones(2, 64)}] * 2)
    plain = run_job(generation_job(tiny, kv_cache_dtype="nvfp4"), engine_env(), timeout=600)["outputs"]
    calibrated = run_job(generation_job(tiny, kv_cache_dtype="nvfp4", additional_config={
        "vllm_nvfp4_plugin": {"kv_calibration": str(path)}}), engine_env(), timeout=600)
    assert [o["token_ids"] for o in calibrated["outputs"]] == [o["token_ids"] for o in plain]
    assert "NVFP4 KV cache attention on CPU" in calibrated["log"]


@pytest.mark.e2e
def test_engine_serves_nvfp4_4over6(tiny):
    result = run_job(generation_job(tiny, kv_cache_dtype="nvfp4_4over6"), engine_env(), timeout=600)
    assert "NVFP4 KV cache attention on CPU" in result["log"]
    assert all(len(o["token_ids"]) == 8 for o in result["outputs"])


@pytest.mark.e2e
def test_engine_serves_fp8_keys(tiny, tmp_path):
    """key_format "fp8" (the option, or a calibration file's): FP8 E4M3 keys and NVFP4 values, in a page of
    64 + 36 bytes per token and head where NVFP4 takes 36 + 36, and every token generated."""
    nvfp4 = run_job(generation_job(tiny, kv_cache_dtype="nvfp4"), engine_env(), timeout=600)
    fp8 = run_job(generation_job(tiny, kv_cache_dtype="nvfp4",
                                 additional_config={"vllm_nvfp4_plugin": {"key_format": "fp8"}}), engine_env(),
                  timeout=600)
    assert "FP8 E4M3 keys" in fp8["log"]
    assert fp8["kv_tokens"] / nvfp4["kv_tokens"] == pytest.approx(72 / 100, rel=0.02)
    assert all(len(o["token_ids"]) == 8 for o in fp8["outputs"])
    path = tmp_path / "fp8.json"
    kv_calibration.save(path, "tiny", 2, 64, [{"mode": "nvfp4", "key_scales": None}] * 2, key_format="fp8")
    from_file = run_job(generation_job(tiny, kv_cache_dtype="nvfp4", additional_config={
        "vllm_nvfp4_plugin": {"kv_calibration": str(path)}}), engine_env(), timeout=600)
    assert [o["token_ids"] for o in from_file["outputs"]] == [o["token_ids"] for o in fp8["outputs"]]
    assert from_file["kv_tokens"] == fp8["kv_tokens"]


@pytest.mark.e2e
def test_engine_serves_int8_keys(tiny, tmp_path):
    """key_format "int8" (the option, or a calibration file's): INT8 keys with an fp16 scale per token and head and
    NVFP4 values, in a page of 66 + 36 bytes per token and head where NVFP4 takes 36 + 36, and every token
    generated."""
    nvfp4 = run_job(generation_job(tiny, kv_cache_dtype="nvfp4"), engine_env(), timeout=600)
    int8 = run_job(generation_job(tiny, kv_cache_dtype="nvfp4",
                                  additional_config={"vllm_nvfp4_plugin": {"key_format": "int8"}}), engine_env(),
                   timeout=600)
    assert "INT8 keys" in int8["log"]
    assert int8["kv_tokens"] / nvfp4["kv_tokens"] == pytest.approx(72 / 102, rel=0.02)
    assert all(len(o["token_ids"]) == 8 for o in int8["outputs"])
    path = tmp_path / "int8.json"
    kv_calibration.save(path, "tiny", 2, 64, [{"mode": "nvfp4_4over6", "key_scales": None}] * 2, key_format="int8")
    from_file = run_job(generation_job(tiny, kv_cache_dtype="nvfp4", additional_config={
        "vllm_nvfp4_plugin": {"kv_calibration": str(path)}}), engine_env(), timeout=600)
    assert all(len(o["token_ids"]) == 8 for o in from_file["outputs"])
    assert from_file["kv_tokens"] == int8["kv_tokens"]


@pytest.mark.e2e
def test_engine_refuses_a_key_format_conflict(tiny, tmp_path):
    path = tmp_path / "fp8.json"
    kv_calibration.save(path, "tiny", 2, 64, [{"mode": "nvfp4", "key_scales": None}] * 2, key_format="fp8")
    job = generation_job(tiny, kv_cache_dtype="nvfp4", additional_config={
        "vllm_nvfp4_plugin": {"kv_calibration": str(path), "key_format": "nvfp4"}})
    with pytest.raises(RuntimeError, match="key_format is 'nvfp4' but the KV calibration file says key_format 'fp8'"):
        run_job(job, engine_env(), timeout=600)
    job = generation_job(tiny, kv_cache_dtype="nvfp4", additional_config={"vllm_nvfp4_plugin": {"key_format": "fp4"}})
    with pytest.raises(RuntimeError, match=r"vllm_nvfp4_plugin.key_format must be one of \('nvfp4', 'fp8', 'int8'\)"):
        run_job(job, engine_env(), timeout=600)


@pytest.mark.e2e
def test_calibrate_tool_writes_policies_the_engine_loads(tiny, tmp_path):
    """The tool's statistics engine, candidate search and files, on the tiny model (fidelity runs skipped)."""
    import subprocess
    import sys

    out = tmp_path / "calibration"
    proc = subprocess.run([sys.executable, "-m", "vllm_nvfp4_plugin.tools.calibrate", str(tiny), "--out", str(out),
                           "--calibration-prompts", "2", "--continuation-tokens", "8", "--no-fidelity"],
                          env=engine_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert [layer["layer"] for layer in report["layers"]] == [0, 1]
    assert report["modes"][1]["capacity_ratio"] == pytest.approx(4 * 64 / 72, rel=0.02)  # NVFP4 page vs bf16
    for name, key_format in (("nvfp4_smooth", "nvfp4"), ("nvfp4_auto", "nvfp4"), ("fp8_keys", "fp8"),
                             ("int8_keys", "int8"), ("auto", "nvfp4")):  # auto: NVFP4 without fidelity
        calibration = kv_calibration.load(out / f"calibration_{name}.json")
        calibration.check_model(2, 2, 64, name)
        assert calibration.key_format == key_format
    assert report["auto"] == "nvfp4 auto"
    assert "| layer |" in (out / "report.md").read_text()


@pytest.mark.e2e
def test_auto_policy_takes_a_byte_key_page_on_smollm2(tmp_path):
    """On a real model whose NVFP4 keys cost too much, auto takes a page of byte keys (FP8 or INT8): SmolLM2's
    NVFP4-page policies all raise the perplexity by more than 1% (nvfp4 auto +9.2% on 100 questions), the byte-key
    pages stay closer to the bf16 cache than any of them at over 2.5x bf16's capacity (int8 keys: +1.45%, 2.59x)."""
    import subprocess
    import sys

    out = tmp_path / "smollm2"
    proc = subprocess.run([sys.executable, "-m", "vllm_nvfp4_plugin.tools.calibrate", str(smollm2_path()), "--out",
                           str(out), "--calibration-prompts", "8", "--eval-prompts", "10"],
                          env=engine_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    modes = {row["mode"]: row for row in report["modes"]}
    assert report["auto"] in ("fp8 keys", "int8 keys")
    assert kv_calibration.load(out / "calibration_auto.json").key_format == report["auto"].split()[0]
    assert modes["nvfp4 auto"]["ppl_increase"] > 0.01
    for name in ("nvfp4", "nvfp4 auto"):
        assert modes["auto"]["mean_kl"] < modes[name]["mean_kl"]
        assert modes["auto"]["perplexity"] < modes[name]["perplexity"]
    assert modes["auto"]["capacity_ratio"] > 2.5
