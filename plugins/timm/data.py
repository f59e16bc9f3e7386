"""Image classification data: ImageNet folders, CIFAR pickles, and embedded digits for CPU runs."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from timm.data import create_transform
from torchvision import datasets, transforms

DIGITS_SPLIT_SEED = 0


class DigitsDataset(torch.utils.data.Dataset):
    """scikit-learn's 8x8 handwritten digits, upscaled to RGB ``img_size`` PIL images.

    Real data that ships inside an installed package: 1797 images of 10 classes, split
    80/20 (stratified, fixed seed) into train and val.
    """

    def __init__(self, train: bool, img_size: int, transform=None):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        indices = np.arange(len(digits.target))
        train_idx, val_idx = train_test_split(indices, test_size=0.2, stratify=digits.target,
                                              random_state=DIGITS_SPLIT_SEED)
        chosen = train_idx if train else val_idx
        pixels = (digits.images[chosen] * (255.0 / 16.0)).round().astype(np.uint8)
        self.images = [Image.fromarray(p, mode="L").resize((img_size, img_size), Image.BILINEAR)
                       .convert("RGB") for p in pixels]
        self.targets = digits.target[chosen].tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index):
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


def build_transforms(data_cfg, aug_cfg, img_size: int):
    """Training and evaluation transforms: timm's pipeline, or the CIFAR crop+flip one."""
    mean, std = tuple(data_cfg.mean), tuple(data_cfg.std)
    if aug_cfg.kind == "timm":
        train = create_transform(img_size, is_training=True, auto_augment=aug_cfg.auto_augment,
                                 re_prob=aug_cfg.re_prob, color_jitter=aug_cfg.color_jitter,
                                 interpolation=aug_cfg.interpolation, mean=mean, std=std)
        val = create_transform(img_size, is_training=False, crop_pct=data_cfg.crop_pct,
                               interpolation=aug_cfg.interpolation, mean=mean, std=std)
        return train, val
    if aug_cfg.kind == "crop_flip":
        normalize = [transforms.ToTensor(), transforms.Normalize(mean, std)]
        train = transforms.Compose([transforms.Resize(img_size),
                                    transforms.RandomCrop(img_size, padding=img_size // 8),
                                    transforms.RandomHorizontalFlip(), *normalize])
        val = transforms.Compose([transforms.Resize(img_size), *normalize])
        return train, val
    raise ValueError(f"unknown aug.kind {aug_cfg.kind!r}; choose timm or crop_flip")


def _require(path: Path, what: str, fix: str) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found at {path.resolve()}: {fix}")


def build_datasets(data_cfg, aug_cfg, img_size: int):
    """(train, val) datasets for ``data_cfg.name``."""
    train_tf, val_tf = build_transforms(data_cfg, aug_cfg, img_size)
    name = data_cfg.name
    if name == "digits":
        return DigitsDataset(True, img_size, train_tf), DigitsDataset(False, img_size, val_tf)
    root = Path(str(data_cfg.root))
    if name == "imagenet":
        for split in ("train", "val"):
            _require(root / split, f"ImageNet {split} split",
                     "expected <root>/train/<class>/*.JPEG and <root>/val/<class>/*.JPEG; "
                     "set data.root=... or IMAGENET_ROOT")
        return (datasets.ImageFolder(str(root / "train"), train_tf),
                datasets.ImageFolder(str(root / "val"), val_tf))
    if name in ("cifar10", "cifar100"):
        folder = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
        _require(root / folder, f"{name.upper()} (python pickles)",
                 f"download and unpack {folder}/ into it; set data.root=... or CIFAR_ROOT")
        cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
        return (cls(str(root), train=True, transform=train_tf, download=False),
                cls(str(root), train=False, transform=val_tf, download=False))
    raise ValueError(f"unknown dataset {name!r}; choose imagenet, cifar10, cifar100 or digits")
