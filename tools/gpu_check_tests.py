"""pytest plugin of gpu_check.sh's kernel step: each test's outcome filed the moment it is known
(kvchat.bench.figures), as the JUnit XML is written only when pytest ends and a pytest killed by
the step's limit leaves none."""
from kvchat.bench.figures import figure


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":  # a result, or a setup that skipped or failed
        figure({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                "seconds": round(report.duration, 3)})
