"""`python -m behemoth ...`: the same command line as `behemoth ...`."""

from behemoth.driver.cli import run

run()
