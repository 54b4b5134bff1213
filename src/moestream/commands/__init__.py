"""The command line: one module per verb (`moestream VERB`), each its `DESCRIPTION`, `add_arguments(parser)`
and `run(args)`. cli.py lists them. A verb module imports only light modules (options, choices, errors,
units) at import time and the work itself inside `run`, so that every `--help` answers at once."""
