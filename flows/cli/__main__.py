"""``python -m flows.cli``: the ``hybridflow`` command."""

import sys

from flows.cli import main

sys.exit(main())
