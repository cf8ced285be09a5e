"""The driver: flags resolved into one RunConfig, Ray Train's launch, the cluster, local process groups."""
