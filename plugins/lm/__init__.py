"""Language-model adapter: Hugging Face transformers' Llama with any unnorm norm at every norm
site, in Pre-, Post-, Peri- or Mix-LN placement (``build_lm``)."""
from .model import PLACEMENTS, PlacedDecoderLayer, build_lm, dyt_llm_alphas, layer_placements

__all__ = ["PLACEMENTS", "PlacedDecoderLayer", "build_lm", "dyt_llm_alphas", "layer_placements"]
