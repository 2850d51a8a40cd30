//! A job's lock: its state key ([`LockState`]), its lease key
//! ([`LeaseValue`]), the claim rule's view of both, and claims decided on them.

use super::*;

/// A job's state key, as stored. Who holds the job now is the lease key's
/// business; this keeps what outlives a lease: the last owner, and the
/// marks ZooKeeper keeps too ([`JobMarks`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct LockState {
    /// The last owner (live or not).
    pub(super) owner: String,
    #[serde(flatten)]
    pub(super) marks: JobMarks,
}

impl LockState {
    /// The state of a job never claimed, made at `now`.
    pub(super) fn free(now: i64) -> Self {
        LockState {
            owner: String::new(),
            marks: JobMarks::free(now),
        }
    }
}

/// A lease key's value: who holds the job, until when (ms, the clock of
/// the node that took or renewed it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct LeaseValue {
    pub(super) owner: String,
    pub(super) expires_at: i64,
}

/// A lease key's value as read. One that is not ours (written by hand)
/// names its whole value as holder for a second at a time: its etcd
/// lease still ends it.
pub(super) fn read_lease(entry: &Entry, now: i64) -> LeaseValue {
    serde_json::from_slice(&entry.value).unwrap_or_else(|_| LeaseValue {
        owner: String::from_utf8_lossy(&entry.value).into_owned(),
        expires_at: now.saturating_add(1_000),
    })
}

/// A job's state (with its fence as a number) when its key exists; `Err`
/// saying why when it cannot be read.
pub(super) fn read_state(entry: Option<&Entry>) -> Result<Option<(LockState, i64)>, String> {
    let Some(entry) = entry else {
        return Ok(None);
    };
    let state: LockState = serde_json::from_slice(&entry.value).map_err(|e| e.to_string())?;
    let fence = state.marks.fence().ok_or_else(|| {
        format!(
            "its fence {:?} is not a number from 0 to 2^63 - 1",
            state.marks.fence
        )
    })?;
    Ok(Some((state, fence)))
}

/// The shared claim rule's view of a job: held while its lease key exists,
/// until the end it records, by the key's owner; otherwise free, the last
/// owner from the state.
pub(super) fn row_of(state: Option<&(LockState, i64)>, view: &JobView) -> LockRow {
    let now = view.now;
    let (owner, expires_at) = match &view.keys.lease {
        Some(e) => {
            let lease = read_lease(e, now);
            (Some(lease.owner), lease.expires_at)
        }
        // A state made by `pause` before any claim names no owner.
        None => (
            state
                .map(|(s, _)| s.owner.clone())
                .filter(|o| !o.is_empty()),
            0,
        ),
    };
    JobMarks::row(state.map(|(s, _)| &s.marks), owner, expires_at, now)
}

impl EtcdStore {
    /// One claim decided on its job's keys: the write it wants, if any.
    pub(super) fn decide_claim(
        &self,
        req: &ClaimRequest,
        view: &JobView,
    ) -> (Option<Plan>, ClaimOutcome) {
        let job = req.job.as_str();
        let state = match read_state(view.keys.lock.as_ref()) {
            Ok(state) => state,
            Err(why) => {
                return (
                    None,
                    ClaimOutcome::Failed(format!(
                        "the lock key {} of job {job} is unreadable ({why}); delete it (etcdctl del) to start the job afresh",
                        self.keys.of(Kind::Lock, job)
                    )),
                );
            }
        };
        if view.keys.lease.as_ref().is_some_and(|e| e.lease == 0) {
            return (
                None,
                ClaimOutcome::Failed(format!(
                    "the lease key {} of job {job} has no etcd lease, so it never ends (written by hand?); delete it (etcdctl del) to free the job",
                    self.keys.of(Kind::Lease, job)
                )),
            );
        }
        let row = row_of(state.as_ref(), view);
        // etcd decides on this node's clock; whether the occurrence is due
        // is judged on the median of the live nodes' clocks, and not before
        // that median is known (docs/protocol.md, "Clock offset").
        let now = now_ms();
        let due_by = self
            .median_now_ms()
            .saturating_add(crate::store::duration_ms(req.max_offset));
        let scheduled = req.manual.is_none();
        if scheduled
            && !req.recheck_only
            && (to_ms(req.occurrence) > due_by || self.clocks.unsettled(now))
        {
            return (
                None,
                ClaimOutcome::Lost(crate::store::Lost {
                    holder: None,
                    remaining: Duration::ZERO,
                    last_occurrence: row.last_occurrence.map(from_ms),
                    fence: row.fence.max(0) as u64,
                    too_early: true,
                    idle_wait: None,
                    paused: false,
                    trigger_gone: false,
                    stale: false,
                }),
            );
        }
        cas::verdict(decide(&row, req), req, |grant| {
            let state = LockState {
                owner: req.owner.as_str().to_string(),
                marks: JobMarks::claimed(
                    state.as_ref().map(|(s, _)| &s.marks),
                    grant.fence,
                    grant.last_occurrence,
                    grant.manual,
                    view.now,
                ),
            };
            let lease = LeaseValue {
                owner: req.owner.as_str().to_string(),
                expires_at: grant.expires_at,
            };
            let json = serde_json::to_vec(&state).map_err(|e| e.to_string())?;
            let lease_json = serde_json::to_vec(&lease).map_err(|e| e.to_string())?;
            let (lock, lease) = (
                self.keys.of(Kind::Lock, job),
                self.keys.of(Kind::Lease, job),
            );
            let mut plan = Plan {
                when: vec![
                    unchanged(&lock, view.keys.lock.as_ref()),
                    unchanged(&lease, view.keys.lease.as_ref()),
                ],
                ops: vec![
                    PlanOp::Put(lock, json),
                    PlanOp::PutLeased(lease, lease_json, lease_ttl_secs(req.lease)),
                ],
            };
            if let Some(id) = grant.manual {
                plan.ops.push(PlanOp::Delete(self.keys.trigger(job, id)));
            }
            Ok(plan)
        })
    }

    /// Clears the running mark of each lock whose last claim's run is among
    /// `runs` (recorded already), compared on the state's revision as read
    /// ([`cas::ended_runs`]).
    pub(super) async fn end_running_marks(
        &self,
        client: &etcd::Client,
        runs: &[RunRecord],
    ) -> Result<(), StoreError> {
        let (jobs, ended) = cas::ended_runs(runs);
        if jobs.is_empty() {
            return Ok(());
        }
        self.read_decide_write(client, &jobs, Want::Lock, |i, view| {
            let Ok(Some((mut state, fence))) = read_state(view.keys.lock.as_ref()) else {
                return (None, ());
            };
            if !state.marks.running || !crate::store::clears_running(ended[i], fence) {
                return (None, ());
            }
            state.marks.running = false;
            let Ok(value) = serde_json::to_vec(&state) else {
                return (None, ());
            };
            let key = self.keys.of(Kind::Lock, jobs[i]);
            let plan = Plan {
                when: vec![unchanged(&key, view.keys.lock.as_ref())],
                ops: vec![PlanOp::Put(key, value)],
            };
            (Some(plan), ())
        })
        .await
        .map(|_| ())
    }

    /// A claim of a non-empty batch; with `beat` (and the etcd lease its
    /// record is put with), the heartbeat's put and the registry's read
    /// ride in the claim's first transaction.
    pub(super) async fn claim_with(
        &self,
        requests: &[ClaimRequest],
        beat: Option<(&Heartbeat, i64)>,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        let client = self.client().await?;
        let jobs: Vec<&str> = requests.iter().map(|r| r.job.as_str()).collect();
        let (extra, sent) = match beat {
            Some((beat, lease)) => {
                let (ops, sent) = self.beat_ops(&client, beat, lease);
                (ops, Some((beat, sent)))
            }
            None => (Vec::new(), None),
        };
        let (now, outcomes, extra) = self
            .read_decide_write_with(&client, &jobs, Want::LockAndLease, extra, |i, view| {
                self.decide_claim(&requests[i], view)
            })
            .await?;
        let nodes = match (sent, extra.as_slice()) {
            (Some((beat, sent)), [_, TxnOpResponse::Get(read)]) => {
                Some(self.beat_answered(beat, read, sent))
            }
            _ => None,
        };
        // A request found gone (its state no longer names it: a hand edit)
        // leaves its key behind: it goes, best effort.
        let stale: Vec<TxnOp> = requests
            .iter()
            .zip(&outcomes)
            .filter_map(|(req, outcome)| match (req.manual, outcome) {
                (Some(id), ClaimOutcome::Lost(lost)) if lost.trigger_gone => {
                    Some(TxnOp::delete(self.keys.trigger(req.job.as_str(), id), None))
                }
                _ => None,
            })
            .collect();
        if !stale.is_empty() {
            let mut kv = client.kv_client();
            let _ = self.timed(kv.txn(Txn::new().and_then(stale))).await;
        }
        // Leases are counted on this host's clock (`now`); the clock it is
        // measured against is the live nodes' median.
        let now = now.saturating_add(self.median_now_ms() - now_ms());
        let claimed = Claimed {
            store_now: from_ms(now),
            outcomes,
        };
        Ok((claimed, nodes))
    }
}
