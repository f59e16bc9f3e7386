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

``UnnormSwinTransformer`` is mmdet's ``SwinTransformer`` with PN_LS grouped as in our timm
Swin: ``group_num=None`` (the release's grouping: the number of attention heads of the block
that holds the norm) resolved per stage, and patch merging's channels grouped in timm's order.
"""
from __future__ import annotations

import re

import torch
from mmdet.models.backbones import SwinTransformer
from mmdet.registry import MODELS as MMDET_MODELS
from mmengine.registry import MODELS

import unnorm
from unnorm.sample import SampleStatistics

from .convert import convert_checkpoint, timm_to_mmdet, unfold_order

_NAMED = {"ln": "UnnormLN", "rms": "RMS", "bn": "UnnormBN", "mabn": "MABN", "pn": "PN",
          "pn_ls": "PN_LS", "nonorm": "NoNorm", "un": "UN", "dyt": "DyT", "prepbn": "PRepBN",
          "bcn": "BCN", "evonorm_b0": "EvoNormB0", "evonorm_s0": "EvoNormS0"}
#: each registry norm's ``norm_cfg`` type: as named above, or its module's class name
MMDET_NAMES = {name: _NAMED.get(name) or type(unnorm.build_norm(name, 8)).__name__
               for name in unnorm.available_norms()}
if len(set(MMDET_NAMES.values())) < len(MMDET_NAMES):
    raise ValueError(f"two registry norms would share an mmdet type name ({MMDET_NAMES}): name "
                     "them in plugins/mmdet/__init__.py's _NAMED")


def _registered_norm(name: str) -> type:
    """A class standing for one norm in the registry: constructing it builds ours."""

    def __new__(cls, num_features: int, **options):
        if "eps" not in unnorm.option_names(name):
            options.pop("eps", None)  # build_norm_layer injects eps into every norm
        if "group_num" in options and options["group_num"] is None:
            raise ValueError(f"{MMDET_NAMES[name]} with group_num=None groups by the attention "
                             "heads of the block holding the norm, which only the backbone "
                             "knows: use type='UnnormSwinTransformer' for the backbone, or give "
                             "group_num an int")
        return unnorm.build_norm(name, num_features, **options)

    return type(MMDET_NAMES[name], (), {"__new__": __new__, "_abbr_": name,
                                        "__doc__": f"unnorm's {name} for mmcv's build_norm_layer"})


for _name, _mm_name in MMDET_NAMES.items():  # force: re-importing the plugin is harmless
    MODELS.register_module(name=_mm_name, module=_registered_norm(_name), force=True)


def swin_stage(name: str) -> int:
    """The stage whose attention heads group a norm of mmdet's Swin, by the norm's name.

    A patch merging counts with the stage after it, where timm's Swin (our ImageNet runs)
    holds it; mmdet keeps it at the end of the stage before."""
    if name == "patch_embed.norm":
        return 0
    merging = re.fullmatch(r"stages\.(\d+)\.downsample\.norm", name)
    if merging:
        return int(merging.group(1)) + 1
    found = re.fullmatch(r"stages\.(\d+)\.blocks\.\d+\.norm\d|norm(\d+)", name)
    if not found:
        raise ValueError(f"{name} is not a norm of mmdet's SwinTransformer")
    return int(found.group(1) or found.group(2))


class UnfoldOrderPowerNorm(unnorm.PowerNorm):
    """PN_LS of mmdet's patch merging: its 4C channels come in ``nn.Unfold``'s order
    (c*4 + k), and its layer-scale groups them as timm's Swin does, in the concatenation
    order (k*C + c), so that a converted ImageNet norm computes what it computed there."""

    def __init__(self, num_features: int, **options):
        super().__init__(num_features, **options)
        timm_channel = unfold_order(torch.arange(num_features), 0)  # of each unfold position
        self.register_buffer("to_timm", torch.argsort(timm_channel), persistent=False)
        self.register_buffer("to_unfold", timm_channel, persistent=False)

    def _group_scale(self, rows: torch.Tensor) -> torch.Tensor:
        return super()._group_scale(rows[:, self.to_timm])[:, self.to_unfold]


@MMDET_MODELS.register_module(force=True)
class UnnormSwinTransformer(SwinTransformer):
    """mmdet's ``SwinTransformer`` with PN_LS grouped as in our timm Swin: ``group_num=None``
    is the number of attention heads of each norm's stage (``num_heads``), an int forces one
    value, and a patch merging's norm groups its channels in timm's order (PN_LS's
    layer-scale, BCN's and EvoNorm's channel groups)."""

    def __init__(self, *, num_heads=(3, 6, 12, 24), norm_cfg=dict(type="LN"), **kwargs):
        per_stage = "group_num" in norm_cfg and norm_cfg["group_num"] is None
        super().__init__(num_heads=num_heads, **kwargs,
                         norm_cfg={**norm_cfg, "group_num": 1} if per_stage else norm_cfg)
        options = {key: value for key, value in norm_cfg.items() if key != "type"}
        for name, module in list(self.named_modules()):
            if isinstance(module, SampleStatistics) and name.endswith("downsample.norm"):
                module.group_channels_as(unfold_order(torch.arange(module.num_features), 0))
            if isinstance(module, unnorm.PowerNorm) and module.layer_scale:
                groups = num_heads[swin_stage(name)] if per_stage else module.group_num
                merging = name.endswith("downsample.norm")
                build = UnfoldOrderPowerNorm if merging else unnorm.PowerNorm
                unnorm.replace_module(self, name, build(
                    module.num_features, **{**options, "eps": module.eps, "layer_scale": True,
                                            "group_num": groups}))


def norm_cfg(name: str, **options) -> dict:
    """The mmdet ``norm_cfg`` dict of one of our norms, e.g. ``norm_cfg('un', window_size=4)``."""
    unnorm.norm_layer(name, **options)  # checks the name and the options now
    return {"type": MMDET_NAMES[name.lower()], **options}


__all__ = ["MMDET_NAMES", "UnfoldOrderPowerNorm", "UnnormSwinTransformer", "convert_checkpoint",
           "norm_cfg", "swin_stage", "timm_to_mmdet"]
