"""The synthetic checkpoint's option values and the ``synth`` command's arguments, torch-free.

``python -m harness`` builds its whole parser on every run, so a bad flag or a missing file
gets its one-line answer (exit 2) without importing torch; the modules that write and read
checkpoints (``names``, ``quant``, ``synth``) take these tuples from here.
"""

from __future__ import annotations

import argparse

NAMINGS = ("mtp_layers", "layers")
EXPERT_LAYOUTS = ("split", "fused")
QUANTS = ("bf16", "fp8", "fp8-ue8m0", "modelopt-fp8-pb", "compressed-tensors-fp8", "compressed-tensors-fp8-block")
# quant -> the quantization_config it writes (README "Real checkpoints and quantization configs")
QUANT_FORMATS = {
    "bf16": "mtp_quant_algo BF16, no quantization_config",
    "fp8": "mtp_quant_algo FP8 + Fp8Config (quant_method fp8, 128x128 blocks, modules_to_not_convert)",
    "fp8-ue8m0": "as fp8 with scale_fmt ue8m0 (power-of-two scales)",
    "modelopt-fp8-pb": ("no mtp_quant_algo (the MTP layers inherit the backbone's config) + ModelOpt "
                        "(quant_method modelopt, quant_algo FP8_PB_WO: 128x128 block weights, 4-D "
                        "weight_scale) with exclude_modules (exact names and wildcards)"),
    "compressed-tensors-fp8": ("no mtp_quant_algo + compressed-tensors (quant_method compressed-tensors, format "
                               "float-quantized): channel FP8 weights (float32 weight_scale [out, 1]), dynamic "
                               "per-token FP8 activations, with an ignore list (exact names and re: patterns)"),
    "compressed-tensors-fp8-block": ("as compressed-tensors-fp8 with block weights (block_structure [128, 128], "
                                     "weight_scale [ceil(out/128), ceil(in/128)]) and dynamic per-token-group "
                                     "(128) activations"),
}
SCALE_DTYPES = ("auto", "uint8", "float32", "e8m0")
EXPERT_SCALE_SUFFIXES = ("weight_scale_inv", "scale")
PRESET_NAMES = ("tiny", "small", "real-dims")
# compressed-tensors quants -> their weight strategy
CT_QUANTS = {"compressed-tensors-fp8": "channel", "compressed-tensors-fp8-block": "block"}
CT_IGNORE_STYLES = ("regex", "checkpoint-names")


def add_synth_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="checkpoint directory to create")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny", help="model dimensions (harness.presets)")
    parser.add_argument("--experts", choices=EXPERT_LAYOUTS, default="split",
                        help="routed experts one tensor per expert (split) or stacked (fused)")
    parser.add_argument("--quant", choices=QUANTS, default="bf16",
                        help="checkpoint quantization (the config each writes: README, quantization configs)")
    parser.add_argument("--naming", choices=NAMINGS, default="mtp_layers",
                        help="model.mtp_layers.<i> or model.layers.<num_hidden_layers+i>")
    parser.add_argument("--mtp-layers", type=int, default=1, help="num_nextn_predict_layers")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    parser.add_argument("--shards", type=int, default=1, help="safetensors files to split the tensors over")
    parser.add_argument("--no-index", action="store_true",
                        help="write one model.safetensors and no index (needs --shards 1)")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocab_size")
    parser.add_argument("--index-share", action="store_true", help="index_share_for_mtp_iteration: true")
    parser.add_argument("--dense-mlp", action="store_true", help="the MTP layer's MLP is dense, not MoE")
    parser.add_argument("--headwise-gate", action="store_true", help="gating_type headwise")
    parser.add_argument("--no-sink", action="store_true", help="learnable_sink: false")
    parser.add_argument("--expert-scale-suffix", choices=EXPERT_SCALE_SUFFIXES, default="weight_scale_inv",
                        help="FP8 expert scale names: .weight_scale_inv (fused: _scale_inv) or .scale")
    parser.add_argument("--scale-dtype", choices=SCALE_DTYPES, default="auto",
                        help="UE8M0 scale storage (see write_synthetic)")
    parser.add_argument("--bf16-mtp-layer", type=int, action="append", default=[], metavar="I",
                        help="modelopt-fp8-pb: keep MTP layer I wholly in bf16 (exclude_modules "
                             "'<layer prefix>.*'; repeatable)")
    parser.add_argument("--bf16-indexer-wk", action="store_true",
                        help="keep the indexer wk in bf16 in FP8 checkpoints (default: FP8 + weight_scale_inv)")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty OUT_DIR, only one the harness wrote (its .hyv4-harness-written.json "
                        "lists every file in it; anything else there is refused, exit 2)")
    parser.add_argument("--ct-ignore", choices=CT_IGNORE_STYLES, default="regex",
                        help="compressed-tensors: how the ignore list names the MTP modules kept bf16: 'regex' "
                             "(re: patterns matching any layer prefix, as llm-compressor writes them) or "
                             "'checkpoint-names' (exact checkpoint-named entries and a checkpoint-named re: "
                             "pattern for the routed experts)")
