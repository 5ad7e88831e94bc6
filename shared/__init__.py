"""Common code of learnmesh: configuration, Redis keys, wire formats, crypto, codec, model."""
