"""``python -m kvpop ...`` = the ``kvpop`` command."""
import sys

from kvpop.cli import main

sys.exit(main())
