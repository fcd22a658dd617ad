"""The lowest layer of the shard contract (format v3, see shards.py): the columns of a
shard's block index (``.idx.npy``), ``ShardError`` and ``is_plain_name`` (what a name read
from a data dir may be). Both the reader (shards.py) and the object-store backend under it
(remote.py) use them; shards.py re-exports them."""

from __future__ import annotations

import re

# Index columns, one row per block. OFFSET/SIZE locate the sample's bytes in the tar,
# CRC is zlib.crc32 of them; *_AT: byte offset of a member's array data (or JSON) from
# the sample's start, so a read is a few slices and no header parsing. SPANS_AT is -1
# when the block has no spans.npy.
(OFFSET, SIZE, CRC, N_DOCS, N_TOKENS, TOKEN_BYTES) = range(6)
(DOCS_AT, LANGS_AT, META_AT, META_SIZE, SENTS_AT, N_SENTS) = range(6, 12)
(SPANS_AT, N_SPANS, SRCS_AT, TOKENS_AT, WORDS_AT) = range(12, 17)
INDEX_COLUMNS = 17


class ShardError(RuntimeError):
    """A data directory, shard or index that does not match its manifest."""


# One part of a name a data dir, a shard or a bundle holds: letters, digits, '.', '_', '-',
# not starting with a dot (so never '.' or '..'). prepare, the writer and the bundle write
# nothing else; a name from a file is checked against it before it becomes a path.
_PLAIN_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def is_plain_name(name: object, parts: int | None = None) -> bool:
    """Whether ``name`` (read from a manifest, a tar header, an index) is plain parts joined
    by '/': relative and inside its folder on any filesystem. Refused: '..', '.', an absolute
    path, a URI (``s3://other-bucket/...``), a backslash, an empty part, a non-string.
    ``parts``: at most that many parts (1: a file name of the folder itself)."""
    if not isinstance(name, str):
        return False
    split = name.split("/")
    return (parts is None or len(split) <= parts) and all(_PLAIN_PART.fullmatch(p) for p in split)
