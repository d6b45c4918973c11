"""``python -m clipbench``: the ``clipbench`` command."""

import sys

from clipbench.cli import main

sys.exit(main())
