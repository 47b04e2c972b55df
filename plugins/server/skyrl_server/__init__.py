"""skyrl-server: ``skyrl serve server.toml``, the Tinker API over skyrl's backends and engines."""
