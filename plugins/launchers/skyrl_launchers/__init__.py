"""skyrl-launchers: launchers that place a job's backend ranks and engine replicas:
``local`` (the default: everything in the driver's process) and ``ray`` (processes of
their own, as Ray actors in placement groups).

Each feature is one module here with its own ``skyrl`` entry point; what both share
(building, checking and starting each backend rank and engine replica, saving the final
model) is :mod:`skyrl_toolkit.launch`.
"""
