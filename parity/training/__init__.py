"""What every strategy's run shares, written once: a parity verdict is only as good as the claim that
nothing but the strategy differs."""
