//! The node registry: one row per owner, written by its heartbeat. A beat
//! sent on its own goes on [`SqlStore::beat_connection`] (on SQLite without
//! an fsync), except on SQLite in WAL mode, where it runs on the calling
//! thread ([`sqlite::beat`]) unless it also deletes long-dead rows (once a
//! minute).

use super::*;

#[async_trait]
impl Registry for SqlStore {
    async fn heartbeat(&self, beat: &Heartbeat) -> Result<Vec<NodeRecord>, StoreError> {
        // Decided once: a retried beat that forgets still forgets.
        let forget = self.forget_due();
        self.retrying(|| async {
            if !forget && let Some(sent) = self.beat_inline(beat, false) {
                return sent.map(|(nodes, _)| nodes);
            }
            let mut held = self.beat_connection().await?;
            let nodes = match self.one_call_beat(forget, false) {
                Some(call) => self
                    .beat_in_one_call(held.conn()?, call, beat)
                    .await
                    .map(|(nodes, _)| nodes),
                None => self.beat_on(held.conn()?, beat, forget).await,
            };
            held.finish(&nodes);
            nodes
        })
        .await
        .map_err(|e| self.err(e))
    }

    /// The beat's statements, then the read of the requests, on one
    /// connection (on SQLite on the calling thread, or, for the beat that
    /// forgets, all in one call to sqlx's thread; on PostgreSQL the beat as
    /// one statement, then the read).
    async fn heartbeat_looking(&self, beat: &Heartbeat) -> Result<registry::Looked, StoreError> {
        let forget = self.forget_due();
        self.retrying(|| async {
            if !forget && let Some(sent) = self.beat_inline(beat, true) {
                return sent;
            }
            let mut held = self.beat_connection().await?;
            let nodes = match self.one_call_beat(forget, true) {
                Some(call) => {
                    let looked = self.beat_in_one_call(held.conn()?, call, beat).await;
                    if call.look {
                        held.finish(&looked);
                        return looked;
                    }
                    looked.map(|(nodes, _)| nodes)
                }
                None if !forget
                    && let Some(looked) = self.beat_then_look(held.conn()?, beat).await =>
                {
                    held.finish(&looked);
                    return looked;
                }
                None => self.beat_on(held.conn()?, beat, forget).await,
            };
            let nodes = match nodes {
                Ok(nodes) => nodes,
                Err(e) => {
                    let done = Err(e);
                    held.finish(&done);
                    return done;
                }
            };
            let pending = self.pending_on(held.conn()?).await;
            held.finish(&pending);
            let pending = match pending {
                Ok(pending) => Some(pending),
                Err(e) => {
                    tracing::debug!(
                        "the look for manual runs sent with a heartbeat failed: {}",
                        self.err(e)
                    );
                    None
                }
            };
            Ok((nodes, pending))
        })
        .await
        .map_err(|e| self.err(e))
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.retrying(|| async {
            let mut conn = self.pool().acquire().await?;
            self.live_nodes(&mut conn, None).await
        })
        .await
        .map_err(|e| self.err(e))
    }

    async fn leave(&self, owner: &Owner) -> Result<(), StoreError> {
        let p = &self.prefix;
        self.retrying(|| async {
            sqlx::query(self.sql(format!("DELETE FROM {p}nodes WHERE owner = ?"), None)?)
                .bind(owner.as_str().to_string())
                .execute(&self.pool())
                .await
        })
        .await
        .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// The beat is written inside the claim transaction, after the lock
    /// rows, and commits (or not) with the claims.
    async fn claim_beating(
        &self,
        requests: &[ClaimRequest],
        beat: &Heartbeat,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        if requests.is_empty() {
            return registry::claim_alongside(self, requests, beat).await;
        }
        match self.locked(Locked::Claim(requests, Some(beat))).await {
            Ok(Answer::Claimed(claimed, nodes)) => Ok((claimed, nodes)),
            Ok(_) => Err(self.err(sqlx::Error::Protocol(
                "a claim answered as something else".into(),
            ))),
            Err(e) => Err(self.err(e)),
        }
    }
}

impl SqlStore {
    /// SQLite: `beat` sent on the calling thread ([`sqlite::beat`]), with
    /// the look when `look`; `None` on the other stores, and on a SQLite
    /// file not in WAL mode.
    pub(super) fn beat_inline(
        &self,
        beat: &Heartbeat,
        look: bool,
    ) -> Option<Result<registry::Looked, sqlx::Error>> {
        #[cfg(feature = "sqlite")]
        if let Some(inline) = &self.inline_beat {
            let now = match self.file_clock_now() {
                Ok(now) => now?,
                Err(e) => return Some(Err(e)),
            };
            let generation = self.generation.load(std::sync::atomic::Ordering::SeqCst);
            return inline.send(generation, &self.queries, now, beat, look);
        }
        let _ = (beat, look);
        None
    }

    /// The pending requests, read on `conn`, sorted by job.
    pub(super) async fn pending_on(
        &self,
        conn: &mut AnyConnection,
    ) -> Result<Vec<(String, TriggerId)>, sqlx::Error> {
        let rows = sqlx::query(self.queries.pending_triggers.clone())
            .fetch_all(&mut *conn)
            .await?;
        Ok(rows.iter().filter_map(|r| pending_row(r, 0)).collect())
    }

    /// The live registry rows, read on `conn` at the store's `now`.
    pub(super) async fn live_nodes(
        &self,
        conn: &mut AnyConnection,
        now: Option<i64>,
    ) -> Result<Vec<NodeRecord>, sqlx::Error> {
        let rows = self
            .at_now(&self.queries.live_nodes, now)?
            .fetch_all(&mut *conn)
            .await?;
        let nodes = rows
            .iter()
            .map(node_record)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(registry::sorted(nodes))
    }

    /// Writes a heartbeat's row, forgets long-dead ones when `forget`,
    /// reads the live ones.
    pub(super) async fn beat_on(
        &self,
        conn: &mut AnyConnection,
        beat: &Heartbeat,
        forget: bool,
    ) -> Result<Vec<NodeRecord>, sqlx::Error> {
        // One reading of SQLite's clock for the three statements.
        let now = self.file_clock_now()?;
        bind_beat(self.at_now(&self.queries.beat, now)?, beat)
            .execute(&mut *conn)
            .await?;
        if forget {
            self.at_now(&self.queries.forget_nodes, now)?
                .bind(duration_ms(registry::FORGET_AFTER))
                .execute(&mut *conn)
                .await?;
        }
        self.live_nodes(conn, now).await
    }

    /// The statement (or SQLite's statement list) that sends a beat in one
    /// call, reading the requests too when `look` and the store can
    /// ([`Queries::beat_live`]; `look` in the answer says whether it
    /// does), where the store has one and the beat does not forget dead
    /// rows too (once a minute: that beat takes the separate statements).
    pub(super) fn one_call_beat(&self, forget: bool, look: bool) -> Option<OneCallBeat<'_>> {
        if forget {
            return None;
        }
        if look && let Some(sql) = self.queries.beat_live_pending.as_ref() {
            return Some(OneCallBeat { sql, look: true });
        }
        let sql = self.queries.beat_live.as_ref()?;
        Some(OneCallBeat { sql, look: false })
    }

    /// A beat sent as `call` ([`one_call_beat`]: the upsert, the live rows,
    /// on SQLite perhaps the pending requests) in one call: the live rows
    /// (fourteen columns) and the requests (two) come back as one stream
    /// of rows; the requests are `None` when the call does not read them.
    ///
    /// [`one_call_beat`]: SqlStore::one_call_beat
    pub(super) async fn beat_in_one_call(
        &self,
        conn: &mut AnyConnection,
        call: OneCallBeat<'_>,
        beat: &Heartbeat,
    ) -> Result<registry::Looked, sqlx::Error> {
        let now = self.file_clock_now()?;
        let rows = bind_beat(self.at_now(call.sql, now)?, beat)
            .fetch_all(&mut *conn)
            .await?;
        let (nodes, pending) = nodes_and_requests(&rows)?;
        Ok((nodes, pending.filter(|_| call.look)))
    }

    /// MySQL/MariaDB's beat with the look: the upsert, then the live rows
    /// and the requests in one statement ([`Queries::live_pending`]); `None`
    /// on the other stores.
    pub(super) async fn beat_then_look(
        &self,
        conn: &mut AnyConnection,
        beat: &Heartbeat,
    ) -> Option<Result<registry::Looked, sqlx::Error>> {
        let read = self.queries.live_pending.as_ref()?;
        Some(
            async {
                bind_beat(self.at_now(&self.queries.beat, None)?, beat)
                    .execute(&mut *conn)
                    .await?;
                let rows = self.at_now(read, None)?.fetch_all(&mut *conn).await?;
                nodes_and_requests(&rows)
            }
            .await,
        )
    }
}

/// The live nodes (sorted) and the pending requests (by job) among the
/// rows of one call that reads both: SQLite's requests come as rows of
/// their own (two columns), the other stores' after the node columns,
/// which they leave NULL.
fn nodes_and_requests(rows: &[AnyRow]) -> Result<registry::Looked, sqlx::Error> {
    let mut nodes = Vec::new();
    let mut pending = Vec::new();
    for r in rows {
        let request_at = match r.len() {
            PENDING_COLUMNS => Some(0),
            n if n > NODE_ROW_COLUMNS
                && r.try_get::<Option<String>, _>(NODE_ROW_COLUMNS)?.is_some() =>
            {
                Some(NODE_ROW_COLUMNS)
            }
            _ => None,
        };
        match request_at {
            Some(at) => pending.extend(pending_row(r, at)),
            None => nodes.push(node_record(r)?),
        }
    }
    pending.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((registry::sorted(nodes), Some(pending)))
}

/// A beat's statement list ([`SqlStore::one_call_beat`]) and whether it
/// reads the pending requests, chosen together.
#[derive(Clone, Copy)]
pub(super) struct OneCallBeat<'a> {
    sql: &'a SqlStr,
    /// The call reads the pending requests too.
    pub(super) look: bool,
}

/// Columns of a row of [`Queries::pending_triggers`].
const PENDING_COLUMNS: usize = 2;

/// A pending request's job and id from the row's columns `at` and after
/// (`None`: an id that is not one).
fn pending_row(r: &AnyRow, at: usize) -> Option<(String, TriggerId)> {
    pending_entry(r.try_get(at).ok()?, r.try_get(at + 1).ok()?)
}

/// A pending request's job and stored id; `None` for an id that is not
/// one (a hand edit).
pub(super) fn pending_entry(job: String, id: i64) -> Option<(String, TriggerId)> {
    Some((job, TriggerId::from_stored(id)?))
}

/// One of a beat's values, as [`beat_values`] lists them.
pub(super) enum BeatValue {
    Text(String),
    Int(i64),
    MaybeText(Option<String>),
    MaybeInt(Option<i64>),
}

/// A beat's values in the order [`Queries::beat`] binds them after the
/// store's `now`: for sqlx ([`bind_beat`]) and for SQLite's beat on the
/// calling thread.
pub(super) fn beat_values(beat: &Heartbeat) -> [BeatValue; 12] {
    use BeatValue::*;
    [
        Text(beat.owner.as_str().to_string()),
        Text(beat.node.clone()),
        Text(beat.version.clone()),
        Int(to_ms(beat.started_at)),
        Int(duration_ms(beat.ttl)),
        MaybeInt(beat.clock_offset_ms),
        Int(i64::from(beat.jobs_held)),
        MaybeText(
            beat.definitions
                .as_ref()
                .and_then(|d| serde_json::to_string(d).ok()),
        ),
        MaybeText(
            (!beat.running.is_empty())
                .then(|| serde_json::to_string(&beat.running).ok())
                .flatten(),
        ),
        MaybeText(
            (!beat.tags.is_empty())
                .then(|| serde_json::to_string(&beat.tags).ok())
                .flatten(),
        ),
        MaybeInt(beat.progress.map(|p| p.through)),
        MaybeInt(
            beat.progress
                .map(|p| i64::try_from(p.released).unwrap_or(i64::MAX)),
        ),
    ]
}

/// The beat's values bound to [`Queries::beat`] (or a statement list that
/// starts with it), after the store's `now` if it has one.
fn bind_beat<'q>(
    mut query: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments>,
    beat: &Heartbeat,
) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments> {
    for value in beat_values(beat) {
        query = match value {
            BeatValue::Text(v) => query.bind(v),
            BeatValue::Int(v) => query.bind(v),
            BeatValue::MaybeText(v) => query.bind(v),
            BeatValue::MaybeInt(v) => query.bind(v),
        };
    }
    query
}

/// A row's columns by index, as a registry row is read: sqlx's rows, and
/// SQLite's beat on the calling thread (rusqlite).
pub(super) trait Columns {
    type Error;
    fn int(&self, i: usize) -> Result<i64, Self::Error>;
    fn maybe_int(&self, i: usize) -> Result<Option<i64>, Self::Error>;
    fn text(&self, i: usize) -> Result<String, Self::Error>;
    fn maybe_text(&self, i: usize) -> Result<Option<String>, Self::Error>;
}

impl Columns for AnyRow {
    type Error = sqlx::Error;
    fn int(&self, i: usize) -> Result<i64, sqlx::Error> {
        self.try_get(i)
    }
    fn maybe_int(&self, i: usize) -> Result<Option<i64>, sqlx::Error> {
        self.try_get(i)
    }
    fn text(&self, i: usize) -> Result<String, sqlx::Error> {
        self.try_get(i)
    }
    fn maybe_text(&self, i: usize) -> Result<Option<String>, sqlx::Error> {
        self.try_get(i)
    }
}

/// A live registry row ([`NODE_COLUMNS`], then the store's `now`).
pub(super) fn node_record<R: Columns>(r: &R) -> Result<NodeRecord, R::Error> {
    let expires_at = r.int(5)?;
    let now = r.int(13)?;
    // JSON of what the beat said of its definitions; an unreadable one (a
    // hand edit) says nothing.
    let definitions = r.maybe_text(8)?;
    Ok(NodeRecord {
        owner: r.text(0)?,
        node: r.text(1)?,
        // A JSON list; none from an earlier version or a hand edit.
        tags: r
            .maybe_text(10)?
            .and_then(|d| serde_json::from_str(&d).ok())
            .unwrap_or_default(),
        version: r.text(2)?,
        started_at: from_ms(r.int(3)?),
        last_seen: from_ms(r.int(4)?),
        expires_in_ms: expires_at.saturating_sub(now).max(0) as u64,
        clock_offset_ms: r.maybe_int(6)?,
        jobs_held: u32::try_from(r.int(7)?).unwrap_or(0),
        definitions: definitions.and_then(|d| serde_json::from_str(&d).ok()),
        // Likewise the runs going on it.
        running: r
            .maybe_text(9)?
            .and_then(|d| serde_json::from_str(&d).ok())
            .unwrap_or_default(),
        // Both or nothing (an earlier version wrote neither).
        progress: match (r.maybe_int(11)?, r.maybe_int(12)?) {
            (Some(through), Some(released)) => Some(registry::ClaimProgress {
                through,
                released: u64::try_from(released).unwrap_or(0),
            }),
            _ => None,
        },
    })
}
