"""Storage on the ground floor: URIs, the filesystem for a URI, a store's faults as one line,
safe names, and the one atomic write every stage uses.

A URI given where a local path is taken would be read as one (``s3://b/x`` -> a folder
``s3:`` in the working directory), so path options refuse it (``local_path``). Where a URI
is taken it carries no credentials and no query (``store_path``): configs, manifests, logs
and MLflow params name URIs, so secrets come from the AWS_* variables or the node's role.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, StoreError

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_URI_PARTS = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?:(?P<user>[^/?#@]*)@)?"
                        r"(?P<rest>[^?#]*)(?:\?(?P<query>[^#]*))?")  # fmt: skip
STORE_SECRETS_HINT = (
    "give credentials and options in the environment (AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION) or "
    "the node's role"
)


def is_uri(value: Any) -> bool:
    """``s3://...``, ``file://...``: a filesystem URI; a plain path (or models:/...) is not."""
    return isinstance(value, str) and _URI.match(value) is not None


def redact_uri(uri: str) -> str:
    """``uri`` as it may be shown: a user part (``KEY:SECRET@``) and every query value
    masked (``s3://***@b/x?region=***``)."""
    m = _URI_PARTS.match(uri) if is_uri(uri) else None
    if m is None or (m["user"] is None and m["query"] is None):
        return uri
    out = m["head"] + ("***@" if m["user"] is not None else "") + m["rest"]
    if m["query"] is not None:
        out += "?" + "&".join(p.split("=", 1)[0] + "=***" for p in m["query"].split("&"))
    return out


def uri_secret_part(uri: str) -> str | None:
    """What of a URI could hold a secret (``"user part"``, ``"query"``), or None."""
    m = _URI_PARTS.match(uri) if is_uri(uri) else None
    if m is None:
        return None
    if m["user"] is not None:
        return "user part (KEY:SECRET@)"
    return "query (?...)" if m["query"] is not None else None


def tracking_uri_refusal(what: str, value: str) -> str:
    """The one line that refuses an MLflow tracking URI with a user part in a config: the
    config is printed and logged as the run's params. (MLFLOW_TRACKING_URI may carry one:
    pipeline/tracking_uri.py moves it into MLflow's variables.)"""
    return (
        f"{what}={redact_uri(value)}: a tracking URI here may not carry a user part "
        "(user:pass@): the config is printed and logged as MLflow params; give "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD_FILE (a file holding the "
        "password) in the environment (docs/tracking.md)"
    )


def local_path_refusal(what: str, value: str, alternative: str = "") -> str:
    """The one line that refuses a URI given to ``what`` (a flag or a config key)."""
    line = f"{what}={redact_uri(value)}: {what} takes a local path, not a URI"
    return line + (f"; {alternative}" if alternative else "") + "; nothing was written"


def store_uri_refusal(what: str, value: str) -> str:
    return (
        f"{what}={redact_uri(value)}: a URI here may not carry a {uri_secret_part(value)}: "
        f"it would be written to logs, manifests and MLflow; {STORE_SECRETS_HINT}"
    )


def local_path(value: str, what: str, alternative: str = "") -> str:
    """``value`` when it is a local path; else a ConfigError (one `plm:` line, exit 2)
    naming ``what``; ``alternative``: where a URI is taken instead, said in the line."""
    if is_uri(value):
        raise ConfigError(local_path_refusal(what, value, alternative))
    return value


def store_path(value: str, what: str) -> str:
    """``value`` when it is a local path or a URI without a user part or query."""
    if uri_secret_part(value):
        raise ConfigError(store_uri_refusal(what, value))
    return value


_DENIED = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "FORBIDDEN",
           "EXPIRED_TOKEN", "INVALID_TOKEN", "INVALIDACCESSKEYID", "ACCESSDENIED")  # fmt: skip
_OFFLINE = ("NETWORK_CONNECTION", "COULD NOT CONNECT", "COULD NOT RESOLVE", "CURLCODE",
            "TIMED OUT", "CONNECTION REFUSED")  # fmt: skip
_NO_BUCKET = ("NO_SUCH_BUCKET", "NOSUCHBUCKET")


def endpoint_named() -> str:
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f"the endpoint {redact_uri(url)} (AWS_ENDPOINT_URL)" if url else "the store's endpoint"


def store_fault(uri: str, what: str, err: Exception | str) -> str | None:
    """The one line for a store error that is about the store, not the file: access
    denied, cannot connect, bucket not found; None for anything else."""
    text = " ".join(str(err).split())
    upper = text.upper()
    shown = f"{what}={redact_uri(uri)}" if what else redact_uri(uri)
    if any(k in upper for k in _DENIED):
        return (
            f"{shown}: access denied by the store ({text[:200]}); check the credentials "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or the node's "
            "role) and the bucket's permissions"
        )
    if any(k in upper for k in _OFFLINE):
        return (
            f"{shown}: cannot connect to {endpoint_named()} ({text[:200]}); check "
            "AWS_ENDPOINT_URL and the network"
        )
    if any(k in upper for k in _NO_BUCKET):
        return f"{shown}: bucket {_bucket(uri)} not found at {endpoint_named()}; create it or fix the URI"
    return None


def _bucket(uri: str) -> str:
    return _URI.sub("", uri).split("/", 1)[0].rsplit("@", 1)[-1].split("?", 1)[0]


def store_fs(uri: str, what: str = ""):
    """(pyarrow filesystem, path in it) of a filesystem URI; a StoreError (one line)
    when the URI is not one or its store cannot be reached."""
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as err:  # pyarrow.ArrowInvalid is a ValueError
        shown = f"{what}={redact_uri(uri)}" if what else redact_uri(uri)
        raise StoreError(
            store_fault(uri, what, err)
            or f"{shown}: not a usable filesystem URI ({' '.join(str(err).split())[:200]})"
        ) from None


def check_store(uri: str, what: str = ""):
    """Open a URI's store and make sure it answers, before any work: its bucket exists
    (object stores) and the path can be looked up with these credentials. (filesystem,
    path); a StoreError naming the URI and what is wrong otherwise."""
    import pyarrow.fs as pafs

    fs, path = store_fs(uri, what)
    shown = f"{what}={redact_uri(uri)}" if what else redact_uri(uri)
    try:
        if fs.type_name in ("s3", "gcs"):
            bucket = path.split("/", 1)[0]
            if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                raise StoreError(
                    f"{shown}: bucket {bucket} not found at {endpoint_named()}; create it or fix the URI"
                )
        fs.get_file_info(path)
    except OSError as err:
        raise StoreError(
            store_fault(uri, what, err)
            or f"{shown}: cannot read it ({' '.join(str(err).split())[:200]})"
        ) from None
    return fs, path


def uri_name(uri: str) -> str:
    """The last part of a URI's path (``s3://b/corpora/wiki`` -> ``wiki``), else its bucket."""
    rest = _URI.sub("", uri).rstrip("/")
    return rest.rsplit("/", 1)[-1] or "data"


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


# --- the one atomic write ---------------------------------------------------------------------
# A reader never sees a half-written file: the bytes go to a temporary name of their own
# (process and thread in it, so writers of one path never share a temporary), then one
# rename. ``durable``: fsync before the rename, so a crash cannot leave the name pointing
# at empty blocks; a cache that can fetch again skips it.

_TEMP = re.compile(r"\.(?:\d+-\d+\.)?tmp$")


def temp_name(name: str) -> str:
    return f"{name}.{os.getpid()}-{threading.get_ident()}.tmp"


def without_temp(name: str) -> str:
    """The name a temporary file of ``atomic_write`` (or an older ``NAME.tmp``) stands for."""
    return _TEMP.sub("", name)


def atomic_write(path: str | Path, data: bytes, fs: Any = None, durable: bool = True) -> None:
    """``data`` at ``path``, whole or not at all: on this machine, or at a path of the
    pyarrow filesystem ``fs`` (a move there: on an object store a server-side copy)."""
    if fs is not None:
        tmp = temp_name(str(path))
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, str(path))
        return
    path = Path(path)
    tmp = path.with_name(temp_name(path.name))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class Counters:
    """Named integer counters that threads add to (``add(name=delta)``) and a caller reads
    (``snapshot()``). A pickled or forked copy starts again at zero: the counts are the
    process's own."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def zeroed(self) -> Counters:
        return Counters(*self._values)

    def __getstate__(self) -> tuple[str, ...]:
        return tuple(self._values)

    def __setstate__(self, names: tuple[str, ...]) -> None:
        self.__init__(*names)
