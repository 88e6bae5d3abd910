"""``python -m quire_cli``: the ``quire`` command."""

import sys

from quire_cli.main import main

sys.exit(main())
