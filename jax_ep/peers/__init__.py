"""How the cuda backend maps its peers' memory across processes (a Buffer's peer mapping;
the device transport is how the kernels then write to peers: docs/transport.md).

  - `ipc`: CUDA IPC between the processes of one host, and the helpers over jax.distributed's
    key-value store (all-gather, sums, barriers) the Buffer uses for its collective set-up;
  - `nvshmem`: JAX_EP_PEER_MAPPING=nvshmem, NVSHMEM's symmetric heap.

One process (one or several GPUs) needs neither: peers are reached through unified addressing.
"""
