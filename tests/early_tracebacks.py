"""pytest plugin ``--early-tracebacks`` (loaded by ``tests/conftest.py``): a failing test's traceback is printed right
after its FAILED line, not only in the summary at the end, so a run stopped by a time limit (``scripts/gpu_suite.sh``'s
tests stage) still shows why each failure failed. Under pytest-xdist the controller prints what the workers report."""

_CONFIG = []
TAIL_LINES = 60


def pytest_addoption(parser):
    parser.addoption("--early-tracebacks", action="store_true", default=False,
                     help="print a failing test's traceback (its last 60 lines) as soon as it fails")


def pytest_configure(config):
    _CONFIG[:] = [config]


def pytest_runtest_logreport(report):
    if not report.failed or not _CONFIG or not _CONFIG[0].getoption("--early-tracebacks"):
        return
    config = _CONFIG[0]
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or hasattr(config, "workerinput"):  # an xdist worker: its controller prints the report
        return
    tr.write_line(f"---- {report.nodeid} ({report.when}) failed:")
    for line in str(report.longreprtext).splitlines()[-TAIL_LINES:]:
        tr.write_line(f"     {line}")
