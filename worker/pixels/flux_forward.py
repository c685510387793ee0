"""FluxForward: diffusers' FluxTransformer2DModel forward, cheaper per denoising step, on the
model's own weights.

On a CPU a FLUX step is compute-bound, so batching requests buys nothing: the only way to more
images per minute is less work per step. diffusers' forward spends about a third of a step
outside the matmuls and attention (a concatenation per block and per attention, rope tables
rebuilt every call, tanh-GELU's slow tanh) and computes text rows of the last block that it
then discards. This forward computes the same function, up to float rounding:

- one matmul per stream for q, k and v, and in a single block one for q, k, v and the MLP's
  input, on weights concatenated once (flux_linear.FluxLinear: in float32 on a CPU, Loom's
  packed GEMM, which writes into slices: both streams' q/k/v land in one [text; image] tensor,
  a single block's attention output and GELU(MLP) side by side in its output projection's
  input; a batched step 1.02-1.07x against MKL through F.linear and concatenations);
- single blocks keep text and image rows in one tensor (diffusers concatenates and splits them
  in every block);
- the last single block computes only keys and values for the text rows: its text outputs are
  discarded, so their queries, attention rows, MLP and projection are not computed at all;
- rope: text position ids are zero (FluxRunner's txt_ids), the identity rotation, skipped;
  image rows are rotated in place as complex products with a table built once per request;
- tanh-GELU as x * sigmoid(2u), the same function with a faster transcendental;
- in float32 on a CPU, the ops between the matmuls are native (flux_ops: worker/kernels/
  flux_ops.c), one pass each: the modulated LayerNorm, the q/k RMSNorm with rope (in place on
  the projection's output) and GELU, 1.06-1.10x a batched step; and the attention
  (flux_attention: two blocked GEMMs around an exact softmax, ~1.15x PyTorch's flash kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.pixels import flux_attention, flux_ops
from worker.pixels.flux_linear import FluxLinear

SQRT_8_OVER_PI = 1.5957691216057308  # 2 * sqrt(2 / pi)


def gelu_tanh(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """GELU's tanh approximation, 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi)(x +
    0.044715 x^3) (torch's tanh runs at half sigmoid's speed on a CPU), into `out` (x itself
    by default: in place)."""
    out = x if out is None else out
    if flux_ops.applies(x):
        return flux_ops.gelu_tanh(x, out)
    u = x * x
    u.mul_(0.044715 * SQRT_8_OVER_PI).add_(SQRT_8_OVER_PI).mul_(x)
    return out.copy_(u.sigmoid_().mul_(x))


def rope_table(transformer, img_ids: torch.Tensor) -> torch.Tensor:
    """The image rows' rotations, complex [N, 1, head_dim / 2] (diffusers' cos/sin pairs)."""
    cos, sin = transformer.pos_embed(img_ids)
    return torch.complex(cos[:, 0::2].float(), sin[:, 0::2].float())[:, None, :]


def rotate_(x: torch.Tensor, rope: torch.Tensor) -> None:
    """Rotate x [B, N, H, head_dim] in place, consecutive pairs as complex numbers (diffusers'
    apply_rotary_emb with use_real_unbind_dim=-1, computed in float32 as it does)."""
    if x.dtype == torch.float32:
        torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(rope)
        return
    turned = torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * rope
    x.copy_(torch.view_as_real(turned).flatten(-2))


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """AdaLayerNorm's LayerNorm(x) * (1 + scale) + shift, per sample."""
    if flux_ops.applies(x):
        return flux_ops.modulated_norm(x, shift, scale, 1e-6)
    normed = F.layer_norm(x, x.shape[-1:], eps=1e-6)
    return torch.addcmul(shift[:, None], normed, 1 + scale[:, None])


class _Attention:
    """Joint attention over [text; image] rows: q/k RMS norms (text and image rows may have
    their own weights), rope on the image rows."""

    def __init__(self, attn, text_norms=None) -> None:
        self.heads, self.head_dim = attn.heads, attn.head_dim
        self.norm_q, self.norm_k = attn.norm_q, attn.norm_k
        self.text_norm_q, self.text_norm_k = text_norms or (attn.norm_q, attn.norm_k)

    def _norm(self, x: torch.Tensor, text_rows: int, image_norm, text_norm) -> torch.Tensor:
        """x [B, S, H, head_dim] -> RMS-normed copy, text rows by text_norm's weight."""
        out = F.rms_norm(x, (self.head_dim,), None, image_norm.eps)
        if text_norm is image_norm:
            return out.mul_(image_norm.weight)
        out[:, :text_rows].mul_(text_norm.weight)
        out[:, text_rows:].mul_(image_norm.weight)
        return out

    def _norm_rope(self, x: torch.Tensor, text_rows: int, rope: torch.Tensor, image_norm,
                   text_norm) -> torch.Tensor:
        """x [B, S, H, head_dim] normed and its image rows rotated: in place where native
        (x is a slice of its projection's output, not needed otherwise), else a copy."""
        if flux_ops.applies(x) and image_norm.weight is not None and \
                text_norm.weight is not None:
            flux_ops.qk_norm_rope_(x, text_rows, text_norm.weight, image_norm.weight, rope,
                                   image_norm.eps)
            return x
        x = self._norm(x, text_rows, image_norm, text_norm)
        rotate_(x[:, text_rows:], rope)
        return x

    def query(self, q: torch.Tensor, text_rows: int, rope: torch.Tensor) -> torch.Tensor:
        return self._norm_rope(q, text_rows, rope, self.norm_q, self.text_norm_q)

    def key(self, k: torch.Tensor, text_rows: int, rope: torch.Tensor) -> torch.Tensor:
        return self._norm_rope(k, text_rows, rope, self.norm_k, self.text_norm_k)

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """[B, Sq, H, d], [B, S, H, d] x2 -> [B, Sq, H * d], into `out` if given
        (flux_attention: native, or PyTorch's CPU flash kernel)."""
        return flux_attention.attend(q, k, v, out)


class _DoubleBlock:
    """FluxTransformerBlock: text and image streams, each with its own weights, one attention."""

    def __init__(self, block) -> None:
        a = block.attn
        self.b = block
        self.attn = _Attention(a, (a.norm_added_q, a.norm_added_k))
        self.qkv_image = FluxLinear.of([a.to_q, a.to_k, a.to_v])
        self.qkv_text = FluxLinear.of([a.add_q_proj, a.add_k_proj, a.add_v_proj])
        self.out_image, self.out_text = FluxLinear.of([a.to_out[0]]), FluxLinear.of([a.to_add_out])
        self.ff_image = _FeedForward(block.ff)
        self.ff_text = _FeedForward(block.ff_context)

    def __call__(self, text: torch.Tensor, image: torch.Tensor, temb: torch.Tensor,
                 rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, a = self.b, self.attn
        silu = F.silu(temb)
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = b.norm1.linear(silu).chunk(6, 1)
        (c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp,
         c_gate_mlp) = b.norm1_context.linear(silu).chunk(6, 1)
        rows = text.shape[1]
        # Both streams' q/k/v into one [text; image] tensor, sample by sample.
        qkv = text.new_empty(text.shape[0], rows + image.shape[1], self.qkv_text.out_features)
        self.qkv_text(modulated_norm(text, c_shift, c_scale), qkv[:, :rows])
        self.qkv_image(modulated_norm(image, shift, scale), qkv[:, rows:])
        qkv = qkv.unflatten(-1, (3, a.heads, a.head_dim))
        out = a.attend(a.query(qkv[:, :, 0], rows, rope), a.key(qkv[:, :, 1], rows, rope),
                       qkv[:, :, 2])

        image = torch.addcmul(image, gate[:, None], self.out_image(out[:, rows:]))
        image = torch.addcmul(image, gate_mlp[:, None],
                              self.ff_image(modulated_norm(image, shift_mlp, scale_mlp)))
        text = torch.addcmul(text, c_gate[:, None], self.out_text(out[:, :rows]))
        text = torch.addcmul(text, c_gate_mlp[:, None],
                             self.ff_text(modulated_norm(text, c_shift_mlp, c_scale_mlp)))
        return text, image


class _FeedForward:
    """diffusers' FeedForward with activation_fn="gelu-approximate" (dropout is identity)."""

    def __init__(self, ff) -> None:
        self.up, self.down = FluxLinear.of([ff.net[0].proj]), FluxLinear.of([ff.net[2]])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gelu_tanh(self.up(x)))


class _SingleBlock:
    """FluxSingleTransformerBlock on joined [text; image] rows: attention and MLP side by side
    from one input projection, one output projection over both (its input [attention | GELU(MLP)]
    written in place, never concatenated)."""

    def __init__(self, block, last: bool = False) -> None:
        a = block.attn
        self.b = block
        self.attn = _Attention(a)
        self.dim = d = a.heads * a.head_dim
        # The last block's text rows need keys and values only: a layer of their own (packed:
        # made before the fused layer releases the modules' weights; else views of its weight).
        kv = [torch.cat([m.weight.detach() for m in (a.to_k, a.to_v)]),
              torch.cat([m.bias.detach() for m in (a.to_k, a.to_v)])] if last else None
        self.qkv_mlp = FluxLinear.of([a.to_q, a.to_k, a.to_v, block.proj_mlp])
        if last and self.qkv_mlp.weight is not None:
            kv = [self.qkv_mlp.weight[d:3 * d], self.qkv_mlp.bias[d:3 * d]]
        self.kv = FluxLinear(*kv) if last else None
        self.proj_out = FluxLinear.of([block.proj_out])

    def _attention_and_mlp(self, q, k, v, mlp: torch.Tensor) -> torch.Tensor:
        """proj_out([attention(q, k, v) | GELU(mlp)]), both halves written in place."""
        both = mlp.new_empty(*mlp.shape[:-1], self.proj_out.in_features)
        self.attn.attend(q, k, v, both[..., :self.dim])
        gelu_tanh(mlp, both[..., self.dim:])
        return self.proj_out(both)

    def __call__(self, joined: torch.Tensor, temb: torch.Tensor, rope: torch.Tensor,
                 text_rows: int) -> torch.Tensor:
        a, d = self.attn, self.dim
        shift, scale, gate = self.b.norm.linear(F.silu(temb)).chunk(3, 1)
        y = self.qkv_mlp(modulated_norm(joined, shift, scale))
        qkv = y[..., :3 * d].unflatten(-1, (3, a.heads, a.head_dim))
        out = self._attention_and_mlp(a.query(qkv[:, :, 0], text_rows, rope),
                                      a.key(qkv[:, :, 1], text_rows, rope), qkv[:, :, 2],
                                      y[..., 3 * d:])
        return torch.addcmul(joined, gate[:, None], out)

    def last(self, joined: torch.Tensor, temb: torch.Tensor, rope: torch.Tensor,
             text_rows: int) -> torch.Tensor:
        """The image rows of __call__'s output: the text rows are only keys and values."""
        a, d = self.attn, self.dim
        shift, scale, gate = self.b.norm.linear(F.silu(temb)).chunk(3, 1)
        normed = modulated_norm(joined, shift, scale)
        batch, rows = joined.shape[0], joined.shape[1]
        kv = joined.new_empty(batch, rows, 2 * d)
        self.kv(normed[:, :text_rows], kv[:, :text_rows])
        y = self.qkv_mlp(normed[:, text_rows:])
        kv[:, text_rows:] = y[..., d:3 * d]
        kv = kv.unflatten(-1, (2, a.heads, a.head_dim))
        q = y[..., :d].unflatten(-1, (a.heads, a.head_dim))
        out = self._attention_and_mlp(a.query(q, 0, rope), a.key(kv[:, :, 0], text_rows, rope),
                                      kv[:, :, 1], y[..., 3 * d:])
        return torch.addcmul(joined[:, text_rows:], gate[:, None], out)


class FluxForward:
    """`forward(...)`: the noise prediction of FluxTransformer2DModel(..., txt_ids=zeros)."""

    def __init__(self, transformer) -> None:
        self.t = transformer
        self.double = [_DoubleBlock(b) for b in transformer.transformer_blocks]
        blocks = transformer.single_transformer_blocks
        self.single = [_SingleBlock(b, last=i == len(blocks) - 1) for i, b in enumerate(blocks)]

    @torch.inference_mode()
    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor,
                 guidance: torch.Tensor | None, pooled: torch.Tensor, embeds: torch.Tensor,
                 rope: torch.Tensor) -> torch.Tensor:
        t = self.t
        image = t.x_embedder(latents)
        timestep = timestep.to(image.dtype) * 1000
        if guidance is None:
            temb = t.time_text_embed(timestep, pooled)
        else:
            temb = t.time_text_embed(timestep, guidance.to(image.dtype) * 1000, pooled)
        text = t.context_embedder(embeds)
        for block in self.double:
            text, image = block(text, image, temb, rope)
        if self.single:
            rows = text.shape[1]
            joined = torch.cat([text, image], 1)
            for block in self.single[:-1]:
                joined = block(joined, temb, rope, rows)
            image = self.single[-1].last(joined, temb, rope, rows)
        return t.proj_out(t.norm_out(image, temb))
