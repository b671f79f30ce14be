"""``python -m dpzero_jax`` is the ``dpzero`` command."""

import sys

from dpzero_jax.cli import main

sys.exit(main())
