"""What every layer may use: configuration and limits, errors, logs, the request context, the fallback counter.
Imports nothing of the server."""
