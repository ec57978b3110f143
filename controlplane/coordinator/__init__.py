"""The coordinator: the follower (log in), the publisher (log out), the service, metrics."""
