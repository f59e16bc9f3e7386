"""unnorm: Unified Normalization and its baselines, framework-free.

    import unnorm
    norm = unnorm.build_norm("un", 384, window_size=4, outlier_filtration=True)
    unnorm.swap_norms(model, "un")            # every LayerNorm -> UN
    unnorm.fold_into_linear(norm, [qkv])      # after model.eval(), for offline norms
"""
from .base import ChannelNorm, OfflineNorm
from .estimated import EstimatedNorm
from .fold import ChannelAffine, FoldedNorm, fold_into_linear, fold_norms, to_affine
from .mabn import MovingAverageBatchNorm
from .powernorm import PowerNorm
from .registry import available_norms, build_norm, is_offline, norm_layer, norm_options
from .simple import BatchNorm, LayerNorm, NoNorm, RMSNorm
from .stats import StatisticsRecorder, record_statistics
from .swap import replace_module, swap_norms
from .unified import RELEASED_UN_NAMES, UnifiedNorm, convert_released_state_dict


def reset_steps(model) -> int:
    """Restart every step counter in ``model`` (fine-tuning re-runs warm-up, as released)."""
    counted = [m for m in model.modules() if isinstance(m, EstimatedNorm)]
    for module in counted:
        module.reset_step()
    return len(counted)


__all__ = [
    "available_norms", "build_norm", "is_offline", "norm_layer", "norm_options", "swap_norms",
    "fold_into_linear", "fold_norms", "to_affine", "replace_module", "record_statistics", "reset_steps",
    "convert_released_state_dict", "RELEASED_UN_NAMES", "StatisticsRecorder",
    "ChannelNorm", "OfflineNorm", "EstimatedNorm", "ChannelAffine", "FoldedNorm",
    "LayerNorm", "RMSNorm", "BatchNorm", "NoNorm", "MovingAverageBatchNorm", "PowerNorm",
    "UnifiedNorm",
]
__version__ = "0.1.0"
