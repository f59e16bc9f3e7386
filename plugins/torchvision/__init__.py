"""torchvision adapter: Faster / Mask R-CNN on the timm Swin backbone with any unnorm norm,
COCO-format data and evaluation, and the generated shapes set for CPU runs."""
from .detectors import build_detector, detector_fold_plan, fold_detector

__all__ = ["build_detector", "detector_fold_plan", "fold_detector"]
