"""COCO-format instance data for torchvision detectors, and COCO evaluation with pycocotools.

Any COCO-layout set works: ``<root>/<images>/`` and ``<root>/annotations/<file>.json``
(COCO 2017 itself, or the generated shapes). Images are read with torchvision's
``CocoDetection`` wrapped for the v2 transforms, which turn polygons and RLEs into masks and
move boxes and masks with every flip.
"""
from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path

import numpy as np
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torchvision import datasets, tv_tensors
from torchvision.transforms import v2

COCO_STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl")  # COCOeval.stats[:6], in this order


def _complete(image, target: dict, masks: bool) -> dict:
    """Images without annotations still get empty boxes, labels (and masks)."""
    if "boxes" not in target:
        width, height = image.size
        target["boxes"] = tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY",
                                                   canvas_size=(height, width))
        target["labels"] = torch.zeros(0, dtype=torch.int64)
        target["iscrowd"] = []
        if masks:
            target["masks"] = tv_tensors.Mask(torch.zeros(0, height, width, dtype=torch.uint8))
    return target


def _drop_crowds(target: dict) -> dict:
    """Training ignores crowd regions, as COCO's reference trainers do."""
    keep = ~torch.as_tensor(target["iscrowd"], dtype=torch.bool)
    return {key: tv_tensors.wrap(value[keep], like=value) if key in ("boxes", "masks")
            else value[keep] if key == "labels" else value for key, value in target.items()}


class CocoInstances(torch.utils.data.Dataset):
    """(image float [0, 1] CHW, target dict) pairs of a COCO-format split.

    ``train=True`` drops crowds and images left without objects, and flips at random; the
    detector itself resizes (multi-scale in training), as torchvision's detectors do.
    """

    def __init__(self, images: Path, annotations: Path, train: bool, masks: bool = True):
        for path, what in ((images, "image folder"), (annotations, "annotation file")):
            if not Path(path).exists():
                raise FileNotFoundError(
                    f"COCO {what} not found at {path}: set data.root (or UNNORM_COCO) to a folder "
                    "holding train2017/, val2017/ and annotations/instances_*2017.json")
        keys = ("boxes", "labels", "image_id", "iscrowd") + (("masks",) if masks else ())
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
            base = datasets.CocoDetection(str(images), str(annotations))
        self.coco = base.coco
        self.dataset = datasets.wrap_dataset_for_transforms_v2(base, target_keys=keys)
        self.train, self.masks = train, masks
        self.indices = list(range(len(base.ids)))
        if train:
            self.indices = [i for i, image_id in enumerate(base.ids)
                            if any(not a["iscrowd"] for a in self.coco.imgToAnns[image_id])]
        steps = [v2.ToImage()] + ([v2.RandomHorizontalFlip(0.5)] if train else [])
        self.transform = v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True)])

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        image, target = self.dataset[self.indices[index]]
        target = _complete(image, target, self.masks)
        if self.train:
            target = _drop_crowds(target)
        target.pop("iscrowd")
        return self.transform(image, target)

    @property
    def num_classes(self) -> int:
        """Labels are COCO category ids, so the classifier spans 0 (background) to the largest."""
        return max(self.coco.getCatIds()) + 1


def collate(batch):
    return tuple(zip(*batch))


def to_coco_results(image_id: int, prediction: dict) -> list[dict]:
    """A torchvision detector's output for one image as COCO result entries."""
    boxes = prediction["boxes"].detach().cpu().double()
    boxes[:, 2:] -= boxes[:, :2]  # XYXY -> XYWH
    entries = [{"image_id": image_id, "category_id": int(label), "bbox": [round(v, 2) for v in box],
                "score": float(score)}
               for box, label, score in zip(boxes.tolist(), prediction["labels"].tolist(),
                                            prediction["scores"].tolist())]
    if "masks" in prediction:
        binary = (prediction["masks"][:, 0] > 0.5).cpu().numpy().astype(np.uint8)
        rles = mask_utils.encode(np.asfortranarray(binary.transpose(1, 2, 0)))
        for entry, rle in zip(entries, rles):
            entry["segmentation"] = {"size": rle["size"], "counts": rle["counts"].decode("ascii")}
    return entries


def coco_evaluate(coco_gt, results: list[dict], iou_types=("bbox",)) -> dict[str, float]:
    """COCO AP (percent) per IoU type: ``bbox_AP``, ``bbox_AP50``, ..., ``segm_APl``.

    No detections at all score 0, as COCOeval would count them, rather than failing. Area
    ranges without ground truth (COCOeval's -1, e.g. no large objects) are left out.
    COCOeval rewrites ground-truth polygons as RLEs in place, so it gets a copy.
    """
    metrics = {}
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt, original = COCO(), coco_gt
        coco_gt.dataset = copy.deepcopy(original.dataset)
        coco_gt.createIndex()
    for iou_type in iou_types:
        if not results:
            metrics.update({f"{iou_type}_{name}": 0.0 for name in COCO_STATS})
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            evaluator = COCOeval(coco_gt, coco_gt.loadRes(results), iou_type)
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        metrics.update({f"{iou_type}_{name}": float(value) * 100
                        for name, value in zip(COCO_STATS, evaluator.stats) if value >= 0})
    return metrics
