__version__ = "0.1.0"
# Bump when the on-disk artifact layout or its ABI metadata changes: old entries then miss.
ARTIFACT_FORMAT = 2  # 2: manifests carry meta_sha256 (a checksum of key, files and meta)
