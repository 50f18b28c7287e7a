"""`python -m quantkit`: the `quantkit` command."""

from quantkit.cli import main

main(prog_name="quantkit")
