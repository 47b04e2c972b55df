"""skyrl-samplers: token samplers (temperature, greedy, top_k, top_p, min_p).

Each feature is one module here with its own ``skyrl`` entry point. The modules
the entry points name import no torch: the tensor code lives in
:mod:`skyrl_samplers._processing`, imported by the factories when a job builds
its sampler. Code outside this distribution that needs a sampler object itself
imports the public :mod:`skyrl_samplers.processing` (it imports torch).

Every sampler but ``greedy`` is the same composable pipeline, fixed in this
order: temperature scaling -> top-k -> top-p -> min-p -> sample. The names only
change the defaults of the four options.
"""
