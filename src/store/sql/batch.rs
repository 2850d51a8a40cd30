//! The SQL of a batch: one statement per chunk of rows, built per dialect
//! ([`BatchSql`]), with the table names and columns ([`Queries`]).

use super::*;

pub(super) struct Queries {
    pub(super) clock: SqlStr,
    pub(super) pending_triggers: SqlStr,
    pub(super) status: SqlStr,
    pub(super) history_all: SqlStr,
    pub(super) history_job: SqlStr,
    /// The heartbeat's upsert of its registry row ([`SqlStore::at_now`]).
    pub(super) beat: SqlStr,
    /// The live registry rows, with the store's `now`.
    pub(super) live_nodes: SqlStr,
    /// Deletes registry rows ended longer ago than the bound duration.
    pub(super) forget_nodes: SqlStr,
    /// [`Queries::beat`] and [`Queries::live_nodes`] in one call (each call
    /// is a wake of the runtime, and on SQLite of sqlx's thread: most of an
    /// idle node's CPU): on SQLite as one list of statements, which sqlx's
    /// SQLite worker runs in one call (there only for a beat that cannot
    /// run on the calling thread, [`super::sqlite::beat`]: on a file not in
    /// WAL mode); on PostgreSQL as one statement (the
    /// upsert in a `WITH`); `None` on MySQL/MariaDB, where a prepared
    /// statement is one statement and an upsert cannot be a `WITH`.
    pub(super) beat_live: Option<SqlStr>,
    /// As [`Queries::beat_live`], then [`Queries::pending_triggers`]: on
    /// SQLite the three statements as one list; on PostgreSQL one
    /// statement, the requests' rows after the nodes' (their job and id
    /// in two columns more, NULL in the nodes' rows, and every node column
    /// NULL in theirs); `None` on MySQL/MariaDB.
    pub(super) beat_live_pending: Option<SqlStr>,
    /// MySQL/MariaDB, after [`Queries::beat`] on its own: the live rows and
    /// the pending requests in one statement (their rows after the nodes',
    /// as PostgreSQL's [`Queries::beat_live_pending`]); `None` elsewhere.
    pub(super) live_pending: Option<SqlStr>,
}

pub(super) const RUN_COLUMNS: &str = "job, fence, owner, node, occurrence, started_at, finished_at, outcome, exit_code, takeover, delay_ms, decision_ms, output, trigger_id, cpu_ms, memory_peak";

/// The columns of a node registry row, as `nodes` reads them.
pub(super) const NODE_COLUMNS: &str = "owner, node, version, started_at, last_seen, expires_at, clock_offset_ms, jobs_held, definitions, running_runs, tags, claimed_through, releases";

pub(super) const LOCK_COLUMNS: &str = "lock_name, owner, fence, expires_at, last_occurrence, modified_at, running, trigger_id, last_trigger";

/// Rows per multi-row statement: far below every database's bind limit
/// (SQLite 32766, MySQL and PostgreSQL 65535) at 16 columns.
pub(super) const CHUNK: usize = 500;

/// Output tails per history insert, in bytes: a statement stays below
/// MySQL's and MariaDB's `max_allowed_packet` (64 MiB and 16 MiB by
/// default), also on a server set as low as 4 MiB.
pub(super) const OUTPUT_PER_STATEMENT: usize = 2 * 1024 * 1024;

impl Queries {
    pub(super) fn new(d: &Dialect, p: &str) -> Self {
        let now = d.now_ms;
        let q = |sql: String| -> SqlStr {
            let sql = if d.numbered_params {
                number_params(&sql)
            } else {
                sql
            };
            AssertSqlSafe(sql).into_sql_str()
        };
        let at = |sql: String| -> SqlStr { AssertSqlSafe(bound_now(d, &sql)).into_sql_str() };
        let beat = format!(
            "INSERT INTO {p}nodes ({NODE_COLUMNS}) VALUES (?, ?, ?, ?, {{now}}, {{now}} + ?, ?, ?, ?, ?, ?, ?, ?){}",
            d.upsert_node
        );
        let live = format!(
            "SELECT {NODE_COLUMNS}, {{now}} AS now_ms FROM {p}nodes WHERE expires_at > {{now}}"
        );
        let pending = format!(
            "SELECT lock_name, trigger_id FROM {p}lock_info WHERE trigger_id IS NOT NULL ORDER BY lock_name"
        );
        let file_clock = d.now_ms == FILE_NOW;
        Queries {
            clock: q(format!("SELECT {now}")),
            pending_triggers: q(pending.clone()),
            status: q(format!(
                "SELECT lock_name, owner, fence, expires_at, last_occurrence, {now} AS now_ms, paused FROM {p}lock_info ORDER BY lock_name"
            )),
            history_all: q(format!(
                "SELECT {RUN_COLUMNS} FROM {p}job_runs ORDER BY id DESC LIMIT ?"
            )),
            history_job: q(format!(
                "SELECT {RUN_COLUMNS} FROM {p}job_runs WHERE job = ? ORDER BY id DESC LIMIT ?"
            )),
            beat: at(beat.clone()),
            live_nodes: at(live.clone()),
            forget_nodes: at(format!(
                "DELETE FROM {p}nodes WHERE expires_at < {{now}} - ?"
            )),
            beat_live: if file_clock {
                Some(at(format!("{beat}; {live}")))
            } else if d.numbered_params {
                Some(at(pg_beat_live(&beat, p, "")))
            } else {
                None
            },
            beat_live_pending: if file_clock {
                Some(at(format!("{beat}; {live}; {pending}")))
            } else if d.numbered_params {
                // The requests' rows: NULL in every node column (the
                // branches before them set those columns' types).
                Some(at(pg_beat_live(&beat, p, &requests_after_nodes(p))))
            } else {
                None
            },
            live_pending: (!file_clock && !d.numbered_params).then(|| {
                at(format!(
                    "SELECT {NODE_COLUMNS}, {{now}} AS now_ms, NULL AS trigger_job, NULL AS trigger_id \
                     FROM {p}nodes WHERE expires_at > {{now}}{}",
                    requests_after_nodes(p)
                ))
            }),
        }
    }
}

/// PostgreSQL's beat as one statement ([`Queries::beat_live`]): the
/// upsert `beat` in a `WITH`, then the live rows. Its main query reads the
/// snapshot taken before the upsert, so the beat's own row comes from
/// `RETURNING` and the table gives the others (`$1`: the owner, the
/// upsert's first parameter). Each node row ends in two NULL columns,
/// typed as a request's job and id, for `more` (`UNION ALL` branches of
/// the requests, or nothing).
fn pg_beat_live(beat: &str, p: &str, more: &str) -> String {
    format!(
        "WITH beat AS ({beat} RETURNING {NODE_COLUMNS}) \
         SELECT {NODE_COLUMNS}, {{now}} AS now_ms, NULL::text AS trigger_job, NULL::bigint AS trigger_id FROM beat \
         UNION ALL SELECT {NODE_COLUMNS}, {{now}} AS now_ms, NULL::text, NULL::bigint FROM {p}nodes \
         WHERE expires_at > {{now}} AND owner <> $1{more}"
    )
}

/// The pending requests' rows after the live nodes' in one statement
/// (`UNION ALL`): NULL in every node column (the branches before them set
/// those columns' types), then their job and id.
fn requests_after_nodes(p: &str) -> String {
    let nulls = vec!["NULL"; NODE_ROW_COLUMNS].join(", ");
    format!(
        " UNION ALL SELECT {nulls}, lock_name, trigger_id FROM {p}lock_info WHERE trigger_id IS NOT NULL"
    )
}

/// Columns of a live registry row as read: [`NODE_COLUMNS`] and the
/// store's `now`.
pub(super) const NODE_ROW_COLUMNS: usize = 14;

/// Where `{now}` is the file-system clock's instant ([`Dialect::now_ms`]
/// is `{now}` itself: SQLite).
pub(super) const FILE_NOW: &str = "{now}";

/// `sql` (with `{now}` for the store's clock) as a statement whose text is
/// the same at every call, so each connection prepares it once: on SQLite
/// `{now}` becomes the parameter `?1` and the other placeholders `?2`,
/// `?3`… in order ([`SqlStore::at_now`] binds the instant first, then the
/// caller its values); elsewhere `{now}` is the database's own clock and
/// the placeholders are the dialect's. As [`number_params`], it takes every
/// `?` for a placeholder: the text has none in a literal, and none already
/// numbered (sqlx binds a missing argument as NULL without an error, so a
/// miscount would go unnoticed).
pub(super) fn bound_now(d: &Dialect, sql: &str) -> String {
    debug_assert!(
        !sql.as_bytes()
            .windows(2)
            .any(|w| w[0] == b'?' && w[1].is_ascii_digit()),
        "already numbered: {sql}"
    );
    if d.now_ms != FILE_NOW {
        let sql = sql.replace("{now}", d.now_ms);
        return if d.numbered_params {
            number_params(&sql)
        } else {
            sql
        };
    }
    let mut out = String::with_capacity(sql.len() + 16);
    let mut n = 1;
    let mut rest = sql;
    while let Some(i) = rest.find(['?', '{']) {
        out.push_str(&rest[..i]);
        if rest[i..].starts_with('?') {
            n += 1;
            out.push('?');
            out.push_str(&n.to_string());
            rest = &rest[i + 1..];
        } else if let Some(after) = rest[i..].strip_prefix(FILE_NOW) {
            out.push_str("?1");
            rest = after;
        } else {
            out.push('{');
            rest = &rest[i + 1..];
        }
    }
    out.push_str(rest);
    out
}

/// `(?, ?, ...)` with `n` placeholders.
pub(super) fn tuple(n: usize) -> String {
    let mut out = String::with_capacity(2 + 3 * n);
    out.push('(');
    for i in 0..n {
        if i > 0 {
            out.push_str(", ");
        }
        out.push('?');
    }
    out.push(')');
    out
}

/// `rows` tuples of `cols` placeholders, comma-separated.
pub(super) fn tuples(rows: usize, cols: usize) -> String {
    vec![tuple(cols); rows].join(", ")
}

/// The multi-row statements of a batch, for `n` rows (placeholders `?`,
/// the clock as `{now}`).
pub(super) struct BatchSql<'a> {
    pub(super) d: &'a Dialect,
    pub(super) p: &'a str,
}

impl BatchSql<'_> {
    /// Reads and locks `n` lock rows, in name order.
    pub(super) fn lock_rows(&self, n: usize) -> String {
        self.lock_rows_in(&tuple(n))
    }

    /// [`Self::lock_rows`] for the names of the JSON array bound as the one
    /// parameter, where the dialect can.
    pub(super) fn lock_rows_from_json(&self) -> Option<String> {
        self.d
            .json_names
            .map(|names| self.lock_rows_in(&format!("({names})")))
    }

    /// Reads and locks the lock rows whose names are `IN names`.
    pub(super) fn lock_rows_in(&self, names: &str) -> String {
        format!(
            "SELECT lock_name, owner, fence, expires_at, last_occurrence, running, {{now}} AS now_ms, paused, trigger_id, last_trigger FROM {p}lock_info WHERE lock_name IN {names} ORDER BY lock_name{lock}",
            p = self.p,
            lock = self.d.lock_row
        )
    }

    /// Creates the missing of `n` lock rows (name bound; empty lease).
    pub(super) fn seed_rows(&self, n: usize) -> String {
        let rows = vec!["(?, NULL, 0, 0, NULL, {now}, 0, NULL, NULL)"; n].join(", ");
        format!(
            "{} {p}lock_info ({LOCK_COLUMNS}) VALUES {rows}{}",
            self.d.insert_ignore,
            self.d.ignore_conflict.replace("{key}", "lock_name"),
            p = self.p
        )
    }

    /// Writes `n` whole lock rows that exist (and are locked).
    pub(super) fn write_rows(&self, n: usize) -> String {
        format!(
            "INSERT INTO {p}lock_info ({LOCK_COLUMNS}) VALUES {rows}{upsert}",
            p = self.p,
            rows = tuples(n, 9),
            upsert = self.d.upsert_lock
        )
    }

    /// Writes whole lock rows that exist (and are locked) from the JSON
    /// array bound as the one parameter, where the dialect can.
    pub(super) fn write_rows_from_json(&self) -> Option<String> {
        self.d.json_lock_rows.map(|source| {
            format!(
                "INSERT INTO {p}lock_info ({LOCK_COLUMNS}) SELECT {LOCK_COLUMNS} FROM {source}{upsert}",
                p = self.p,
                upsert = self.d.upsert_lock
            )
        })
    }

    /// Ends one owner's live leases on `n` jobs.
    pub(super) fn release(&self, n: usize) -> String {
        format!(
            "UPDATE {p}lock_info SET expires_at = {{now}}, modified_at = {{now}} WHERE owner = ? AND expires_at > {{now}} AND lock_name IN {names}",
            p = self.p,
            names = tuple(n)
        )
    }

    /// The newest run of each of `n` jobs (those with any).
    pub(super) fn last_runs(&self, n: usize) -> String {
        format!(
            "SELECT {cols} FROM {p}job_runs r JOIN (SELECT MAX(id) AS last_id FROM {p}job_runs WHERE job IN {names} GROUP BY job) m ON r.id = m.last_id",
            cols = RUN_COLUMNS
                .split(", ")
                .map(|c| format!("r.{c}"))
                .collect::<Vec<_>>()
                .join(", "),
            p = self.p,
            names = tuple(n)
        )
    }

    /// Records `n` runs, skipping a (job, fence) recorded already.
    pub(super) fn insert_runs(&self, n: usize) -> String {
        format!(
            "{} {p}job_runs ({RUN_COLUMNS}) VALUES {rows}{}",
            self.d.insert_ignore,
            self.d.ignore_conflict.replace("{key}", "job, fence"),
            p = self.p,
            rows = tuples(n, 16)
        )
    }

    /// Sets or clears the pause mark of `n` locks (the mark bound first).
    pub(super) fn set_paused(&self, n: usize) -> String {
        format!(
            "UPDATE {p}lock_info SET paused = ? WHERE lock_name IN {names}",
            p = self.p,
            names = tuple(n)
        )
    }

    /// Ends the running mark of `n` locks, each only at the fence its run
    /// was claimed with.
    pub(super) fn run_over(&self, n: usize) -> String {
        let cond = vec!["(lock_name = ? AND fence = ?)"; n].join(" OR ");
        format!(
            "UPDATE {p}lock_info SET running = 0 WHERE running <> 0 AND ({cond})",
            p = self.p
        )
    }

    /// Deletes, for `n` jobs, the runs at or below a fence each.
    pub(super) fn prune(&self, n: usize) -> String {
        let cond = vec!["(job = ? AND fence <= ?)"; n].join(" OR ");
        format!("DELETE FROM {p}job_runs WHERE {cond}", p = self.p)
    }
}

/// `?` → `$1, $2, ...` (none of our statements has a `?` inside a literal).
pub(super) fn number_params(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(c);
        }
    }
    out
}

impl SqlStore {
    /// The multi-row statements, for this store's dialect and prefix.
    pub(super) fn batch(&self) -> BatchSql<'_> {
        BatchSql {
            d: self.dialect,
            p: &self.prefix,
        }
    }

    /// A generated statement ready to run: `{now}` is the store's clock
    /// (SQLite: `now` if given, else the file-system clock read now), and
    /// placeholders are numbered where the dialect wants it.
    pub(super) fn sql(&self, text: String, now: Option<i64>) -> Result<SqlStr, sqlx::Error> {
        let now = match now {
            Some(now) => Some(now),
            None => self.file_clock_now()?,
        };
        let text = match now {
            Some(now) => text.replace("{now}", &now.to_string()),
            None => text.replace("{now}", self.dialect.now_ms),
        };
        let text = if self.dialect.numbered_params {
            number_params(&text)
        } else {
            text
        };
        Ok(AssertSqlSafe(text).into_sql_str())
    }

    /// `sql`, one of the [`Queries`] built by [`bound_now`], ready for the
    /// caller's values: on SQLite with the store's clock bound first (`now`
    /// if given, else the file-system clock read now).
    pub(super) fn at_now(
        &self,
        sql: &SqlStr,
        now: Option<i64>,
    ) -> Result<sqlx::query::Query<'static, sqlx::Any, sqlx::any::AnyArguments>, sqlx::Error> {
        let query = sqlx::query(sql.clone());
        if self.dialect.now_ms != FILE_NOW {
            return Ok(query);
        }
        let now = match now {
            Some(now) => now,
            None => self.file_clock_now()?.ok_or_else(|| {
                sqlx::Error::Protocol("no file-system clock for a SQLite store".into())
            })?,
        };
        Ok(query.bind(now))
    }
}
