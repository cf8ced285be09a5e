"""What every strategy shares: flags, model and init weights, data, the loop, the loss record, the launcher.

A parity verdict is only as good as the claim that nothing but the strategy differs, so everything a
strategy does not need to own lives here, written once.
"""
