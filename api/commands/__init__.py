"""Sub-commands of the `specdec` CLI."""
