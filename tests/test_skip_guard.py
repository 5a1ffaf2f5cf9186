"""The skip guard (tests/conftest.py): a skip is allowed only for a listed hardware reason, up to its count."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ALLOWED_SKIPS, ENGINE_SKIP, NATIVE_SKIP, read_allowed_skips, skip_guard_errors

ALLOWED = {"the CPU has no AVX-512 VNNI": 2, "needs a CUDA device": 1}


def test_listed_reasons_within_their_counts_pass() -> None:
    skips = [("a", "the CPU has no AVX-512 VNNI (or no compiler)"), ("b", "the CPU has no AVX-512 VNNI"),
             ("c", "needs a CUDA device")]
    assert skip_guard_errors(skips, ALLOWED, "") == []


def test_unlisted_reason_fails() -> None:
    errors = skip_guard_errors([("t::x", "could not import 'llama_cpp': No module named 'llama_cpp'")], ALLOWED, "")
    assert len(errors) == 1 and errors[0].startswith("t::x: skipped for a reason that is not allowed")


def test_more_than_the_count_fails() -> None:
    errors = skip_guard_errors([(str(i), "needs a CUDA device") for i in range(2)], ALLOWED, "")
    assert errors == ["2 tests skipped for 'needs a CUDA device', more than the 1 allowed"]


def test_browser_skip_needs_the_opt_out() -> None:
    skips = [("tests/test_web_client.py", "Debian's chromium is not installed at /x (apt-get install chromium)")]
    assert len(skip_guard_errors(skips, ALLOWED, "")) == 1
    assert skip_guard_errors(skips, ALLOWED, "no apt on this runner") == []


def test_the_repository_list_names_hardware_only() -> None:
    allowed = read_allowed_skips()
    assert allowed and all(count > 0 for count in allowed.values())
    # Hardware, or the optional native build (module and executable), which `make test` builds and then requires
    # (POCKETLLM_REQUIRE_NATIVE, POCKETLLM_ENGINE)
    assert all("CUDA" in reason or "CPU" in reason or reason in (NATIVE_SKIP, ENGINE_SKIP) for reason in allowed), \
        allowed


def test_malformed_line_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "allowed.txt"
    path.write_text("# comment\n3 | fine\nmissing a count\n")
    with pytest.raises(pytest.UsageError, match="allowed.txt:3"):
        read_allowed_skips(str(path))


def test_a_session_with_an_unlisted_skip_fails(tmp_path: Path) -> None:
    """End to end: pytest on a copy of the conftest exits 1 where a test skips for an unlisted reason."""
    conftest = Path(__file__).with_name("conftest.py")
    (tmp_path / "conftest.py").write_text(conftest.read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "allowed_skips.txt").write_text(Path(ALLOWED_SKIPS).read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "test_x.py").write_text(textwrap.dedent("""
        import pytest

        def test_ok():
            pass

        def test_missing_dependency():
            pytest.importorskip("a_module_that_does_not_exist")

        @pytest.mark.skipif(True, reason="the CPU has no AVX-512 VNNI (or no compiler)")
        def test_hardware():
            pass
    """), encoding="utf-8")
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "test_missing_dependency: skipped for a reason that is not allowed" in run.stdout
    assert "test_hardware" not in run.stdout.split("skip guard")[-1]
    (tmp_path / "test_x.py").write_text("import pytest\n\ndef test_ok():\n    pass\n", encoding="utf-8")
    assert subprocess.run(command, cwd=tmp_path, capture_output=True, timeout=300).returncode == 0
