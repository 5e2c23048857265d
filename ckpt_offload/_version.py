# The one place the version lives: setup.py reads this file (without importing the package,
# which needs the built extension) and ckpt_offload/__init__.py re-exports it.
# CHANGELOG.md's newest section: "0.2.0 (unreleased)" is 0.2.0.dev0 until it is released.
__version__ = "0.2.0.dev0"
