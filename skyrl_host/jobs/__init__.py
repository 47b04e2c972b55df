"""Job drivers (job kinds). Each module registers one kind through its own entry point."""
