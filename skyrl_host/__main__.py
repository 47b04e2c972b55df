"""``python -m skyrl_host ...``: the ``skyrl`` command where no console script is installed
(the device kit runs the project from ``PYTHONPATH`` on a machine it did not install on)."""

from skyrl_host.cli import entry

if __name__ == "__main__":
    entry()
