"""kvserve composition root: the command line, cluster.yaml loading, the launcher."""
