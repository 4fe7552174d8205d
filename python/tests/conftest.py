import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import ringattn_torch  # noqa: E402


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
