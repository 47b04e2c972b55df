"""How to install NIXL, for the messages of the ``nixl`` transport's face and its halves
(a module of its own so that neither imports the other)."""

INSTALL_HINT = "pip install 'skyrl-weightsync[nixl]' (the nixl-cu12 wheel; it works without a GPU)"
