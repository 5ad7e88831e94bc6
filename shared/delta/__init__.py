"""Weight deltas between the trainer and the workers: the codec (sparse, quantised,
zstd-compressed chunks; shared/delta/codec.py). Sealing and signing are shared/crypto.py."""
