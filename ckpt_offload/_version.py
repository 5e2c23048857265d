# The one place the version lives: setup.py reads this file (without importing the package,
# which needs the built extension) and ckpt_offload/__init__.py re-exports it.
__version__ = "0.1.0"
