"""timm adapter: registers T2T-ViT with timm and builds timm models with any unnorm norm."""
from . import t2t_vit  # noqa: F401  (registers t2t_vit_* with timm)
from .models import create_classifier, fold_model, fold_plan, model_from_config

__all__ = ["create_classifier", "fold_model", "fold_plan", "model_from_config"]
