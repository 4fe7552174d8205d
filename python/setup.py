"""Builds the extension's library with CMake against the Torch package of the PyTorch that runs
the build (install with `pip install --no-build-isolation ./python`, so that it is this one).

CMake options come from the environment: RINGATTN_TORCH_DEVICE=OFF builds the host path alone,
RINGATTN_TORCH_CUDA_ARCHITECTURES picks the GPU architectures (default "80;90a"),
RINGATTN_TORCH_CUDNN the cuDNN kernel (AUTO: where cuDNN 9 and the cudnn-frontend headers are
found; ON: required; OFF), CMAKE_ARGS passes anything else, MAX_JOBS bounds the parallel build.
cuDNN is looked for first in PyTorch's own cuDNN wheel (nvidia/cudnn, the library PyTorch loads),
the cudnn-frontend headers in an installed nvidia-cudnn-frontend wheel; CUDNN_ROOT and
CUDNN_FRONTEND_ROOT in the environment take precedence.
"""

import hashlib
import importlib.util
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).resolve().parent


def cmake_build_name(environ, torch):
    """The CMake build folder's name for this install: a hash of everything that decides what
    CMake configures (the options above, CMAKE_ARGS, the CUDA compiler found, and the Torch
    package and Python that build it), so that an install with other options or another PyTorch
    configures afresh instead of reusing a cache made for the last one."""
    parts = [f"{name}={environ.get(name, '')}" for name in (
        "RINGATTN_TORCH_DEVICE", "RINGATTN_TORCH_CUDA_ARCHITECTURES", "RINGATTN_TORCH_CUDNN",
        "CUDNN_ROOT", "CUDNN_FRONTEND_ROOT", "CMAKE_ARGS",
        "CMAKE_BUILD_TYPE", "CUDACXX", "CUDAHOSTCXX", "CUDA_HOME", "CUDA_PATH", "CXX", "CC")]
    parts += [f"cudnn={torch_cudnn_root() or ''}", f"frontend={cudnn_frontend_root() or ''}"]
    parts += [f"nvcc={shutil.which('nvcc') or ''}", f"torch={torch.__version__}",
              f"torch_path={torch.utils.cmake_prefix_path}", f"python={sys.executable}"]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return f"cmake-{digest}"


def torch_cudnn_root():
    """The folder of PyTorch's cuDNN wheel (include/cudnn_version.h, lib/libcudnn.so.9), if any."""
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        root = pathlib.Path(folder)
        if (root / "include" / "cudnn_version.h").is_file() and any(root.glob("lib/libcudnn.so*")):
            return str(root)
    return None


def cudnn_frontend_root():
    """The folder whose include/ holds an installed nvidia-cudnn-frontend wheel's headers."""
    try:
        spec = importlib.util.find_spec("cudnn")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    site = pathlib.Path(spec.origin).resolve().parent.parent
    return str(site) if (site / "include" / "cudnn_frontend.h").is_file() else None


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch

        output = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve()
        build = pathlib.Path(self.build_temp).resolve() / cmake_build_name(os.environ, torch)
        args = [
            "cmake", "-S", str(HERE), "-B", str(build),
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DRINGATTN_TORCH_OUTPUT={output}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('CMAKE_BUILD_TYPE', 'Release')}",
        ]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        for option in ("RINGATTN_TORCH_DEVICE", "RINGATTN_TORCH_CUDA_ARCHITECTURES",
                       "RINGATTN_TORCH_CUDNN"):
            if option in os.environ:
                args.append(f"-D{option}={os.environ[option]}")
        # FindCUDNN reads CUDNN_ROOT and CUDNN_FRONTEND_ROOT from the environment itself.
        for name, found in (("CUDNN_ROOT", torch_cudnn_root),
                            ("CUDNN_FRONTEND_ROOT", cudnn_frontend_root)):
            root = None if name in os.environ else found()
            if root:
                args.append(f"-D{name}={root}")
        args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        subprocess.check_call(args)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build), "-j", jobs])


if __name__ == "__main__" or os.environ.get("RINGATTN_SETUP_IMPORT") != "1":
    setup(ext_modules=[CMakeExtension("ringattn_torch._C")], cmdclass={"build_ext": CMakeBuild})
