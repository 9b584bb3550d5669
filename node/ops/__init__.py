"""Running nodes: start and stop, status and metrics, operator commands, ``atoll swarm``, export and plan."""
