"""A pytest hook (tests/conftest.py imports it; `-p tests.helpers.report` loads it elsewhere): with
TRANSFORMER_TEST_LOG=FILE, one JSON line per test as it ends (outcome, seconds, a failure's last lines), so a GPU
lease whose tier is cut short by its clock still learns which test failed and why (benchmarks/bench_gpu.py)."""
import json
import os


def pytest_runtest_logreport(report):
    """A test's line, at its end: its call's report, or its setup's or teardown's where that failed or skipped.
    Under pytest-xdist the controller writes every worker's reports, a crashed worker's too; the workers do not."""
    path = os.environ.get("TRANSFORMER_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not (report.when == "call" or report.failed or
                                                                 report.skipped):
        return
    line = {"test": report.nodeid, "outcome": report.outcome, "when": report.when,
            "seconds": round(report.duration, 1)}
    if report.failed:
        line["error"] = report.longreprtext[-1500:]
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
