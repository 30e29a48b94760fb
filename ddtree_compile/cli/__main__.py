"""`python -m ddtree_compile.cli ...` = `ddtree-compile ...`."""

import sys

from ddtree_compile.cli import main

sys.exit(main())
