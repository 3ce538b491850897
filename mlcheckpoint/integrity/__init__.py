"""Layer 0, the bottom layer: checksums, the threaded copier that hashes bytes as it moves
them, and verification (``verify``: the one place a checksum is compared). Imports nothing of
mlcheckpoint but the leaf modules (``config``, ``errors``)."""
