"""The `llmlocal` command line and the chat TUI."""
