"""Per-token FP8 (e4m3fn) cast, one float32 scale per 128 channels (docs/api.md, "FP8 scales")."""

from __future__ import annotations

import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3fn value
AMAX_FLOOR = 1e-4        # keeps the scale of an all-zero block finite
# The one Python copy (the reference backend needs it too); the kernels' kChannelsPerScale
# must agree (tests/test_build.py).
CHANNELS_PER_SCALE = 128


def fp8_scales(amax, round_scale: bool = False):
    """Scale for blocks with absolute maximum ``amax`` (float32, any shape).

    ``scale = max(amax, 1e-4) / 448``; with ``round_scale`` the next power of two at or above it,
    computed exactly with frexp (no log2 rounding at exact powers of two).
    """
    scale = jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR) / FP8_MAX
    if round_scale:
        # scale = mantissa * 2**exponent with mantissa in [0.5, 1)
        mantissa, exponent = jnp.frexp(scale)
        exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
        scale = jnp.ldexp(jnp.ones_like(scale), exponent)
    return scale


def per_token_cast_to_fp8(x, round_scale: bool = False):
    """Casts ``x [..., H]`` to ``(x_fp8 [..., H] float8_e4m3fn, scales [..., H // 128] float32)``.

    Args:
      x: floating array whose last dimension is a multiple of 128.
      round_scale: round each scale up to a power of two (DeepEP's ``round_scale``).

    Returns:
      ``x_fp8 = x / scale`` per 128-channel block, and the scales. jit-safe.
    """
    if x.shape[-1] % CHANNELS_PER_SCALE:
        raise ValueError(f"x: last dimension must be a multiple of 128, got shape {x.shape}")
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, CHANNELS_PER_SCALE)
    scales = fp8_scales(jnp.max(jnp.abs(blocks), axis=-1), round_scale)
    x_fp8 = (blocks / scales[..., None]).astype(FP8_DTYPE).reshape(x.shape)
    return x_fp8, scales


def per_token_cast_from_fp8(x_fp8, scales, dtype=jnp.bfloat16):
    """Inverse of ``per_token_cast_to_fp8`` (up to fp8 rounding): ``x_fp8 * scale`` per block."""
    blocks = x_fp8.astype(jnp.float32).reshape(*x_fp8.shape[:-1], -1, CHANNELS_PER_SCALE)
    return (blocks * scales[..., None]).reshape(x_fp8.shape).astype(dtype)
