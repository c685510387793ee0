"""A randomly initialised Idefics3 (SmolVLM) checkpoint with the real SmolLM2 tokenizer plus
SmolVLM's image tokens and chat template: no vision weights exist offline.

Two sizes. "tiny", for the tests: 64 px tiles of 16 px patches, pixel shuffle 2 (4 tokens a
tile), images scaled to a 128 px longest edge (up to 2 x 2 tiles plus the whole), a 2-layer
Llama of width 64. "small", for bench/vision.py: 256 px tiles, pixel shuffle 4 (16 tokens a
tile), a 512 px longest edge (a 512 x 512 image is 2 x 2 tiles plus the whole: 80 image
tokens), a 6-layer SigLIP of width 384 and a 12-layer Llama of width 576 (SmolLM2-135M's
width): big enough that encoding an image costs something, small enough to build in seconds.
Shared by tests/test_vision.py and bench/vision.py.
"""

from __future__ import annotations

# SmolVLM's chat template: content parts, an <image> token where each image goes.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

SIZES = {
    "tiny": dict(
        longest_edge=128, tile=64, image_seq_len=4, scale_factor=2,
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, patch_size=16),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)),
    "small": dict(
        longest_edge=512, tile=256, image_seq_len=16, scale_factor=4,
        vision=dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                    num_attention_heads=6, patch_size=16),
        text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=12,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)),
}


def make_tiny_idefics3(target: str, tokenizer_dir: str, size: str = "tiny") -> str:
    """The checkpoint (weights, processor, tokenizer) written to `target`; seeded."""
    import torch
    import transformers

    s = SIZES[size]
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(IMAGE_TOKENS, special_tokens=True)
    # Images are scaled to the longest edge, then cut into tiles of `tile` px plus the whole.
    images = transformers.Idefics3ImageProcessor(size={"longest_edge": s["longest_edge"]},
                                                 max_image_size={"longest_edge": s["tile"]})
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tok,
                                               image_seq_len=s["image_seq_len"],
                                               chat_template=SMOLVLM_TEMPLATE)
    config = transformers.Idefics3Config(
        vision_config=dict(image_size=s["tile"], **s["vision"]),
        text_config=dict(model_type="llama", vocab_size=49216, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, tie_word_embeddings=False, **s["text"]),
        scale_factor=s["scale_factor"], image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(target)
    processor.save_pretrained(target)
    return target
