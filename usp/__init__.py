"""usp: a launcher for large-model training, after the Ultra-Scale Playbook."""
__version__ = "0.1.0"
