"""`python -m behemoth ...`: the same command line as `behemoth ...`."""

from behemoth.driver.commands.cli import run

run()
