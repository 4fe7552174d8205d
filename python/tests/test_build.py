"""The extension's build folder: one per set of build options and PyTorch, so that a reinstall
with other options (the device path on after a host-only build) or under another PyTorch
configures afresh instead of reusing the last CMake cache."""

import importlib.util
import os
import pathlib
import types

import pytest

SETUP = pathlib.Path(__file__).resolve().parents[1] / "setup.py"


@pytest.fixture(scope="module")
def setup_module():
    os.environ["RINGATTN_SETUP_IMPORT"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("ringattn_setup", SETUP)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        del os.environ["RINGATTN_SETUP_IMPORT"]
    return module


def _torch(version="2.11.0", path="/venv-a/torch/share/cmake"):
    return types.SimpleNamespace(__version__=version,
                                 utils=types.SimpleNamespace(cmake_prefix_path=path))


def test_build_folder_follows_options_and_torch(setup_module):
    name = setup_module.cmake_build_name
    base = name({}, _torch())
    assert base.startswith("cmake-") and base == name({}, _torch())
    others = [
        name({"RINGATTN_TORCH_DEVICE": "OFF"}, _torch()),
        name({"RINGATTN_TORCH_DEVICE": "ON"}, _torch()),
        name({"RINGATTN_TORCH_CUDA_ARCHITECTURES": "90a"}, _torch()),
        name({"CMAKE_ARGS": "-DFOO=1"}, _torch()),
        name({}, _torch(version="2.10.0")),
        name({}, _torch(path="/venv-b/torch/share/cmake")),
    ]
    assert len(set(others + [base])) == len(others) + 1
