"""`python -m jax_ep.launch`, the documented path of the launcher (`jax_ep.tools.launch`).

Re-exports its public names (`initialize_from_env`, `child_environments`, the ENV_* names, ...);
see `jax_ep/tools/launch.py` for the command line and the environment it writes.
"""

import sys

from jax_ep.tools.launch import *  # noqa: F403
from jax_ep.tools.launch import main

if __name__ == "__main__":
    sys.exit(main())
