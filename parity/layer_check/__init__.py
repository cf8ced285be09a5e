"""The layer check's worker side: one step recorded module by module, its inputs, and the replay of a run's step."""
