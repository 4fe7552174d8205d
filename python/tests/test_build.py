"""The extension's build: one folder per set of build options and PyTorch, so that a reinstall
with other options (the device path on after a host-only build) or under another PyTorch
configures afresh instead of reusing the last CMake cache; and compilers whose static C++ runtime
would crash at the first error refused at configure time."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
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
        name({"RINGATTN_TORCH_CUDNN": "OFF"}, _torch()),
        name({"CUDNN_ROOT": "/opt/cudnn"}, _torch()),
        name({"CUDNN_FRONTEND_ROOT": "/opt/frontend"}, _torch()),
        name({"CMAKE_ARGS": "-DFOO=1"}, _torch()),
        name({}, _torch(version="2.10.0")),
        name({}, _torch(path="/venv-b/torch/share/cmake")),
    ]
    assert len(set(others + [base])) == len(others) + 1
    assert name({"CUDAHOSTCXX": "/usr/bin/g++"}, _torch()) != base
    assert name({"CXX": "/usr/bin/g++"}, _torch()) != base


def test_cudnn_is_looked_for_in_the_wheels(setup_module, tmp_path, monkeypatch):
    """PyTorch's cuDNN wheel (nvidia/cudnn, a namespace package) and an nvidia-cudnn-frontend
    wheel's headers (site-packages/include) are found where they are installed, and only where
    they hold what the build needs."""
    site = tmp_path / "site"
    cudnn = site / "nvidia" / "cudnn"
    for folder in (cudnn / "include", cudnn / "lib", site / "cudnn", site / "include"):
        folder.mkdir(parents=True)
    (site / "cudnn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    for name in [n for n in sys.modules if n == "cudnn" or n.split(".")[0] == "nvidia"]:
        monkeypatch.delitem(sys.modules, name)
    assert setup_module.torch_cudnn_root() != str(cudnn)  # no header, no library
    (cudnn / "include" / "cudnn_version.h").write_text("")
    (cudnn / "lib" / "libcudnn.so.9").write_text("")
    assert setup_module.torch_cudnn_root() == str(cudnn)
    assert setup_module.cudnn_frontend_root() is None  # no headers
    (site / "include" / "cudnn_frontend.h").write_text("")
    assert setup_module.cudnn_frontend_root() == str(site.resolve())


def _compiler_without_shared_runtime(folder):
    """A g++ that says it has no shared libstdc++, as one installed with the static runtime alone
    does (-print-file-name echoes the name it cannot find)."""
    real = shutil.which("g++")
    fake = folder / "g++"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-print-file-name=libstdc++.so" ]; then\n'
                    f'  echo libstdc++.so; exit 0\nfi\nexec {real} "$@"\n')
    fake.chmod(0o755)
    return fake


def _configure(tmp_path, env, *args):
    build = tmp_path / "build"
    shutil.rmtree(build, ignore_errors=True)
    return subprocess.run(["cmake", "-S", str(SETUP.parent), "-B", str(build), *args],
                          env=env, capture_output=True, text=True)


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("g++")), reason="needs cmake, g++")
def test_a_compiler_without_the_shared_runtime_is_refused(tmp_path):
    # Its static copy of libstdc++ would crash at the extension's first error: the configure
    # stops, naming the compiler and what to set.
    fake = _compiler_without_shared_runtime(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CUDAHOSTCXX")}
    result = _configure(tmp_path, dict(env, CXX=str(fake)), "-DRINGATTN_TORCH_DEVICE=OFF")
    assert result.returncode != 0
    text = " ".join(result.stderr.split())
    assert f"{fake} (the C++ compiler) has no shared libstdc++" in text, text
    assert "CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++" in text, text
    if not shutil.which("nvcc"):
        return
    # nvcc's host compiler: its library folders join the extension's link line.
    result = _configure(tmp_path, dict(env, CUDAHOSTCXX=str(fake)), "-DRINGATTN_TORCH_DEVICE=ON",
                        f"-DCMAKE_CXX_COMPILER={shutil.which('g++')}")
    text = " ".join(result.stderr.split())
    if "the device path needs NCCL" in text:
        pytest.skip("no NCCL: the device path does not configure here")
    assert result.returncode != 0
    assert f"{fake} (nvcc's host compiler) has no shared libstdc++" in text, text
