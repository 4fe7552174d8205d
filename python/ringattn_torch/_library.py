"""Loads the extension's library (its custom classes and ops live in torch.ops.ringattn)."""

import functools
import pathlib

import torch

_HERE = pathlib.Path(__file__).resolve().parent


def _load():
    found = sorted(_HERE.glob("_C*.so"))
    if not found:
        raise ImportError(
            f"ringattn_torch: the compiled library (_C*.so) is missing from {_HERE}; install the "
            "package with `pip install --no-build-isolation ./python` from the repository")
    torch.ops.load_library(str(found[0]))
    return torch.ops.ringattn


ops = _load()


def has_device_path() -> bool:
    """Whether this build has the CUDA kernels and NCCL (else CPU tensors only)."""
    return bool(ops.has_device_path())


@functools.lru_cache(maxsize=None)
def has_cudnn_kernel() -> bool:
    """Whether this build has kernel="cudnn": the device path built with cuDNN 9 and the
    cudnn-frontend headers (asked of the library once: every call with the kernel checks it)."""
    return bool(ops.has_cudnn_kernel())
