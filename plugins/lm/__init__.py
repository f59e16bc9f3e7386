"""Language-model adapter: Hugging Face transformers' Llama with any unnorm norm at every norm
site, in Pre-, Post-, Peri- or Mix-LN placement (``build_lm``). Importing it registers the
model (``UnnormLlamaConfig``, ``model_type`` ``"unnorm_llama"``) with ``AutoConfig`` and
``AutoModelForCausalLM``, so ``from_pretrained`` loads what ``save_pretrained`` wrote
(``plugins.lm.export``: a trained run as a Hugging Face checkpoint)."""
from .model import (PLACEMENTS, PlacedDecoderLayer, UnnormLlamaConfig, UnnormLlamaForCausalLM,
                    build_lm, dyt_llm_alphas, layer_placements)

__all__ = ["PLACEMENTS", "PlacedDecoderLayer", "UnnormLlamaConfig", "UnnormLlamaForCausalLM",
           "build_lm", "dyt_llm_alphas", "layer_placements"]
