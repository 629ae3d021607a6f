"""How the cuda backend reaches peers' memory across processes.

  - `ipc`: CUDA IPC between the processes of one host, and the helpers over jax.distributed's
    key-value store (all-gather, sums, barriers) the Buffer uses for its collective set-up;
  - `nvshmem`: the JAX_EP_TRANSPORT=nvshmem transport (NVSHMEM's symmetric heap).

One process (one or several GPUs) needs neither: peers are reached through unified addressing.
"""
