"""Tools on top of the library, which the runtime never imports.

  - `env_report`: `jax-ep-env` / `python -m jax_ep.env`, what jax_ep will use here and why;
  - `launch`: `python -m jax_ep.launch`, N local processes of one command for jax.distributed;
  - `demo`: `jax-ep-demo` (or `python -m jax_ep.tools.demo`), dispatch + combine checked and
    timed.

`jax_ep.env` and `jax_ep.launch` keep the documented commands `python -m jax_ep.env` and
`python -m jax_ep.launch` as re-exports.
"""
