"""What more than one service uses: settings, the Redis bus, model loading, logging and metrics."""
