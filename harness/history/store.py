"""The run history file: one SQLite database, its schema versioned and migrated, safe under
concurrent writers, never overwritten when it is not ours.

Identity: ``PRAGMA application_id`` is ``APPLICATION_ID`` and ``PRAGMA user_version`` the schema
version. Opening a path (``open_history``):

- nothing there, or an empty file: a new history is created (schema ``SCHEMA_VERSION``, WAL);
- a file that is not SQLite, a SQLite file of another application (another id, or tables without
  ours), a history of a newer schema than this harness knows, or a damaged one (``quick_check``):
  ``HistoryError`` (exit 2, one line naming the file) and the file is left exactly as it was;
- an older schema: migrated in place, in one transaction (``MIGRATIONS``), before anything else.

Concurrency: xdist workers, parallel engine processes and several nights on one runner all
append to the same file. The journal is WAL (readers never block the writer), every write is one
``BEGIN IMMEDIATE`` transaction, and a writer waits for the lock up to ``BUSY_TIMEOUT_S``
(``sqlite3``'s ``timeout``, SQLite's busy handler). A run is written whole or not at all.

A run's id is the caller's (``harness.history.ingest``: a hash of the report it came from), so
ingesting one report twice, or merging a history into another that holds the same runs, adds
nothing (``add_run`` and ``merge`` are idempotent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import sqlite3
import stat
import tempfile
from pathlib import Path

from harness.exitcodes import CLIError

APPLICATION_ID = 0x48593448  # "HY4H": this harness's run history
SCHEMA_VERSION = 3
BUSY_TIMEOUT_S = 120.0  # a writer waits this long for another's transaction (a merge of a large file)
SQLITE_MAGIC = b"SQLite format 3\x00"

# MIGRATIONS[v]: the statements that take a history from schema v - 1 to v (v = 1 creates it).
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY,       -- the ingest's content hash: one report is one run
            started_at TEXT NOT NULL,      -- ISO 8601 UTC
            kind TEXT NOT NULL,            -- bisect-check, compare, engine, gpu-tier, autobisect-step
            source TEXT,                   -- the report it came from (as given)
            exit_code INTEGER,
            verdict TEXT NOT NULL,         -- good, bad, bad input, cannot judge, interrupted
            gpu TEXT, capability TEXT, torch TEXT, cuda TEXT,
            platform TEXT,                 -- the key above as one string (harness.history.store.platform_of)
            vllm TEXT, vllm_commit TEXT, harness_commit TEXT, host TEXT,
            seconds REAL,
            extra TEXT                     -- JSON: what else the report said (first line, not judged, ...)
        )""",
        """CREATE TABLE components (
            run_id TEXT NOT NULL REFERENCES runs(run_id),
            case_id TEXT NOT NULL,
            component TEXT NOT NULL,       -- step{k}.<component> (side by side), <component> (engine)
            max_abs REAL, mean_abs REAL, max_rel REAL,
            atol REAL, rtol REAL,
            ratio REAL,                    -- max_abs / atol: how much of the tolerance's absolute part is used
            passed INTEGER,
            note TEXT,
            PRIMARY KEY (run_id, case_id, component)
        )""",
        """CREATE TABLE acceptance (
            run_id TEXT NOT NULL REFERENCES runs(run_id),
            case_id TEXT NOT NULL,
            request TEXT NOT NULL,         -- "request i", or "all" (the case's sum)
            accepted INTEGER, drafted INTEGER, rate REAL,
            PRIMARY KEY (run_id, case_id, request)
        )""",
        "CREATE INDEX runs_by_time ON runs (started_at)",
    ),
    # schema 2: acceptance per draft position, timings per phase, and the label of a run (the
    # autobisect session a step belongs to, the nightly it ran in)
    2: (
        "ALTER TABLE runs ADD COLUMN label TEXT",
        """CREATE TABLE acceptance_position (
            run_id TEXT NOT NULL REFERENCES runs(run_id),
            case_id TEXT NOT NULL,
            position INTEGER NOT NULL,     -- draft position j (0 = the first draft token)
            accepted INTEGER, drafted INTEGER, rate REAL,
            PRIMARY KEY (run_id, case_id, position)
        )""",
        """CREATE TABLE timings (
            run_id TEXT NOT NULL REFERENCES runs(run_id),
            case_id TEXT NOT NULL,         -- "" for the run as a whole
            phase TEXT NOT NULL,
            seconds REAL,
            PRIMARY KEY (run_id, case_id, phase)
        )""",
        "CREATE INDEX components_by_key ON components (case_id, component)",
    ),
    # schema 3: a golden / baseline comparison's max |d| over the rows settled run to run (the
    # order-variant rows left out), which the drift rule reads where it is recorded
    3: ("ALTER TABLE components ADD COLUMN max_abs_settled REAL",),
}

RUN_FIELDS = ("run_id", "started_at", "kind", "source", "exit_code", "verdict", "gpu", "capability", "torch",
              "cuda", "platform", "vllm", "vllm_commit", "harness_commit", "host", "seconds", "extra", "label")
COMPONENT_FIELDS = ("case_id", "component", "max_abs", "mean_abs", "max_rel", "atol", "rtol", "ratio", "passed",
                    "note", "max_abs_settled")
ACCEPTANCE_FIELDS = ("case_id", "request", "accepted", "drafted", "rate")
POSITION_FIELDS = ("case_id", "position", "accepted", "drafted", "rate")
TIMING_FIELDS = ("case_id", "phase", "seconds")


class HistoryError(CLIError):
    """A history file this harness refuses (not SQLite, another application's, a newer schema,
    damaged) or cannot use: one line, exit 2; the file is left as it was."""


@dataclasses.dataclass
class Run:
    """One run and its rows, as ``add_run`` writes them (``harness.history.ingest`` builds it)."""

    run_id: str
    started_at: str
    kind: str
    verdict: str
    exit_code: int | None = None
    source: str | None = None
    gpu: str | None = None
    capability: str | None = None
    torch: str | None = None
    cuda: str | None = None
    vllm: str | None = None
    vllm_commit: str | None = None
    harness_commit: str | None = None
    host: str | None = None
    seconds: float | None = None
    label: str | None = None
    extra: dict = dataclasses.field(default_factory=dict)
    components: list[dict] = dataclasses.field(default_factory=list)
    acceptance: list[dict] = dataclasses.field(default_factory=list)
    positions: list[dict] = dataclasses.field(default_factory=list)
    timings: list[dict] = dataclasses.field(default_factory=list)

    @property
    def platform(self) -> str:
        return platform_of(self.gpu, self.capability, self.torch, self.cuda)


def platform_of(gpu, capability, torch, cuda) -> str:
    """The platform key as one string: ``NVIDIA H200 (sm 9.0), torch 2.11.0+cu130, CUDA 13.0``."""
    return f"{gpu or 'no GPU'}" + (f" (sm {capability})" if capability else "") + \
        f", torch {torch or '?'}, CUDA {cuda or '?'}"


def verdict_of(code: int | None) -> str:
    """The word for an exit code of the contract (``harness.exitcodes``)."""
    return {0: "good", 1: "bad", 2: "bad input", 125: "cannot judge", 130: "interrupted",
            143: "interrupted"}.get(code, "cannot judge" if code is not None else "unknown")


# ---- opening -----------------------------------------------------------------------------------


def _refuse(path, why: str) -> HistoryError:
    return HistoryError(f"history {path}: {why} (refused; the file is left as it is)")


def _preflight(path: Path) -> bool:
    """Whether ``path`` holds something (False: nothing, or an empty file); a directory, a device,
    a file that is not SQLite: ``HistoryError``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise HistoryError(f"history {path}: directory {path.parent} does not exist") from None
        return False
    except OSError as exc:
        raise HistoryError(f"history {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is a directory, not a history file")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "is not a regular file")
    if st.st_size == 0:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise HistoryError(f"history {path}: cannot read it: {exc.strerror or exc}") from None
    if head != SQLITE_MAGIC:
        raise _refuse(path, "not a SQLite database (no SQLite header)")
    return True


def _connect(path: Path, readonly: bool) -> sqlite3.Connection:
    uri = f"file:{path}?mode=ro" if readonly else f"file:{path}"
    conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                           check_same_thread=False)
    conn.row_factory = sqlite3.Row
    return conn


def _identity(conn: sqlite3.Connection) -> tuple[int, int, int]:
    """(application_id, user_version, number of tables), read from one snapshot: in autocommit
    each statement would see its own, and a writer creating the history between them would show
    its tables without its application_id (a new history refused as another application's)."""
    own = not conn.in_transaction
    if own:
        conn.execute("BEGIN")
    try:
        tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        ver = conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        if own:
            conn.execute("COMMIT")
    return app, ver, tables


def _check_identity(path, app: int, ver: int, tables: int) -> None:
    if app == 0 and tables == 0 and ver == 0:
        return  # a new, empty database: ours to create
    if app != APPLICATION_ID:
        raise _refuse(path, f"a SQLite database of another application (application_id {app:#x}, "
                            f"{tables} table(s)), not a run history")
    if ver > SCHEMA_VERSION:
        raise _refuse(path, f"history schema {ver} is newer than this harness's {SCHEMA_VERSION}: "
                            "update the harness to read it")
    if ver < 1:
        raise _refuse(path, "marked as a run history but holds no schema version")


def _migrate(conn: sqlite3.Connection, path) -> None:
    """Bring the schema to ``SCHEMA_VERSION`` in one transaction (another process doing the same
    at once waits, then finds it done)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        app, ver, tables = _identity(conn)
        _check_identity(path, app, ver, tables)
        for v in range(ver + 1, SCHEMA_VERSION + 1):
            for stmt in MIGRATIONS[v]:
                conn.execute(stmt)
        if ver < SCHEMA_VERSION:
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def open_history(path, *, readonly: bool = False, check: bool = True) -> sqlite3.Connection:
    """A connection to the history at ``path`` (created when nothing is there, migrated when older),
    or ``HistoryError``. ``readonly``: never created nor migrated (an older schema is read through
    a migrated temporary copy, ``read_copy``). ``check``: run SQLite's ``quick_check`` first."""
    path = Path(path)
    exists = _preflight(path)
    if readonly and not exists:
        raise HistoryError(f"history {path}: no such history file")
    with contextlib.nullcontext() if readonly else _setup_lock(path):
        return _open_checked(path, exists, readonly, check)


@contextlib.contextmanager
def _setup_lock(path: Path):
    """Writers that open one history at once take turns to check, create and migrate it: creating
    the tables and switching the journal to WAL while another process reads the new file gave it
    "database is locked", or tables without the application_id. The lock is an flock on a file
    beside the history (``.NAME.lock``), never on the database: closing any descriptor of the
    database would drop the POSIX locks SQLite holds on it in this process. The appends that
    follow still run concurrently, under SQLite's own locking."""
    lock = path.with_name(f".{path.name}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise HistoryError(f"history {path}: cannot create its lock {lock}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _open_checked(path: Path, exists: bool, readonly: bool, check: bool) -> sqlite3.Connection:
    try:
        conn = _connect(path, readonly)
    except sqlite3.Error as exc:
        raise HistoryError(f"history {path}: cannot open it: {exc}") from None
    try:
        app, ver, tables = _identity(conn)
        _check_identity(path, app, ver, tables)
        if check and exists:
            bad = [r[0] for r in conn.execute("PRAGMA quick_check(3)").fetchall()]
            if bad != ["ok"]:
                raise _refuse(path, f"damaged ({'; '.join(map(str, bad))[:200]})")
        if not readonly:
            if ver < SCHEMA_VERSION:
                conn.execute("PRAGMA journal_mode = WAL")  # persistent in the file
                _migrate(conn, path)
        elif ver < SCHEMA_VERSION:
            raise _refuse(path, f"history schema {ver} is older than {SCHEMA_VERSION} and it is opened read-only")
    except HistoryError:
        conn.close()
        raise
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise _refuse(path, f"damaged or not a database ({exc})") from None
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def check_history(path) -> None:
    """``HistoryError`` (exit 2) for a history file no run could append to: asked before a
    command runs its cases, so a bad ``--history`` costs no GPU time. Creates nothing."""
    path = Path(path)
    if not _preflight(path):
        return
    conn = _connect(path, readonly=True)
    try:
        app, ver, tables = _identity(conn)
        _check_identity(path, app, ver, tables)
        bad = [r[0] for r in conn.execute("PRAGMA quick_check(3)").fetchall()]
        if bad != ["ok"]:
            raise _refuse(path, f"damaged ({'; '.join(map(str, bad))[:200]})")
    except sqlite3.DatabaseError as exc:
        raise _refuse(path, f"damaged or not a database ({exc})") from None
    finally:
        conn.close()


def read_copy(path) -> tuple[sqlite3.Connection, str | None]:
    """(a connection to read ``path`` through, a temporary file to remove afterwards or None): a
    history of an older schema is copied and the copy migrated, the original left untouched."""
    path = Path(path)
    if not _preflight(path):
        raise HistoryError(f"history {path}: no such history file, or an empty one")
    conn = _connect(path, readonly=True)
    try:
        app, ver, tables = _identity(conn)
        _check_identity(path, app, ver, tables)
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise _refuse(path, f"damaged or not a database ({exc})") from None
    if ver == SCHEMA_VERSION:
        conn.close()
        return open_history(path, readonly=True), None
    conn.close()
    fd, tmp = tempfile.mkstemp(prefix=".hyv4-history-", suffix=".sqlite")
    os.close(fd)
    src = _connect(path, readonly=True)
    dst = sqlite3.connect(tmp)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return open_history(tmp), tmp


# ---- writing -----------------------------------------------------------------------------------


def _insert(conn, table: str, fields: tuple[str, ...], run_id: str, rows) -> None:
    cols = ("run_id",) + fields
    conn.executemany(f"INSERT OR IGNORE INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                     [(run_id, *(r.get(f) for f in fields)) for r in rows])


def add_run(conn: sqlite3.Connection, run: Run) -> bool:
    """Write ``run`` and its rows in one transaction; False (nothing written) when its id is there."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        if conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run.run_id,)).fetchone():
            conn.execute("ROLLBACK")
            return False
        values = {f: getattr(run, f, None) for f in RUN_FIELDS}
        values["platform"] = run.platform
        values["extra"] = json.dumps(run.extra, sort_keys=True, default=str)
        conn.execute(f"INSERT INTO runs ({', '.join(RUN_FIELDS)}) VALUES ({', '.join('?' * len(RUN_FIELDS))})",
                     [values[f] for f in RUN_FIELDS])
        _insert(conn, "components", COMPONENT_FIELDS, run.run_id, run.components)
        _insert(conn, "acceptance", ACCEPTANCE_FIELDS, run.run_id, run.acceptance)
        _insert(conn, "acceptance_position", POSITION_FIELDS, run.run_id, run.positions)
        _insert(conn, "timings", TIMING_FIELDS, run.run_id, run.timings)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return True


def append(path, run: Run) -> bool:
    """Open the history at ``path``, add ``run``, close: what each producer does once per run."""
    conn = open_history(path)  # checked first: a damaged file is refused, never written into
    try:
        return add_run(conn, run)
    finally:
        conn.close()


_TABLES = (("components", COMPONENT_FIELDS), ("acceptance", ACCEPTANCE_FIELDS),
           ("acceptance_position", POSITION_FIELDS), ("timings", TIMING_FIELDS))


def merge(dest, sources) -> list[tuple[str, int, int]]:
    """Add every run of each history in ``sources`` that ``dest`` lacks (created if absent):
    [(source, runs added, runs already there)]. Each source is checked like any history (a
    foreign, damaged or newer one: ``HistoryError`` before anything is written); an older one is
    read through a migrated copy. One transaction per source."""
    dest = Path(dest)
    srcs = [Path(s) for s in sources]
    for s in srcs:
        if s.exists() and dest.exists() and os.path.samefile(s, dest):
            raise HistoryError(f"history merge: {s} is the destination itself")
    opened = []
    try:
        for s in srcs:  # every source checked before the destination is touched
            opened.append((s, *read_copy(s)))
        out = open_history(dest)
        result = []
        try:
            for s, src, _tmp in opened:
                ids = [r[0] for r in src.execute("SELECT run_id FROM runs ORDER BY started_at, rowid")]
                out.execute("BEGIN IMMEDIATE")
                try:
                    have = {r[0] for r in out.execute("SELECT run_id FROM runs")}
                    new = [i for i in ids if i not in have]
                    for rid in new:
                        row = src.execute(f"SELECT {', '.join(RUN_FIELDS)} FROM runs WHERE run_id = ?",
                                          (rid,)).fetchone()
                        out.execute(f"INSERT INTO runs ({', '.join(RUN_FIELDS)}) "
                                    f"VALUES ({', '.join('?' * len(RUN_FIELDS))})", tuple(row))
                        for table, fields in _TABLES:
                            rows = src.execute(f"SELECT {', '.join(fields)} FROM {table} WHERE run_id = ?",
                                               (rid,)).fetchall()
                            _insert(out, table, fields, rid, [dict(r) for r in rows])
                    out.execute("COMMIT")
                except BaseException:
                    out.execute("ROLLBACK")
                    raise
                result.append((str(s), len(new), len(ids) - len(new)))
        finally:
            out.close()
        return result
    finally:
        for _s, src, tmp in opened:
            src.close()
            if tmp:
                os.unlink(tmp)


def snapshot(src, dest) -> Path:
    """A consistent copy of the history ``src`` as the single file ``dest`` (SQLite's backup: the
    WAL's committed pages included), for a CI artifact."""
    conn = open_history(src, readonly=True, check=False)
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        out = sqlite3.connect(tmp)
        try:
            conn.backup(out)
            out.execute("PRAGMA journal_mode = DELETE")  # one self-contained file
        finally:
            out.close()
        os.replace(tmp, dest)
    finally:
        conn.close()
        if tmp.exists():
            tmp.unlink()
    return dest


# ---- reading -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Filters:
    """Which runs a query sees: ``platform`` (substring of the platform key), ``release`` (vLLM
    version prefix), ``case`` (substring of the case id, for rows), ``since`` / ``until`` (ISO
    dates, inclusive), ``last`` (the last N runs after the other filters), ``kinds`` (run kinds;
    None: every kind but ``exclude_kinds``)."""

    platform: str | None = None
    release: str | None = None
    case: str | None = None
    since: str | None = None
    until: str | None = None
    last: int | None = None
    kinds: tuple[str, ...] | None = None
    exclude_kinds: tuple[str, ...] = ()


def select_runs(conn: sqlite3.Connection, f: Filters | None = None) -> list[dict]:
    """The runs ``f`` selects, oldest first."""
    f = f or Filters()
    where, args = [], []
    if f.platform:
        where.append("instr(lower(platform), lower(?)) > 0")
        args.append(f.platform)
    if f.release:
        where.append("(vllm = ? OR vllm LIKE ?)")
        args += [f.release, f.release + "%"]
    if f.since:
        where.append("started_at >= ?")
        args.append(f.since)
    if f.until:
        where.append("started_at < ?")
        args.append(f.until + "\uffff")  # the whole day of a bare date
    if f.kinds:
        where.append(f"kind IN ({', '.join('?' * len(f.kinds))})")
        args += list(f.kinds)
    if f.exclude_kinds:
        where.append(f"kind NOT IN ({', '.join('?' * len(f.exclude_kinds))})")
        args += list(f.exclude_kinds)
    sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY started_at, rowid"
    runs = [dict(r) for r in conn.execute(sql, args)]
    if f.last:
        runs = runs[-f.last:]
    return runs


def rows_of(conn: sqlite3.Connection, table: str, run_ids, case: str | None = None) -> list[dict]:
    """The rows of ``table`` for ``run_ids`` (case id containing ``case``)."""
    out = []
    ids = list(run_ids)
    for i in range(0, len(ids), 500):  # SQLite's bound-parameter limit
        chunk = ids[i:i + 500]
        sql = f"SELECT * FROM {table} WHERE run_id IN ({', '.join('?' * len(chunk))})"
        args = list(chunk)
        if case:
            sql += " AND instr(case_id, ?) > 0"
            args.append(case)
        out += [dict(r) for r in conn.execute(sql, args)]
    return out
