"""Built-in observers: plugins on the lifecycle hooks, loaded through entry points."""
