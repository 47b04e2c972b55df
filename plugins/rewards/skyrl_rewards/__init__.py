"""Reward parts for skyrl (``[reward] parts = [...]``): ``dataset`` (the dataset's own
reward, every rl job's default), ``function`` (a Python function of yours) and
``reward_model`` (a local sequence-classification model). See docs/rewards.md."""
