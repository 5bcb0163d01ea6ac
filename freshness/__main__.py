"""``python -m freshness check | list | stamp PATH...``: see :mod:`freshness`."""
import sys

from freshness import main

sys.exit(main())
