"""CPU test environment only: let PyPI's torchvision (a CUDA build) import beside a CPU torch.

PyPI's torchvision wheel registers its C++ kernels for CUDA and, without its CUDA library,
`import torchvision` fails with "operator torchvision::nms does not exist" because its Python
code registers fake (meta) implementations for operators whose schemas were never declared.
`import sglang` imports torchvision (transformers' image utils, sglang's multimodal helpers),
so on a CPU machine we declare the two schemas torchvision registers without a guard just
before torchvision itself is imported. Installed by scripts/install-cpu-env.sh as a .pth file
so that subprocesses (SGLang's spawned schedulers, the launcher) get it too. Never shipped.
"""
import importlib.abc
import sys


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            for schema in (
                "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            ):
                try:
                    lib.define(schema)
                except RuntimeError:
                    pass  # already declared (a real CPU/CUDA torchvision build)
            _KEEP.append(lib)
        except Exception:  # never break interpreter start-up
            pass
        return None


_KEEP = []
sys.meta_path.insert(0, _DeclareTorchvisionOps())
