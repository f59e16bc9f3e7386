"""unnorm: Unified Normalization and its baselines, framework-free.

    import unnorm
    norm = unnorm.build_norm("un", 384, window_size=4, outlier_filtration=True)
    unnorm.swap_norms(model, "un")            # every LayerNorm/RMSNorm -> UN
    unnorm.fold_into_linear(norm, [qkv])      # after model.eval(): offline norms, DyT's affine
    scaler = unnorm.GradScaler(model, "cuda")  # AMP loss scaling the norms do not see
    adapted = unnorm.test_time(model, "unmix")  # norms follow the test stream; adapted.close()
"""
from .amp import GradScaler, LossScaleGuard
from .base import ChannelNorm, GuardedNorm, OfflineNorm, StepCounted, UpdateStart
from .convert import (CompressedRMSNorm, center_writer, compress_readers, compress_writer,
                      convert_to_pre_crms, convert_to_pre_rms, to_compressed_rms_norm, to_rms_norm)
from .distributed import NORM_SYNC_MODES, check_norm_sync, distribute_norm_state, norm_state
from .bcn import BatchChannelNorm
from .dyt import DynamicTanh
from .estimated import EstimatedNorm
from .evonorm import EvoNormB0, EvoNormS0
from .groupnorm import GroupNorm
from .fold import (ChannelAffine, FoldedNorm, check_fold_plan, fold_by_plan, fold_into_linear,
                   fold_norms, to_affine)
from .gns import GNSRecorder, record_gns
from .mabn import MovingAverageBatchNorm
from .padmask import PadMaskFeed
from .powernorm import PowerNorm
from .prepbn import ProgressiveRepBN
from .registry import (available_norms, build_norm, default_options, has_running_state,
                       is_foldable, is_offline, norm_layer, option_names)
from .sample import LAYOUTS
from .scale_invariance import invariance_record, scale_invariance
from .scalenorm import ScaleNorm
from .signal import activation_statistics, signal_propagation
from .sepnorm import SeparateClassNorm, separate_class_norms
from .simple import BatchNorm, LayerNorm, NoNorm, RMSNorm
from .stats import StatisticsRecorder, record_statistics
from .swap import ChannelsFirst, replace_module, swap_norms
from .adapt import MODES as TEST_TIME_MODES, AdaptedNorms, test_time
from .unified import RELEASED_UN_NAMES, UnifiedNorm, convert_released_state_dict
from .ws import (EPS_FORMS, SCALED, ScaledStandardizedConv2d, ScaledStandardizedLinear,
                 StandardizedConv2d, StandardizedLinear, bake_standardized_weights,
                 standardize_weights)


def reset_steps(model) -> int:
    """Restart the step counters of UN, MABN and PN in ``model``: fine-tuning re-runs their
    warm-up, as released. PRepBN keeps its count (SLAB fine-tunes from the finished RepBN)."""
    counted = [m for m in model.modules() if isinstance(m, EstimatedNorm)]
    for module in counted:
        module.reset_step()
    return len(counted)


__all__ = [
    "available_norms", "build_norm", "is_offline", "is_foldable", "has_running_state", "norm_layer",
    "option_names", "default_options",
    "swap_norms", "distribute_norm_state", "check_norm_sync", "norm_state", "NORM_SYNC_MODES",
    "fold_into_linear", "fold_norms", "fold_by_plan", "check_fold_plan", "to_affine",
    "replace_module", "ChannelsFirst", "PadMaskFeed", "test_time", "AdaptedNorms", "TEST_TIME_MODES", "record_statistics", "record_gns", "reset_steps",
    "convert_released_state_dict", "RELEASED_UN_NAMES", "StatisticsRecorder", "GNSRecorder",
    "ChannelNorm", "OfflineNorm", "GuardedNorm", "StepCounted", "EstimatedNorm", "ChannelAffine", "FoldedNorm",
    "LayerNorm", "RMSNorm", "BatchNorm", "NoNorm", "MovingAverageBatchNorm", "PowerNorm",
    "UnifiedNorm", "DynamicTanh", "ProgressiveRepBN", "BatchChannelNorm", "EvoNormB0", "EvoNormS0",
    "ScaleNorm", "GroupNorm",
    "SeparateClassNorm", "separate_class_norms", "LAYOUTS", "standardize_weights",
    "scale_invariance", "invariance_record", "signal_propagation", "activation_statistics",
    "bake_standardized_weights", "StandardizedLinear", "StandardizedConv2d", "EPS_FORMS", "SCALED",
    "ScaledStandardizedLinear", "ScaledStandardizedConv2d", "GradScaler", "LossScaleGuard", "UpdateStart",
    "CompressedRMSNorm", "convert_to_pre_rms", "convert_to_pre_crms", "center_writer",
    "compress_writer", "compress_readers", "to_rms_norm", "to_compressed_rms_norm",
]
__version__ = "0.1.0"
