"""A small decoder-only MoE transformer in Flax NNX whose experts are spread over an "ep" axis.

Sharding model: the batch is split over every mesh axis (`batch_axes`, e.g. ("data", "ep")), so
each device holds its own tokens; attention, norms, embeddings and the router are replicated
(plain data parallelism, partitioned by XLA under `jax.jit`). The expert weights
`[num_experts, ...]` are split over "ep": each device holds `num_experts // R` experts (and the
"data" axis, if any, replicates them). The MoE feed-forward runs inside `jax.shard_map`: each
device routes its tokens, `jax_ep.dispatch` sends them to the devices that hold their experts,
the experts run as grouped matmuls (`jax_ep.moe.expert_matmul` says which), and `jax_ep.combine`
brings the results back — see `jax_ep.moe.moe_ffn`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import moe


class MoEFeedForward(nnx.Module):
    """Top-k routed SwiGLU experts, expert-parallel over `buf`'s axis.

    Args:
        buf: the `jax_ep.Buffer` (its mesh, axis, `num_experts`, `num_topk`, `hidden`).
        ffn: hidden width F of each expert.
        batch_axes: mesh axes the batch dimension is split over.
        rngs: NNX random streams.
        micro_batches: 2 splits each device's tokens into two micro-batches whose dispatches
            and combines run under each other's experts (`moe_ffn`; overlapped when `buf` was
            made with `overlap=True`).
    """

    def __init__(self, buf: jax_ep.Buffer, ffn: int, batch_axes: tuple[str, ...], *, rngs,
                 micro_batches: int = 1):
        hidden, num_experts = buf.hidden, buf.num_experts
        self.buf = buf
        self.batch_axes = batch_axes
        self.micro_batches = micro_batches
        self.router = nnx.Linear(
            hidden, num_experts, use_bias=False, rngs=rngs,
            kernel_init=nnx.initializers.normal(0.02),
        )
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        spec = (buf.axis_name, None, None)  # experts split over the EP axis

        def param(shape):
            return nnx.Param(init(rngs.params(), shape), out_sharding=spec, mesh=buf.mesh)

        # Gate and up side by side in one weight: each of their grouped matmuls (forward, dx,
        # dw) is one product instead of two (moe.swiglu_experts, w_up=None).
        self.w_gate_up = param((num_experts, hidden, 2 * ffn))
        self.w_down = param((num_experts, ffn, hidden))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Args: x `[B, S, H]`. Returns `(y [B, S, H], aux_loss scalar)`."""
        batch, seq, hidden = x.shape
        logits = self.router(x).reshape(batch * seq, -1)
        topk_idx, topk_weights, aux_loss = moe.router(logits, self.buf.num_topk)
        topk_idx = topk_idx.reshape(batch, seq, -1)
        topk_weights = topk_weights.reshape(batch, seq, -1)

        tokens = P(self.batch_axes)
        experts = P(self.buf.axis_name)

        @functools.partial(
            jax.shard_map,
            mesh=self.buf.mesh,
            in_specs=(tokens, tokens, tokens, experts, experts),
            out_specs=tokens,
        )
        def local_moe(x, topk_idx, topk_weights, w_gate_up, w_down):
            b, s, h = x.shape  # this device's tokens and experts
            y = moe.moe_ffn(
                self.buf,
                x.reshape(b * s, h).astype(self.buf.dtype),
                topk_idx.reshape(b * s, -1),
                topk_weights.reshape(b * s, -1),
                w_gate_up, None, w_down, micro_batches=self.micro_batches,
            )
            return y.reshape(b, s, h).astype(x.dtype)

        y = local_moe(x, topk_idx, topk_weights, self.w_gate_up[...], self.w_down[...])
        return y, aux_loss


class Block(nnx.Module):
    """Pre-norm block: causal self-attention then the MoE feed-forward, both residual."""

    def __init__(self, buf: jax_ep.Buffer, num_heads: int, ffn: int,
                 batch_axes: tuple[str, ...], *, rngs, micro_batches: int = 1):
        hidden = buf.hidden
        self.attn_norm = nnx.RMSNorm(hidden, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads, hidden, use_bias=False, decode=False, rngs=rngs
        )
        self.ffn_norm = nnx.RMSNorm(hidden, rngs=rngs)
        self.moe = MoEFeedForward(buf, ffn, batch_axes, rngs=rngs, micro_batches=micro_batches)

    def __call__(self, x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.attn_norm(x), mask=mask)
        y, aux_loss = self.moe(self.ffn_norm(x))
        return x + y, aux_loss


class MoETransformer(nnx.Module):
    """Decoder-only language model: token + position embeddings, MoE blocks, tied LM head.

    Args:
        buf: the `jax_ep.Buffer` shared by every MoE layer (hidden size = `buf.hidden`).
        vocab_size: number of token ids.
        max_seq_len: longest sequence (size of the position table).
        num_layers: number of blocks.
        num_heads: attention heads (must divide `buf.hidden`).
        ffn: hidden width of each expert.
        batch_axes: mesh axes the batch is split over.
        rngs: NNX random streams.
        micro_batches: 1, or 2 (each MoE layer in two overlapped micro-batches).
    """

    def __init__(self, buf: jax_ep.Buffer, *, vocab_size: int, max_seq_len: int,
                 num_layers: int, num_heads: int, ffn: int, batch_axes: tuple[str, ...],
                 rngs, micro_batches: int = 1):
        hidden = buf.hidden
        # Tied input/output embedding: std 1/sqrt(hidden) keeps the initial logits O(1).
        self.embed = nnx.Embed(vocab_size, hidden, rngs=rngs,
                               embedding_init=nnx.initializers.normal(hidden ** -0.5))
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (max_seq_len, hidden)))
        self.blocks = nnx.List(
            [Block(buf, num_heads, ffn, batch_axes, rngs=rngs, micro_batches=micro_batches)
             for _ in range(num_layers)]
        )
        self.norm = nnx.RMSNorm(hidden, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Args: tokens `[B, S]` int32. Returns `(logits [B, S, V] float32, mean aux loss)`."""
        seq = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:seq]
        mask = nnx.make_causal_mask(tokens)
        aux_losses = []
        for block in self.blocks:
            x, aux_loss = block(x, mask)
            aux_losses.append(aux_loss)
        logits = self.embed.attend(self.norm(x)).astype(jnp.float32)
        return logits, jnp.mean(jnp.stack(aux_losses))


def shard_model(node: nnx.Module | nnx.Optimizer, mesh: jax.sharding.Mesh) -> None:
    """Puts every variable of `node` on `mesh` by its sharding annotation (else replicated).

    Placing everything (the optimizer state too) on the mesh up front keeps the input shardings
    of the jitted train step the same from the first step on, so it compiles once.
    """
    state = nnx.state(node)
    specs = nnx.get_partition_spec(state)
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
    nnx.update(node, jax.device_put(state, shardings))
