"""vramshare: share NVIDIA GPUs between Kubernetes pods by memory."""

__version__ = "0.1.0"
