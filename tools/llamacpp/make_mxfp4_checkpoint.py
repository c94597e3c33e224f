"""Writes tiny-gpt-oss as the published gpt-oss checkpoints are stored:
its experts in MXFP4 (`*_blocks` and `*_scales`, Hugging Face's layout,
`quantization_config.quant_method: mxfp4`), everything else as it is.

    python make_mxfp4_checkpoint.py tests/models/tiny-gpt-oss OUT_DIR

The codes come from GGML's MXFP4 quantizer (`quantize_row_mxfp4_ref`: the
exponent puts the block's largest magnitude in [4, 8) of the E2M1 grid
doubled, each weight takes the nearest value, the first on ties), written
in Hugging Face's order: byte j of a 32-weight block holds weight 2j in its
low nibble and weight 2j + 1 in its high nibble; rows are output features
(gate and up interleaved, as the stacked weight's columns are). Needs numpy
and safetensors.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

# GGML's kvalues_mxfp4: each E2M1 code's value, doubled.
VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def e8m0_half(e):
    """2^(e - 128) as f32, GGML_E8M0_TO_FP32_HALF."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32)
    return bits.view(np.float32)


def quantize(w):
    """[..., rows, cols] f32 -> (blocks [..., rows, cols/32, 16] u8, scales [..., rows, cols/32] u8)."""
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    d = e8m0_half(e)[..., None]
    # The nearest grid value, the first of equals (argmin's rule).
    err = np.abs(VALUES[None] * d[..., None] - blocks[..., None])
    idx = err.argmin(axis=-1).astype(np.uint8)
    packed = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return packed, e


def main():
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    result = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            # Stored [experts, in, out] for x @ W; MXFP4 rows are outputs.
            blocks, scales = quantize(np.ascontiguousarray(np.swapaxes(t, 1, 2)))
            result[name + "_blocks"] = blocks
            result[name + "_scales"] = scales
        else:
            result[name] = t
    save_file(result, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)


if __name__ == "__main__":
    main()
