"""skyrl-toolkit: the shared library that plugins import (not plugins themselves, and not
the host's mechanism).

- :mod:`skyrl_toolkit.launch`: what every launcher shares: ``start_backend``,
  ``start_engine``, ``save_trained_model``;
- :mod:`skyrl_toolkit.routing`: MoE router hooks that record or force experts (engines,
  replay strategies);
- :mod:`skyrl_toolkit.groups`: torch process groups of a job's ranks (weight transports);
- :mod:`skyrl_toolkit.devices`: the ``device`` option engines and backends share;
- :mod:`skyrl_toolkit.kl`: the one KL estimator (algorithms, backends);
- :mod:`skyrl_toolkit.remote_errors`: botocore / s3fs errors of an fsspec URL as one user error;
- :mod:`skyrl_toolkit.s3server`: a local S3 API (moto's server) for tests and benchmarks,
  and its pytest fixture ``skyrl_s3_server`` (:mod:`skyrl_toolkit.testing`).
"""
