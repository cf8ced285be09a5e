"""What each top-level script runs. Every command turns bad input into one line and exit 2 (`run_command`)."""
