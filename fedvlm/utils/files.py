"""File helpers: atomic writes and inter-process locks for caches shared by many processes.

Simulated clients run in several Ray worker processes and deployed clients may share a
cache directory, so anything written to a cache is written to a temporary file and renamed
(readers never see half a file), under an advisory lock (one process computes, the others
wait and then read).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import hashlib
import io
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def file_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock named after ``target`` (``<target>.lock``)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.with_name(target.name + ".lock")
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def try_hold(path: Path):
    """An exclusive lock on ``path`` held by this process until the returned handle is closed (or
    the process ends, however it ends); None if another open handle holds it."""
    path = Path(path)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        return None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _atomic_write(path: Path, write, durable: bool = False) -> None:
    """Write through a temporary file renamed over ``path``; ``durable``: on disk before this
    returns (the file and the rename fsynced), for what must survive a power cut."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


DIGEST = "sha256"  # the key of a saved dict's own digest (``atomic_torch_save(..., digest=True)``)


def content_digest(obj: Any) -> str:
    """A SHA-256 of nested dicts, lists, tensors and scalars: their structure, dtypes, shapes and
    bytes (a torch file's zip entries carry no check a loader applies: flipped bytes in a tensor's
    data load as other numbers)."""
    import torch  # here, not at import: a module that only locks or writes files starts without torch

    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, dict):
            h.update(b"d%d" % len(x))
            for k in sorted(x, key=repr):
                feed(k)
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(b"l%d" % len(x))
            for v in x:
                feed(v)
        elif torch.is_tensor(x):
            t = x.detach().cpu().contiguous()
            h.update(f"t{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(f"{type(x).__name__}:{x!r}".encode())

    feed(obj)
    return h.hexdigest()


def atomic_torch_save(obj: Any, path: Path, digest: bool = False) -> None:
    """``torch.save`` through a temporary file; ``digest``: ``obj`` (a dict) also carries its
    ``content_digest``, which ``load_saved`` checks, for state whose silent damage would mislead
    (a node's private state and privacy ledger, the server's checkpoint)."""
    import torch

    if digest:
        obj = {**obj, DIGEST: content_digest(obj)}
    _atomic_write(path, lambda fh: torch.save(obj, fh))


class UnreadableFile(ValueError):
    """A saved file that cannot be read back: truncated, corrupt, or not what it should hold."""


def load_saved(path: Path, fix: str) -> Any:
    """``torch.load`` of tensors only (``weights_only``) onto the CPU; a file that cannot be read
    raises ``UnreadableFile`` naming it, what is wrong and ``fix`` (torch's own errors name
    neither the file nor what to do)."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged file raises zip, pickle, EOF or runtime errors
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UnreadableFile(f"{path} cannot be read ({type(err).__name__}: {first}): {fix}") from err
    if isinstance(saved, dict) and DIGEST in saved:
        recorded = saved.pop(DIGEST)
        if content_digest(saved) != recorded:
            raise UnreadableFile(f"{path} is damaged (its contents do not match the digest saved with them): {fix}")
    return saved


def load_json(path: Path, fix: str) -> Any:
    """``json.loads`` of a file; one that is not valid JSON (or not UTF-8) raises
    ``UnreadableFile`` naming it, where it breaks and ``fix`` (a bare JSONDecodeError names neither
    the file nor what to do)."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnreadableFile(f"{path} is not valid UTF-8 JSON ({str(err)[:200]}): {fix}") from err


RESULTS = "results.json"  # a run folder's record (server_app.results writes it)
RECORD_PARTS = {"run": dict, "config": dict, "rounds": list}  # what every record holds from its first write


def read_results(run_dir: Path, fix: str) -> dict:
    """A run folder's ``results.json``. A file that cannot be read, is not JSON, or is JSON but not
    a run's record (a list, one without its run, config or rounds) raises ``UnreadableFile``
    naming it, what is wrong and ``fix``; nothing is changed."""
    path = Path(run_dir) / RESULTS
    try:
        data = load_json(path, fix)
    except OSError as err:
        raise UnreadableFile(f"{path} cannot be read ({type(err).__name__}: {err}): {fix}") from err
    if not isinstance(data, dict):
        raise UnreadableFile(f"{path} holds a JSON {type(data).__name__}, not a run's record: {fix}")
    wrong = [
        f"'{k}' is {'missing' if k not in data else 'a ' + type(data[k]).__name__}, not a {t.__name__}"
        for k, t in RECORD_PARTS.items()
        if not isinstance(data.get(k), t)
    ]
    if wrong:
        raise UnreadableFile(f"{path} is not a run's record ({'; '.join(wrong)}): {fix}")
    return data


def read_utf8(path: Path, fix: str) -> str:
    """A text file's contents; one that is not UTF-8 raises ``UnreadableFile`` naming it, the
    byte where it breaks and ``fix`` (Python's own error names neither file nor fix)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = data[err.start : err.start + 4]
        raise UnreadableFile(f"{path} is not UTF-8 text (byte {err.start}: {bad!r}): {fix}") from err


def strict_json(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float as null: JSON has no such numbers, and strict
    parsers reject the ``NaN``/``Infinity`` Python would write."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def json_text(obj: Any) -> str:
    """``obj`` as strict JSON, compact: json's C encoder writes only unindented JSON, and its
    indenting encoder, in Python, made results.json the costliest part of a round at 10,000
    simulated clients (a 6 MB file: 0.36 s indented against 0.04 s; docs/results/speed.md, 'Ten
    thousand'). ``python -m json.tool`` shows one indented."""
    try:
        return json.dumps(obj, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere: written as null (``strict_json``)
        return json.dumps(strict_json(obj), allow_nan=False)


def atomic_write_json(obj: Any, path: Path, durable: bool = False) -> None:
    atomic_write_text(json_text(obj), path, durable)


class PartsKeptJson:
    """``json_text`` of a dict rewritten many times, with the text of each entry of the maps
    and lists at ``paths`` (``(section, key)``) kept while that entry is the same object.

    For the node table and the per-client privacy plans of results.json: they hold an entry per
    node, and all but a round's few stay as they were, so re-encoding them at every write made a
    write cost grow with the nodes that exist (10,000 nodes: 10 MB, about a second a write).
    An entry is re-encoded when it is replaced; one changed in place is not seen, so the owners
    of these paths replace entries (``strategies.nodes.NodeRegistry.table``,
    ``privacy.ledger.PrivacyLedger.as_dict``), and the tests compare the file with the data."""

    TOKEN = "\x00fedvlm-kept:{}\x00"

    def __init__(self, paths: tuple[tuple[str, str], ...]):
        self.paths = paths
        self.kept: dict[tuple[str, str], dict] = {path: {} for path in paths}

    def encode(self, data: dict) -> str:
        outer, spliced = dict(data), {}
        for k, (section, key) in enumerate(self.paths):
            value = (data.get(section) or {}).get(key) if isinstance(data.get(section), dict) else None
            if not isinstance(value, (dict, list)):
                continue
            token = self.TOKEN.format(k)
            outer[section] = {**outer[section], key: token}
            spliced[json.dumps(token)] = self._parts(self.kept[(section, key)], value)
        text = json_text(outer)
        for token, part in spliced.items():
            if text.count(token) != 1:  # the token in the data itself: encode it all
                return json_text(data)
            text = text.replace(token, part)
        return text

    @staticmethod
    def _parts(kept: dict, value: dict | list) -> str:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        parts, seen = [], {}
        for name, entry in items:
            held = kept.get(name)
            if held is None or held[0] is not entry:
                key = json.dumps(str(name)) + ":" if isinstance(value, dict) else ""
                held = (entry, key + json_text(entry))
            seen[name] = held
            parts.append(held[1])
        kept.clear()
        kept.update(seen)  # only what the data holds now: a removed entry's object is let go
        return ("{" if isinstance(value, dict) else "[") + ",".join(parts) + ("}" if isinstance(value, dict) else "]")


def atomic_write_text(text: str, path: Path, durable: bool = False) -> None:
    _atomic_write(path, lambda fh: fh.write(text.encode()), durable)


def atomic_write_csv(rows: Iterable[Sequence[Any]], path: Path) -> None:
    table = io.StringIO()
    csv.writer(table).writerows(rows)
    atomic_write_text(table.getvalue(), path)


def atomic_write_records(records: list[dict], path: Path) -> None:
    """``records`` as a CSV whose columns are every key any of them has, in first-seen order."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    atomic_write_csv([columns, *([r.get(k, "") for k in columns] for r in records)], path)


def atomic_savefig(fig: Any, path: Path, dpi: int) -> None:
    """A matplotlib figure as a PNG, written whole: a board redrawn while a reader opens it."""
    _atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=dpi))


def atomic_copy(source: Path, target: Path) -> None:
    _atomic_write(target, lambda fh: fh.write(Path(source).read_bytes()))


def overwrite_in_place(path: Path, text: str, size: int) -> None:
    """Write ``text`` (padded with spaces to ``size`` bytes) over the first ``size`` bytes of
    ``path``: once the file exists at that size, rewriting it needs no new disk blocks, so it
    still works on a full disk (a run's final status, ``server_app.results``)."""
    data = text.encode()[: size - 1]
    data = data + b" " * (size - 1 - len(data)) + b"\n"
    with open(path, "r+b" if Path(path).exists() else "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
