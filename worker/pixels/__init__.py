"""Image generation in the worker: FLUX denoising steps batched across requests (flux.py)."""
