"""Lets PyPI's torchvision 0.28.0 import beside torch 2.13.0+cpu (installed by tools/setup.sh).

Runs in every Python process of the venv, from a one-line .pth start-up import,
and costs nothing until torchvision is imported: then, before torchvision's own
import, it defines the schemas of the C operators its CUDA-linked library fails
to register on a CPU-only torch (`operator torchvision::nms does not exist`).
The Python-level transforms (what Qwen2-VL's image processor uses) then work;
the C kernels themselves (nms on tensors) stay unavailable.
"""
import importlib.abc
import sys

_LIBRARIES = []  # a torch.library.Library unregisters its schemas when collected


class _DefineTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBRARIES.append(lib)
        return None  # the normal finders import torchvision itself


if not any(isinstance(f, _DefineTorchvisionOps) for f in sys.meta_path):
    sys.meta_path.insert(0, _DefineTorchvisionOps())
