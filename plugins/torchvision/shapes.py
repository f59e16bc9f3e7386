"""A small COCO-format instance-segmentation set generated on the spot: coloured circles,
squares and triangles on textured backgrounds, for detection runs without COCO.

Colours are drawn independently of the class, so only shape tells the classes apart; the
backgrounds mix smooth colour noise and faint stripes, so a box must be earned. Objects do
not overlap, so each polygon is exactly the visible instance. The output is what COCO ships:
``<root>/{train,val}/*.png`` and ``<root>/annotations/instances_{train,val}.json`` (polygon
segmentations), readable by pycocotools, torchvision and mmdetection alike.

    python -m plugins.torchvision.shapes data/shapes [--train 512 --val 128 --size 128]
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from pycocotools import mask as mask_utils

from plugins.generated import MANIFEST, generating, verify_manifest, write_manifest

CATEGORIES = [{"id": 1, "name": "circle", "supercategory": "shape"},
              {"id": 2, "name": "square", "supercategory": "shape"},
              {"id": 3, "name": "triangle", "supercategory": "shape"}]
VERSION = 1  # bump when the generator's output changes


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """Smooth colour noise plus faint stripes at a random angle, as float RGB in [0, 255]."""
    coarse = rng.uniform(40, 215, size=(4, 4, 3)).astype(np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((size, size), Image.BICUBIC), np.float32)
    y, x = np.mgrid[0:size, 0:size]
    angle, period = rng.uniform(0, math.pi), rng.uniform(6, 24)
    stripes = np.sin((x * math.cos(angle) + y * math.sin(angle)) * 2 * math.pi / period)
    texture = smooth + rng.uniform(5, 25) * stripes[..., None] + rng.normal(0, 6, (size, size, 3))
    return np.clip(texture, 0, 255)


def _polygon(category: int, cx: float, cy: float, radius: float, angle: float) -> list[float]:
    """The shape's outline as a flat COCO polygon [x0, y0, x1, y1, ...]."""
    corners = {1: 24, 2: 4, 3: 3}[category]
    points = []
    for k in range(corners):
        theta = angle + 2 * math.pi * k / corners
        points += [cx + radius * math.cos(theta), cy + radius * math.sin(theta)]
    return [round(v, 2) for v in points]


def _colour_apart(rng: np.random.Generator, background: np.ndarray) -> tuple[int, ...]:
    """A random colour at least 80 (RGB distance) from the local background."""
    reference = background.reshape(-1, 3).mean(0)
    for _ in range(100):
        colour = rng.integers(0, 256, 3)
        if np.linalg.norm(colour - reference) > 80:
            break
    return tuple(int(c) for c in colour)


def render_image(rng: np.random.Generator, size: int) -> tuple[Image.Image, list[dict]]:
    """One image and its instances (category, polygon, bbox) with 1-5 non-overlapping shapes."""
    pixels = _background(rng, size)
    image = Image.fromarray(pixels.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    placed: list[tuple[float, float, float]] = []
    instances = []
    for _ in range(int(rng.integers(1, 6))):
        for _attempt in range(50):
            radius = rng.uniform(0.05, 0.22) * size
            cx, cy = rng.uniform(radius, size - radius, 2)
            if all(math.hypot(cx - x, cy - y) > radius + r + 2 for x, y, r in placed):
                break
        else:
            continue
        placed.append((cx, cy, radius))
        category = int(rng.integers(1, len(CATEGORIES) + 1))
        polygon = _polygon(category, cx, cy, radius, rng.uniform(0, 2 * math.pi))
        left, top = max(0, int(cx - radius)), max(0, int(cy - radius))
        patch = pixels[top:int(cy + radius) + 1, left:int(cx + radius) + 1]
        draw.polygon(polygon, fill=_colour_apart(rng, patch))
        xs, ys = polygon[0::2], polygon[1::2]
        instances.append({"category_id": category, "segmentation": [polygon],
                          "bbox": [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)]})
    return image, instances


def generate_split(root: Path, split: str, count: int, size: int, seed: int) -> Path:
    """Write ``count`` images and their annotation file; returns the annotation path."""
    rng = np.random.default_rng([seed, {"train": 0, "val": 1}[split]])
    (root / split).mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    images, annotations = [], []
    for image_id in range(1, count + 1):
        image, instances = render_image(rng, size)
        file_name = f"{image_id:06d}.png"
        image.save(root / split / file_name)
        images.append({"id": image_id, "file_name": file_name, "width": size, "height": size})
        for instance in instances:
            rle = mask_utils.merge(mask_utils.frPyObjects(instance["segmentation"], size, size))
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "iscrowd": 0,
                                "area": float(mask_utils.area(rle)), **instance})
    path = root / "annotations" / f"instances_{split}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"info": {"description": "unnorm generated shapes",
                                        "version": VERSION, "seed": seed},
                               "images": images, "annotations": annotations,
                               "categories": CATEGORIES}))
    os.replace(tmp, path)  # the annotation file last and atomically: its presence means done
    return path


def ensure_shapes(root: Path, num_train: int, num_val: int, size: int, seed: int = 0) -> Path:
    """Generate the set at ``root`` unless this exact set (sizes, seed, version) is there,
    complete (its manifest written last); a set that is there is verified against its
    manifest (``verify_manifest``)."""
    wanted = {"train": num_train, "val": num_val}
    with generating(root) as root:
        stale = [split for split, count in wanted.items()
                 if not _generated(root, split, count, size, seed)]
        if not stale and (root / MANIFEST).exists():
            verify_manifest(root, f"rm -r {root} (the next run generates it again)")
            return root
        for split in stale or wanted:
            generate_split(root, split, wanted[split], size, seed)
        write_manifest(root)
    return root


def _generated(root: Path, split: str, count: int, size: int, seed: int) -> bool:
    """Whether the annotations of ``split`` at ``root`` are of this exact set."""
    path = root / "annotations" / f"instances_{split}.json"
    if not path.exists():
        return False
    info = json.loads(path.read_text())
    return (len(info["images"]) == count and info["info"].get("seed") == seed
            and info["info"].get("version") == VERSION and info["images"][0]["width"] == size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--val", type=int, default=128)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ensure_shapes(args.root, args.train, args.val, args.size, args.seed)
    print(f"wrote {args.train} train and {args.val} val images to {args.root}")


if __name__ == "__main__":
    main()
