"""Export a trained language model as a Hugging Face checkpoint (a save_pretrained folder).

    python scripts/export_hf.py runs/llama_71m_un-cpu/<time>                 # writes hf/ in the run
    python scripts/export_hf.py runs/llama_71m_rms-cpu/<time> --stock --out llama_rms

The folder holds the model (config.json, model.safetensors, generation_config.json) and, when
the run's prepared data is still there, its tokenizer. Without --stock it is an
UnnormLlamaForCausalLM with every norm and its running state (model_type unnorm_llama), which

    import plugins.lm  # registers unnorm_llama with AutoConfig and AutoModelForCausalLM
    model = transformers.AutoModelForCausalLM.from_pretrained("llama_un")

loads. --stock writes transformers' own LlamaForCausalLM (model_type llama), which loads
without this project; only a Pre-RMSNorm model (norm=rms, model.norm_position=pre) is one, and
anything else is refused, naming each setting that is not stock. Either way the folder is
loaded back and its logits checked against the run's model (plugins/lm/export.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.lm.export import export_run  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a language-modelling run directory or its last.pt")
    parser.add_argument("--out", type=Path, default=None,
                        help="the folder to write (default: hf/ in the run directory)")
    parser.add_argument("--stock", action="store_true",
                        help="write transformers' own LlamaForCausalLM (Pre-RMSNorm runs only)")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="leave the run's tokenizer out of the folder")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle anything the checkpoint holds (it can run code): only for "
                             "files you made or trust; by default only tensors and plain data load")
    args = parser.parse_args(argv)
    try:
        summary = export_run(args.run, args.out, stock=args.stock,
                             tokenizer=not args.no_tokenizer, trusted=args.trust_checkpoint)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"export_hf: {error}")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
