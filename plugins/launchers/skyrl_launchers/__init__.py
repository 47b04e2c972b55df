"""skyrl-launchers: launchers that place a job's backend ranks and engine replicas in
processes of their own (``[cluster] launcher = "ray"``).

Each feature is one module here with its own ``skyrl`` entry point; the one-process
``local`` launcher is the host's (:mod:`skyrl_host.launch`).
"""
