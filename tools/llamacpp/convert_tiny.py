"""Runs llama.cpp's own `convert_hf_to_gguf.py` on a tiny test model.

The tiny models in tests/models share one byte-fallback (SentencePiece
style) vocabulary. llama.cpp's converter reads it as such for Llama, Qwen3
and Gemma 3, but its gpt-oss, GLM-4.5 and Qwen3-MoE classes only know the
byte-level BPE vocabularies of the published checkpoints, and refuse one
whose pre-tokenizer hash they do not know. For those classes this sends the
vocabulary down the converter's SentencePiece path, as for the others; the
weights and the model metadata go through the converter untouched.

llama.cpp's Gemma 3 converter writes neither which layers slide (llama.cpp
then takes every 6th layer as global) nor `query_pre_attn_scalar` (it then
scales queries by 1/sqrt(head_dim)): right for the published Gemma 3 models,
not for tiny-gemma3, which differs from both on purpose. For Gemma 3 this
adds llama.cpp's own keys for them, `gemma3.attention.sliding_window_pattern`
(a flag per layer, as llama.cpp's converters write it for other families)
and `gemma3.attention.scale`.

    LLAMA_CPP=/path/to/llama.cpp python convert_tiny.py MODEL_DIR OUT.gguf [--outtype f32]

Needs torch, numpy, sentencepiece and safetensors (pip), and llama.cpp's
source: the llama-cpp-python 0.3.36 sdist, vendor/llama.cpp.
"""

import importlib
import os
import sys
from pathlib import Path

llama_cpp = Path(os.environ["LLAMA_CPP"])
sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]

import convert_hf_to_gguf  # noqa: E402
from conversion import base  # noqa: E402


def sentencepiece_first(original):
    def set_vocab(self):
        if (self.dir_model / "tokenizer.model").is_file():
            self._set_vocab_sentencepiece()
        else:
            original(self)

    return set_vocab


for name in ("_set_vocab_gpt2", "_set_vocab_glm"):
    setattr(base.TextModel, name, sentencepiece_first(getattr(base.TextModel, name)))

def gemma3_parameters(original):
    def set_gguf_parameters(self):
        original(self)
        hparams = self.hparams
        if "layer_types" in hparams:
            self.gguf_writer.add_sliding_window_pattern([t == "sliding_attention" for t in hparams["layer_types"]])
        head_dim = hparams.get("head_dim", 256)
        scalar = hparams.get("query_pre_attn_scalar", head_dim)
        if scalar != head_dim:
            self.gguf_writer.add_attention_scale(scalar**-0.5)

    return set_gguf_parameters


gemma = importlib.import_module("conversion.gemma").Gemma3Model
gemma.set_gguf_parameters = gemma3_parameters(gemma.set_gguf_parameters)

if __name__ == "__main__":
    model, out, *rest = sys.argv[1:]
    sys.argv = [sys.argv[0], model, "--outfile", out, *(rest or ["--outtype", "f32"])]
    convert_hf_to_gguf.main()
