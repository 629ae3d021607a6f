"""`python -m jax_ep.demo`, the documented path of the demo (`jax_ep.tools.demo`)."""

import sys

from jax_ep.tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
