import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import ringattn_torch  # noqa: E402
from reference import RUN_SEED, case_seed  # noqa: E402


def pytest_report_header(config):
    return f"ringattn test seed: {RUN_SEED} (RINGATTN_TEST_SEED={RUN_SEED} runs these cases again)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure names the run's seed (pytest -q prints no header)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("ringattn test seed",
                                f"RINGATTN_TEST_SEED={RUN_SEED} runs this case again"))


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test starts from its own seed of the run (torch's global generator: dout and
    other draws without a generator of their own)."""
    torch.manual_seed(case_seed(request.node.nodeid))


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped (reported as such) where there is no GPU or no device path."""
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device"
    elif not ringattn_torch.has_device_path():
        reason = "this build has the host path only"
    if reason:
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and the device path")
