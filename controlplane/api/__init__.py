"""The coordinator's HTTP API: the FastAPI app, its models, the server, the dashboard."""
