"""mmdetection adapter: every unnorm norm in OpenMMLab's ``MODELS`` registry.

Load it from a config with ``custom_imports = dict(imports=['plugins.mmdet'])`` and write
``norm_cfg=dict(type='UN', window_size=4, ...)``. mmcv's own ``LN`` and ``BN`` keep their
meaning (``nn.LayerNorm``; ``BatchNorm2d`` over NCHW maps, as ResNets need); ours are
``UnnormLN`` and ``UnnormBN`` (statistics over batch x tokens, as in the paper).

``build_norm_layer`` injects ``eps`` and calls ``cls(num_features, **cfg)``; the classes here
hand that to ``unnorm.build_norm``, so unknown options fail with the list of valid ones.
The layers' parameters are named ``weight`` and ``bias``, and mmdet's Swin names them
``norm1``, ``norm2``, ``norm{i}``: its non-strict pretrained load and the configs' name-based
``custom_keys={'norm': dict(decay_mult=0.)}`` apply to ours as to LayerNorm.
"""
from __future__ import annotations

from mmengine.registry import MODELS

import unnorm

from .convert import timm_to_mmdet

MMDET_NAMES = {"ln": "UnnormLN", "rms": "RMS", "bn": "UnnormBN", "mabn": "MABN", "pn": "PN",
               "pn_ls": "PN_LS", "nonorm": "NoNorm", "un": "UN", "dyt": "DyT", "prepbn": "PRepBN"}


def _registered_norm(name: str) -> type:
    """A class standing for one norm in the registry: constructing it builds ours."""

    def __new__(cls, num_features: int, **options):
        if "eps" not in unnorm.norm_options(name):
            options.pop("eps", None)  # build_norm_layer injects eps into every norm
        return unnorm.build_norm(name, num_features, **options)

    return type(MMDET_NAMES[name], (), {"__new__": __new__, "_abbr_": name,
                                        "__doc__": f"unnorm's {name} for mmcv's build_norm_layer"})


for _name, _mm_name in MMDET_NAMES.items():  # force: re-importing the plugin is harmless
    MODELS.register_module(name=_mm_name, module=_registered_norm(_name), force=True)


def norm_cfg(name: str, **options) -> dict:
    """The mmdet ``norm_cfg`` dict of one of our norms, e.g. ``norm_cfg('un', window_size=4)``."""
    unnorm.norm_layer(name, **options)  # checks the name and the options now
    return {"type": MMDET_NAMES[name.lower()], **options}


__all__ = ["MMDET_NAMES", "norm_cfg", "timm_to_mmdet"]
