"""Each strategy's helpers, in a package named after its module's stem (autotp_strategy.py: autotp/)."""
