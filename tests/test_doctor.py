"""`python -m vllm_nvfp4_plugin.tools.doctor` on the CPU: every op against the reference, and the read-back checks."""

import subprocess
import sys

import torch

from vllm_nvfp4_plugin.tools import doctor


def test_doctor_cli_passes_on_cpu():
    result = subprocess.run([sys.executable, "-m", "vllm_nvfp4_plugin.tools.doctor", "--device", "cpu"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| cpu |")]
    assert len(rows) == 29 and all("| pass |" in row for row in rows)
    for layout in ("NHD", "HND"):  # the layout column is what the strides and shapes say
        assert any(f"| {layout} | swizzled |" in row for row in rows)
        assert sum(f"| {layout}, FP8 keys |" in row for row in rows) == 3
        assert sum(f"| {layout}, INT8 keys |" in row for row in rows) == 3
    assert result.stdout.strip().endswith("29 passed, 0 failed")


def test_read_back_check_sees_a_wrong_v_scale_order():
    """The linear reader over swizzled V scales (docs/FORMATS.md §1) is off by far more than the tolerance."""
    gen = torch.Generator().manual_seed(0)
    good = doctor.check_read_back("cpu", False, gen)
    bad = doctor.check_read_back("cpu", False, gen, written_swizzled=True)
    assert good.ok and bad.ok
    good_err, bad_err = (float(r.detail.split()[2]) for r in (good, bad))
    assert good_err <= doctor.READ_BACK_TOLERANCE < 10 * doctor.READ_BACK_TOLERANCE < bad_err


def test_a_failed_row_shows_and_makes_the_exit_code_non_zero():
    passed = doctor.Row("cpu", "a check", "NHD", "linear", True, "")
    failed = doctor.Row("cpu", "another", "HND", "linear", False, "2 bytes differ")
    assert "| cpu | another | HND | linear | FAIL | 2 bytes differ |" in doctor.format_table([passed, failed])
    assert doctor.exit_code([passed]) == 0 and doctor.exit_code([passed, failed]) == 1
