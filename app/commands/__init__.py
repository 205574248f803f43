"""One module per `llmlocal` subcommand: each adds its parser and calls library functions."""
