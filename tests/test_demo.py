"""The main job (python -m vllm_nvfp4_plugin.tools.demo): two real `vllm serve` runs of SmolLM2, nvfp4 and bf16."""

import re

import pytest

from vllm_nvfp4_plugin.tools import demo

# One NVFP4 element costs 1/2 byte of data + 1/16 byte of block scale; bf16 costs 2 bytes.
NVFP4_OVER_BF16_BYTES = 2 / (1 / 2 + 1 / 16)

METRIC_LINE = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="nvfp4",engine="0",'
    'kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="165632",num_gpu_blocks="1294"} 1.0'
)


def test_cache_config_labels_reads_the_info_gauge():
    page = f"# HELP vllm:cache_config_info Information\n# TYPE vllm:cache_config_info gauge\n{METRIC_LINE}\n"
    labels = demo.cache_config_labels(page)
    assert labels["cache_dtype"] == "nvfp4"
    assert labels["kv_cache_size_tokens"] == "165632"
    assert labels["block_size"] == "128"


def test_cache_config_labels_without_the_gauge_is_an_error():
    with pytest.raises(RuntimeError, match="no vllm:cache_config_info"):
        demo.cache_config_labels("# HELP vllm:num_requests_running x\nvllm:num_requests_running 0.0\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-tokens", "0"], "--max-tokens must be > 0"),
        (["--kv-cache-gib", "-1"], "--kv-cache-gib must be > 0"),
        (["--baseline", "nvfp4"], "--baseline must differ from nvfp4"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(argv)
    assert message in capsys.readouterr().err


def test_demo_serves_nvfp4_and_reports_more_kv_tokens_than_bf16(tmp_path, capsys):
    runs = demo.main(["--log-dir", str(tmp_path), "--max-tokens", "24"])
    out = capsys.readouterr().out
    nvfp4, bf16 = runs["nvfp4"], runs["bfloat16"]

    assert "Paris" in nvfp4.answer, nvfp4.answer
    assert "Paris" in bf16.answer, bf16.answer
    # Same memory for both caches, as vLLM itself reports it.
    assert nvfp4.kv_cache_memory_bytes == bf16.kv_cache_memory_bytes == 2**30
    ratio = nvfp4.kv_cache_tokens / bf16.kv_cache_tokens
    # At most the byte ratio; whole blocks per layer may cost a little of it.
    assert 3.5 <= ratio <= NVFP4_OVER_BF16_BYTES, ratio
    assert f"ratio: {ratio:.2f}x" in out
    for run in (nvfp4, bf16):
        # The metric and vLLM's own log line are two reports of one figure: they must agree.
        logged = re.search(r"KV cache size: ([\d,]+) tokens", run.vllm_log_line)
        assert logged and int(logged.group(1).replace(",", "")) == run.kv_cache_tokens
        assert f"[{run.kv_cache_dtype}] answer: {run.answer}" in out
    # The plugin was loaded through its entry point by the server's engine processes.
    assert "vllm_nvfp4_plugin registered" in (tmp_path / "vllm_serve_nvfp4.log").read_text()
