"""The lowest layer of the shard contract (format v3, see shards.py): the columns of a
shard's block index (``.idx.npy``) and ``ShardError``. Both the reader (shards.py) and the
object-store backend under it (remote.py) use them; shards.py re-exports them. What a
name read from a data dir may be: ``pipeline.storage.is_plain_name``."""

from __future__ import annotations

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
