"""`python -m behemoth ...`: the same command line as `behemoth ...`."""

import sys

from behemoth.driver.cli import main

sys.exit(main())
