"""`python -m bench.gpu_models TOKENIZER_DIR OUT_DIR`: the two randomly initialised Llama
checkpoints the GPU check (bench/gpu_check.sh) serves, built from configs on the spot (no
model can be downloaded on the GPU machine, and a real one is too large to carry there):

- `small`: 4 layers of 256, float32, untied: the oracle tests' model (tests/test_cuda.py);
- `llama-1b`: Llama-3.2-1B's shape (16 layers of 2048, 32 query / 8 KV heads of 64,
  MLP 8192, tied embeddings, Llama 3's rope scaling), bfloat16, except its vocabulary: the
  tokenizer at hand (SmolLM2's) has 49,152 tokens, not Llama 3's 128,256, so the embedding
  is 100M parameters instead of 263M (1.07B parameters in all, against 1.24B).

Both carry the tokenizer of TOKENIZER_DIR. `--device cuda` initialises on the GPU (seconds
for the 1B model; minutes on a CPU).
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")

SMALL = dict(vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
             tie_word_embeddings=False, rope_theta=10000.0, initializer_range=0.1)
LLAMA_1B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
                rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
SHAPES = {"small": (SMALL, torch.float32), "llama-1b": (LLAMA_1B, torch.bfloat16)}


def build(name: str, out_dir: str, tokenizer_dir: str, device: str, seed: int = 0,
          **overrides) -> str:
    shape, dtype = SHAPES[name]
    config = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                      **{**shape, **overrides})
    target = os.path.join(out_dir, name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(target, safe_serialization=True)
    for file in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, file)
        if os.path.exists(src):
            shutil.copy(src, target)
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tokenizer_dir")
    p.add_argument("out_dir")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", choices=sorted(SHAPES), nargs="+", default=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None,
                   help="fewer layers for the 1B shape (a dry run on a CPU)")
    args = p.parse_args()
    for name in args.only:
        extra = {"num_hidden_layers": args.layers} if args.layers and name == "llama-1b" else {}
        print(build(name, args.out_dir, args.tokenizer_dir, args.device, **extra), flush=True)


if __name__ == "__main__":
    main()
