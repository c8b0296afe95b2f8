"""`specdec eval` and `specdec bench` sub-commands."""
