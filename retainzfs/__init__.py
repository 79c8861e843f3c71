"""retainzfs: a FUSE filesystem that packs checkpoints into zones by reclaim time."""
__version__ = "0.1.0"
