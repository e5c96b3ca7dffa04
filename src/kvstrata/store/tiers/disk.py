"""The SSD tier: one checksummed file per object under ``disk_dir``.

File layout (little endian)::

    magic "KVST" | version u16 | write mode u8 | flags u8 | key length u32 | payload size u64
    | xxh64(payload) u64 | expires at f64 (Unix time, 0 = never) | xxh32(header fields + key) u32
    | key (UTF-8) | payload

A file is written under a temporary name and renamed into place (atomic: a reader or a restart
sees the old file or the new one, never half of one). The engine does the rename under its lock, so
the file on disk always matches the newest sealed version; a rename (or its fsync) that fails leaves
the older file in place and indexed, and a file that cannot be deleted stays indexed too, so that no
file outside the index comes back at the next start. At startup the index is rebuilt from the
headers; objects whose time to live ran out meanwhile, files of DRAM-only modes (spill files of a
previous run) and temporary files are removed. A file whose header or payload fails its checksum,
or that is truncated, is a miss: logged, counted in ``corrupt``, moved aside as ``*.corrupt`` and
never served.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import struct
import time
from dataclasses import dataclass

import xxhash

from kvstrata.errors import CapacityError, CorruptData, InvalidValue, KvstrataError, ServerError
from kvstrata.store.config import WriteMode
from kvstrata.store.tiers.base import Tier

log = logging.getLogger(__name__)

MAGIC = b"KVST"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHBBIQQd")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _CRC.size
_MODES = list(WriteMode)
_PERSISTENT = (WriteMode.WRITE_THROUGH, WriteMode.WRITE_BACK)
_SUFFIX = ".kvs"
#: free bytes a write-back write leaves its file system, beyond the files reserved (its metadata, the folder's growth)
FS_MARGIN_BYTES = 4 << 20


@dataclass(slots=True)
class DiskRecord:
    """One object file in the index."""

    size: int  # payload bytes
    mode: WriteMode
    nbytes: int  # file bytes (header + key + payload), what counts against capacity
    expires_at: float = 0.0  # Unix time, 0 = never


@dataclass(slots=True)
class PendingFile:
    """A fully written temporary file waiting for :meth:`DiskTier.commit` or :meth:`DiskTier.discard`."""

    path: str
    nbytes: int
    expires_at: float = 0.0


def file_name(key: str) -> str:
    return xxhash.xxh3_128_hexdigest(key.encode()) + _SUFFIX


class DiskTier(Tier):
    """Objects as files under ``directory``, at most ``capacity`` bytes of files."""

    name = "disk"

    def __init__(self, directory: str, capacity: int, *, sync: bool = False):
        self.directory = os.path.abspath(directory)
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            if not os.path.isdir(self.directory):
                raise NotADirectoryError(f"{self.directory} is a file")
        except OSError as exc:
            raise InvalidValue(f"disk_dir: cannot use {self.directory} as the SSD tier's folder: {exc}") from exc
        self._lock_fd = _lock_directory(self.directory)
        self._capacity = capacity
        self._sync = sync
        self._used = 0
        self._reserved = 0
        self._tmp_ids = itertools.count()
        self.corrupt = 0
        self.expired = 0  # files dropped at startup because their time to live had run out
        self.index: dict[str, DiskRecord] = {}
        try:
            self._scan()
        except BaseException:
            self.close()  # else the folder stays locked: a retry in this process would be refused as "in use"
            raise

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    def stats(self) -> dict:
        return {
            "used": self._used,
            "capacity": self._capacity,
            "files": len(self.index),
            "reserved": self._reserved,
            "corrupt": self.corrupt,
        }

    # -- startup -------------------------------------------------------------------------------
    def _scan(self) -> None:
        for entry in os.scandir(self.directory):
            if not entry.is_file():
                continue
            if entry.name.endswith(".tmp"):
                _unlink_or_log(entry.path, "a temporary file of a write that never committed")  # killed process
                continue
            if not entry.name.endswith(_SUFFIX):
                continue
            try:
                with open(entry.path, "rb") as f:
                    key, size, mode, _, expires_at = self._read_header(f, entry.path)
                file_bytes = entry.stat().st_size
                expected = HEADER_BYTES + len(key.encode()) + size
                if file_bytes != expected:
                    raise CorruptData(f"{entry.path}: {file_bytes} bytes on disk, header says {expected}")
                if file_name(key) != entry.name:
                    raise CorruptData(f"{entry.path}: holds key {key!r}, whose file name differs")
            except CorruptData as exc:
                self._quarantine(entry.path, str(exc))
                continue
            except OSError as exc:
                log.error("disk tier: cannot read %s (%s); ignored", entry.path, exc)
                continue
            if mode not in _PERSISTENT:
                # spill file of a previous run: DRAM-only data does not outlive it
                _unlink_or_log(entry.path, f"the spill file of {key!r} of a previous run")
                continue
            if expires_at and expires_at <= time.time():
                _unlink_or_log(entry.path, f"the file of {key!r}, whose time to live ran out")
                self.expired += 1
                continue
            self.index[key] = DiskRecord(size, mode, file_bytes, expires_at)
            self._used += file_bytes
        if self.index:
            log.info("disk tier: %d objects (%d bytes) found in %s", len(self.index), self._used, self.directory)
        if self._used > self._capacity:
            log.warning(
                "disk tier: the %d bytes of objects found in %s exceed its size (%d bytes): nothing more is written "
                "to SSD until enough are deleted or expire (start with a larger disk_size to keep writing)",
                self._used,
                self.directory,
                self._capacity,
            )

    @staticmethod
    def _read_header(f, path: str) -> tuple[str, int, WriteMode, int, float]:
        raw = f.read(HEADER_BYTES)
        if len(raw) < HEADER_BYTES:
            raise CorruptData(f"{path}: truncated header ({len(raw)} bytes)")
        magic, version, mode_i, _flags, key_len, size, checksum, expires_at = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise CorruptData(f"{path}: bad magic {magic!r}")
        if version != FORMAT_VERSION:
            raise CorruptData(f"{path}: format version {version}, this kvstrata reads {FORMAT_VERSION}")
        if key_len > 4096 or mode_i >= len(_MODES):
            raise CorruptData(f"{path}: implausible header")
        key_raw = f.read(key_len)
        (crc,) = _CRC.unpack_from(raw, _HEADER.size)
        if len(key_raw) != key_len or xxhash.xxh32_intdigest(raw[: _HEADER.size] + key_raw) != crc:
            raise CorruptData(f"{path}: header checksum mismatch")
        try:
            key = key_raw.decode()
        except UnicodeDecodeError as exc:
            raise CorruptData(f"{path}: key is not UTF-8") from exc
        return key, size, _MODES[mode_i], checksum, expires_at

    def _quarantine(self, path: str, why: str, key: str | None = None) -> None:
        self.corrupt += 1
        if why.startswith(path + ": "):
            why = why[len(path) + 2 :]  # (said once)
        whose = f"key {key!r}: " if key is not None else ""
        log.error("disk tier: %scorrupt object file %s (%s); moved aside, never served", whose, path, why)
        try:
            os.replace(path, path + ".corrupt")
        except OSError:
            _unlink_or_log(path, "a corrupt object file (never served: checked again at the next start)")

    # -- writes (write_temp runs outside the engine's lock; the rest under it) -------------------
    def file_bytes(self, key: str, size: int) -> int:
        return HEADER_BYTES + len(key.encode()) + size

    def has_room(self, nbytes: int) -> bool:
        return self._used + self._reserved + nbytes <= self._capacity

    def reserve(self, nbytes: int) -> bool:
        if self._used + self._reserved + nbytes > self._capacity:
            return False
        self._reserved += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        self._reserved -= nbytes

    def fs_shortfall(self) -> int:
        """How many bytes the folder's file system lacks to write every file reserved and not written yet (0: none;
        :data:`FS_MARGIN_BYTES` kept aside for the file system's own needs). ``--disk-size`` counts only kvstrata's
        files: another program filling the same file system would otherwise leave acknowledged ``write_back`` data
        nowhere to go (found at shutdown, and lost). One ``statvfs`` call, ~1-2 us."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return 0  # nothing known: the writes themselves will say
        free = st.f_bavail * st.f_frsize
        return max(0, self._reserved + FS_MARGIN_BYTES - free)

    def write_temp(self, key: str, data: memoryview, mode: WriteMode, expires_at: float = 0.0) -> PendingFile:
        """Write ``data`` for ``key`` to a temporary file (thread-safe; call without the engine lock)."""
        key_raw = key.encode()
        checksum = xxhash.xxh64_intdigest(data)
        fields = (MAGIC, FORMAT_VERSION, _MODES.index(mode), 0, len(key_raw), len(data), checksum, expires_at)
        head = _HEADER.pack(*fields)
        head += _CRC.pack(xxhash.xxh32_intdigest(head + key_raw))
        path = self._temp_path()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _storage_error(exc, key, self.directory) from exc
        try:
            with open(fd, "wb", buffering=0, closefd=True) as f:
                f.write(head + key_raw)
                view = memoryview(data)
                while view:
                    n = f.write(view)
                    view = view[n:]
                if self._sync or mode == WriteMode.WRITE_THROUGH:
                    os.fsync(f.fileno())  # write-through: on the device, not only in the page cache
        except BaseException as exc:
            _unlink_or_log(path, "a temporary file of a failed write")
            if isinstance(exc, OSError):
                raise _storage_error(exc, key, self.directory) from exc
            raise
        return PendingFile(path, HEADER_BYTES + len(key_raw) + len(data), expires_at)

    def _temp_path(self) -> str:
        return os.path.join(self.directory, f".{os.getpid()}-{next(self._tmp_ids)}.tmp")

    def commit(self, key: str, pending: PendingFile, mode: WriteMode, size: int) -> None:
        """Rename a reserved, written temp file into place as ``key``'s file (replacing any older one).

        Failure-atomic: when the rename (or the folder's fsync that makes it durable) fails, the temp file is
        removed, its reservation given back, ``key``'s older file put back in place (still indexed as before) and
        a ``ServerError`` (``CapacityError`` for a full file system) raised. Only when the older file cannot be
        put back either (a second failure) is it gone: its record goes with it (``key not in index``), and the
        caller must treat the version it held as having lost its SSD copy."""
        final = os.path.join(self.directory, file_name(key))
        durable = self._sync or mode == WriteMode.WRITE_THROUGH
        backup = None
        try:
            if durable and key in self.index:
                # the folder's fsync after the rename may fail: a second name of the older file lets it be put back
                backup = self._temp_path()
                try:
                    os.link(final, backup)
                except OSError as exc:  # (no hard links on this file system, or the file is gone): no way back
                    log.debug("disk tier: no second name for %s (%s)", final, exc)
                    backup = None
            os.replace(pending.path, final)
        except OSError as exc:
            self.discard(pending)
            if backup is not None:
                _unlink_or_log(backup, f"a second name of the file of {key!r}")
            raise _storage_error(exc, key, self.directory, "committing") from exc
        if durable:
            try:
                _fsync_dir(self.directory)  # the rename itself survives a power loss
            except OSError as exc:
                self._reserved -= pending.nbytes
                self._put_back(key, final, backup)
                raise _storage_error(exc, key, self.directory, "committing") from exc
        if backup is not None:
            _unlink_or_log(backup, f"a second name of the older file of {key!r}")
        self._reserved -= pending.nbytes
        old = self.index.get(key)
        if old is not None:
            self._used -= old.nbytes
        self.index[key] = DiskRecord(size, mode, pending.nbytes, pending.expires_at)
        self._used += pending.nbytes

    def _put_back(self, key: str, final: str, backup: str | None) -> None:
        """Undo a rename into ``final`` whose durability failed: the older file back (``backup``, a second name of
        it), or the new one removed where there was none."""
        try:
            if backup is not None:
                os.replace(backup, final)
                return
            os.unlink(final)
        except FileNotFoundError:
            pass
        except OSError as exc:
            # A second failure of a failing device: the older file cannot come back. The new one, never
            # acknowledged, must not be served (or found at the next start) in its place.
            log.error("disk tier: could not put the older file of %r back after a failed commit (%s)", key, exc)
            if backup is not None:
                _unlink_or_log(final, f"the unacknowledged file of {key!r}")
                _unlink_or_log(backup, f"a second name of the older file of {key!r}")
        if key in self.index:  # the older file is gone: so is its record
            self._forget(key)

    def close(self) -> None:
        """Let another store open this folder (idempotent)."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)

    def set_expiry(self, key: str, expires_at: float) -> None:
        """Rewrite the expiry in ``key``'s header in place (a few bytes; the payload is untouched).

        The header is verified first (checksum, key, mode, size, file length), so a damaged one is never sealed
        with a fresh checksum: ``CorruptData`` when it fails (the caller marks the file corrupt), ``OSError``
        when the file cannot be read or written."""
        rec = self.index.get(key)
        if rec is None or rec.expires_at == expires_at:
            return
        path = os.path.join(self.directory, file_name(key))
        try:
            with open(path, "r+b", buffering=0) as f:
                raw = f.read(HEADER_BYTES)
                f.seek(0)
                hkey, size, mode, _, _ = self._read_header(f, path)
                key_raw = hkey.encode()
                if hkey != key or size != rec.size or mode is not rec.mode:
                    raise CorruptData(
                        f"{path}: header names {hkey!r} ({mode.value}, {size} bytes), expected {key!r} "
                        f"({rec.mode.value}, {rec.size} bytes)"
                    )
                nbytes, expected = os.fstat(f.fileno()).st_size, HEADER_BYTES + len(key_raw) + size
                if nbytes != expected:
                    raise CorruptData(f"{path}: {nbytes} bytes on disk, header says {expected}")
                fields = list(_HEADER.unpack_from(raw))
                fields[7] = expires_at
                head = _HEADER.pack(*fields)
                f.seek(0)
                f.write(head + _CRC.pack(xxhash.xxh32_intdigest(head + key_raw)))
                if self._sync or mode is WriteMode.WRITE_THROUGH:
                    os.fsync(f.fileno())  # a durable version's expiry survives a power loss too
        except FileNotFoundError as exc:
            raise CorruptData(f"{path}: object file is missing") from exc
        rec.expires_at = expires_at

    def discard(self, pending: PendingFile, *, give_back: bool = True) -> None:
        """Drop a temp file not committed; its reservation goes back (unless ``give_back`` is False: given back
        already)."""
        _unlink_or_log(pending.path, "a temporary file not committed")
        if give_back:
            self._reserved -= pending.nbytes

    def remove(self, key: str) -> bool:
        """Delete ``key``'s file; False when it has none. The file goes first: ``ServerError`` with nothing changed
        (the file still indexed and counted) when it cannot be deleted (a read-only remount, EIO, EPERM), so that
        no file outlives its record to come back at the next start."""
        rec = self.index.get(key)
        if rec is None:
            return False
        try:
            os.unlink(os.path.join(self.directory, file_name(key)))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise ServerError(f"SSD tier: cannot delete the file of {key!r} in {self.directory}: {exc}") from exc
        else:
            if self._sync or rec.mode is WriteMode.WRITE_THROUGH:
                try:
                    _fsync_dir(self.directory)  # a durable version's delete survives a power loss too
                except OSError as exc:  # the file is gone from the folder: only its durability is in doubt
                    log.warning("disk tier: the folder's fsync after deleting %r's file failed: %s", key, exc)
        del self.index[key]
        self._used -= rec.nbytes
        return True

    # -- reads ---------------------------------------------------------------------------------
    def read_into(self, key: str, dest: memoryview) -> None:
        """Fill ``dest`` with ``key``'s payload and verify it; CorruptData when that fails.

        Touches no shared state, so it runs outside the engine's lock; the engine decides (under
        the lock) whether a failure means corruption (:meth:`mark_corrupt`) or a concurrent
        replacement of the file.
        """
        path = os.path.join(self.directory, file_name(key))
        try:
            with open(path, "rb", buffering=0) as f:
                hkey, size, _mode, checksum, _ = self._read_header(f, path)
                if hkey != key or size != len(dest):
                    raise CorruptData(f"{path}: header names {hkey!r} of {size} bytes, expected {key!r} of {len(dest)}")
                got = f.readinto(dest) if size else 0
                if got != size or f.read(1):
                    raise CorruptData(f"{path}: payload is {got} bytes (or longer), header says {size}")
                if xxhash.xxh64_intdigest(dest) != checksum:
                    raise CorruptData(f"{path}: payload checksum mismatch")
        except FileNotFoundError as exc:
            raise CorruptData(f"{path}: object file is missing") from exc

    def mark_corrupt(self, key: str, why: str) -> None:
        """Forget ``key``'s file, count it, and move it aside so it is never served again."""
        self._forget(key)
        path = os.path.join(self.directory, file_name(key))
        if os.path.exists(path):
            self._quarantine(path, why, key)
        else:
            self.corrupt += 1
            log.error("disk tier: object file of %r is gone (%s)", key, why)

    def _forget(self, key: str) -> None:
        rec = self.index.pop(key, None)
        if rec is not None:
            self._used -= rec.nbytes


def _storage_error(exc: OSError, key: str, directory: str, doing: str = "writing") -> KvstrataError:
    """What a failed write of ``key``'s file says to the writer: the SSD tier's file system full (before the tier's own
    size is reached: other files share it) is a ``CapacityError`` like a full tier; any other failure of the device
    a ``ServerError`` naming it."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why = exc.strerror
        return CapacityError(f"SSD tier full: the file system of {directory} has no room left for {key!r} ({why})")
    return ServerError(f"SSD tier: {doing} {key!r} to {directory} failed: {exc}")


def _unlink_or_log(path: str, what: str) -> None:
    """Delete ``path`` (``what`` it is, for the log); a failure is logged, not raised (a file that may stay)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("disk tier: cannot delete %s, %s (%s); it stays", what, path, exc)


def _lock_directory(directory: str) -> int:
    """Hold an exclusive lock on ``directory/.lock`` for this tier's lifetime (released by the kernel when
    the process dies): a second store on the same folder would delete the first one's files at start."""
    fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise KvstrataError(
            f"disk_dir: {directory} is in use by another kvstrata store (worker or embedded client); "
            "give each store its own folder"
        ) from None
    return fd


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["FORMAT_VERSION", "HEADER_BYTES", "MAGIC", "DiskRecord", "DiskTier", "PendingFile", "file_name"]
