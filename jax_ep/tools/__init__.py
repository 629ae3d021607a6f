"""Tools on top of the library, which the runtime never imports.

  - `env_report`: `jax-ep-env` / `python -m jax_ep.env`, what jax_ep will use here and why;
  - `launch`: `python -m jax_ep.launch`, N local processes of one command for jax.distributed;
  - `demo`: `jax-ep-demo` / `python -m jax_ep.demo`, dispatch + combine checked and timed.

`jax_ep.env`, `jax_ep.launch` and `jax_ep.demo` keep their documented paths as re-exports.
"""
