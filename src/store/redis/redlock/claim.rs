//! A claim batch: leases taken on every master in rounds, the answers
//! tallied per job into one vote, a majority's claim decided with the shared
//! rule and written, and a split vote given back.

use super::*;

/// What the masters said of one request in phase 1.
#[derive(Debug, Default)]
pub(super) struct Tally {
    /// Masters (counted for this lease) where the lease is ours now.
    pub(super) ours: usize,
    /// Of those, where it was ours before this claim.
    pub(super) ours_before: usize,
    /// Masters (any) where this call took the lease: given back if the
    /// claim does not go on.
    pub(super) taken: Vec<usize>,
    /// Other owners' leases on counted masters, with their time left (ms).
    pub(super) others: Vec<(String, i64)>,
    /// Counted masters that answered.
    pub(super) counted: usize,
    /// The highest fence any master reported, with the owner and last
    /// occurrence stored beside it, and the latest last occurrence.
    pub(super) fence: u64,
    pub(super) fence_owner: Option<String>,
    pub(super) last: Option<i64>,
    /// Our own lease's time left on the masters where it was ours before.
    pub(super) ours_pttl: Vec<i64>,
    /// Counted masters where another owner's lease is idle: the rest of
    /// its head start there (ms).
    pub(super) idle_waits: Vec<i64>,
    /// The pause mark of the highest generation any master reported (a
    /// tie between marks reads as paused).
    pub(super) pause: PauseMark,
    /// A manual claim: counted masters where its request is pending, and
    /// whether any master says a claim took it already.
    pub(super) trigger_pending: usize,
    /// A manual claim: counted masters where the lease is ours and the run
    /// of our last claim is not recorded (a run in progress).
    pub(super) ours_busy: usize,
    pub(super) trigger_taken: bool,
    /// Of the masters at the highest fence: how many report its running
    /// mark set, and how many cleared (its run recorded there).
    pub(super) top_running: usize,
    pub(super) top_recorded: usize,
    /// The latest request a claim took, as the masters at the highest
    /// fence report it.
    pub(super) top_last_trigger: Option<i64>,
    pub(super) errors: Vec<String>,
}

impl Tally {
    /// The run of the last claim was not recorded: some master at its fence
    /// says so and none says it was. A claim writes its mark on a majority
    /// and a record clears it on a majority, and each majority meets the
    /// majority read here.
    pub(super) fn running(&self) -> bool {
        self.top_running > 0 && self.top_recorded == 0
    }
}

/// A job's pause mark as the masters report it: `(generation, paused)`;
/// the highest generation wins, and of two marks written with the same
/// generation (two operators at once) the paused one.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct PauseMark(pub(super) i64, pub(super) bool);

impl PauseMark {
    pub(super) fn merge(self, other: PauseMark) -> PauseMark {
        if other.0 > self.0 || (other.0 == self.0 && other.1) {
            other
        } else {
            self
        }
    }
}

/// What phase 1 makes of one request.
#[derive(Debug)]
pub(super) enum Vote {
    /// The lease is ours on a majority: decide the claim.
    Ours,
    /// Another owner holds it on a majority; `idle_wait` when that lease
    /// is idle on a majority (the rest of its head start there).
    Held {
        holder: String,
        remaining: Duration,
        idle_wait: Option<Duration>,
    },
    /// Nobody holds a majority: try again after a pause.
    Split { holder: Option<String> },
    /// Too few counted masters answered to decide.
    Undecided,
}

/// The lease's validity after `elapsed`: lease − elapsed − (1% + 2 ms),
/// if any is left.
pub(super) fn validity(lease: Duration, elapsed: Duration) -> Option<Duration> {
    lease
        .checked_sub(elapsed + lease / 100 + Duration::from_millis(2))
        .filter(|v| !v.is_zero())
}

/// The owner holding the most leases in `leases` (owner, time left in ms),
/// with those times left.
pub(super) fn top_holder(leases: &[(String, i64)]) -> Option<(&str, Vec<i64>)> {
    let mut by_owner: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (owner, pttl) in leases {
        by_owner.entry(owner).or_default().push(*pttl);
    }
    by_owner.into_iter().max_by_key(|(_, p)| p.len())
}

/// How long (ms) leases with these times left still make a majority of
/// `majority`: until all but `majority - 1` of them ended. `None` when they
/// are fewer than a majority.
pub(super) fn majority_left(mut pttls: Vec<i64>, majority: usize) -> Option<u64> {
    let k = pttls.len().checked_sub(majority)?;
    pttls.sort_unstable();
    Some(pttls[k].max(0) as u64)
}

/// In a split vote, when the owner of the job's last claim is another
/// node whose leases among the answers, with the `unheard` masters (those
/// not counted among the answers), could still make a majority of `majority`:
/// that owner, and how long to stand back (until the first of those leases
/// ends, at most `most`). The last owner goes first, as biased ownership has
/// it: its next round wins instead of being split again. At most `most`,
/// because that owner may be gone (its leases left where the others cannot
/// win either) or be this node's own earlier life: then the claims race
/// again after it.
pub(super) fn behind<'t>(
    t: &'t Tally,
    req: &ClaimRequest,
    majority: usize,
    unheard: usize,
    most: Duration,
) -> Option<(&'t str, Duration)> {
    let owner = t
        .fence_owner
        .as_deref()
        .filter(|o| *o != req.owner.as_str())?;
    let leases: Vec<i64> = t
        .others
        .iter()
        .filter(|(o, _)| o == owner)
        .map(|(_, pttl)| *pttl)
        .collect();
    let first_end = leases.iter().copied().min()?;
    (leases.len() + unheard >= majority).then(|| {
        (
            owner,
            Duration::from_millis(first_end.max(1) as u64).min(most),
        )
    })
}

/// How long until `majority` of these waits (ms) are over: the
/// `majority`-th shortest. `None` when they are fewer.
pub(super) fn majority_past(mut waits: Vec<i64>, majority: usize) -> Option<Duration> {
    waits.sort_unstable();
    let wait = *waits.get(majority.checked_sub(1)?)?;
    Some(Duration::from_millis(wait.max(0) as u64))
}

impl RedlockStore {
    /// Phase 1 for `requests[i]`, `i` in `which`: per master, its time and
    /// its entries (in `which` order). With `beat` (`registry.lua`'s
    /// arguments), each master's pipeline carries the heartbeat first, and
    /// the live records come back too if a majority took it.
    pub(super) async fn take_leases(
        &self,
        requests: &[ClaimRequest],
        which: &[usize],
        beat: Option<&[String]>,
    ) -> (LeaseAnswers, Option<Vec<NodeRecord>>) {
        let mut keys = Vec::with_capacity(2 * which.len());
        let mut args = Vec::with_capacity(5 * which.len());
        for &i in which {
            let r = &requests[i];
            keys.push(self.key(r.job.as_str(), "lease"));
            keys.push(self.key(r.job.as_str(), "state"));
            args.push(r.owner.as_str().to_string());
            args.push(if r.recheck_only {
                "0".to_string()
            } else {
                duration_ms(r.lease).max(1).to_string()
            });
            args.push(to_ms(r.occurrence).to_string());
            args.push(
                r.head_start
                    .map_or(String::new(), |h| duration_ms(h).to_string()),
            );
            args.push(if r.manual.is_some() { "1" } else { "" }.to_string());
        }
        let (keys, args) = (&keys, &args);
        // Settled when each request has a majority for one owner.
        let settled = |answers: &[LeaseAnswer]| {
            which.iter().enumerate().all(|(slot, &i)| {
                let t = self.tally(answers, slot, &requests[i]);
                t.ours >= self.majority()
                    || top_holder(&t.others).is_some_and(|(_, p)| p.len() >= self.majority())
            })
        };
        let Some(beat_args) = beat else {
            let answers = self
                .each_until(|m| self.eval_on(m, &self.lease, keys, args), settled)
                .await;
            return (answers, None);
        };
        let beat_keys = [self.registry_key()];
        let beats: std::sync::Mutex<Vec<Option<Vec<String>>>> =
            std::sync::Mutex::new(self.masters.iter().map(|_| None).collect());
        let (beat_keys, beats_ref) = (&beat_keys, &beats);
        let answers = self
            .each_until(
                |m| async move {
                    let [beaten, leased] = self
                        .evals_on::<2, redis::Value>(
                            m,
                            [
                                (&self.registry, beat_keys, beat_args),
                                (&self.lease, keys, args),
                            ],
                        )
                        .await?;
                    let slot = self.masters.iter().position(|x| std::ptr::eq(x, m));
                    match (beaten.and_then(|v| decoded(m, v)), slot) {
                        (Ok(reply), Some(slot)) => {
                            if let Ok(mut beats) = beats_ref.lock() {
                                beats[slot] = Some(reply);
                            }
                        }
                        (Err(e), _) => {
                            tracing::debug!("the heartbeat in a claim's first phase failed: {e}")
                        }
                        _ => {}
                    }
                    leased.and_then(|v| decoded(m, v))
                },
                settled,
            )
            .await;
        let beats: Vec<Vec<String>> = beats
            .into_inner()
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .collect();
        let nodes = (beats.len() >= self.majority()).then(|| freshest_records(beats));
        (answers, nodes)
    }

    /// Counts the masters' phase-1 answers for request `slot` of the call.
    pub(super) fn tally(&self, answers: &[LeaseAnswer], slot: usize, req: &ClaimRequest) -> Tally {
        let mut t = Tally::default();
        let mut best: Option<i128> = None;
        for (m, answer) in answers.iter().enumerate() {
            let Some(Ok((_, entries))) = answer else {
                continue;
            };
            let Some((
                got,
                holder,
                pttl,
                fence,
                last,
                state_owner,
                idle_wait,
                paused,
                pause_gen,
                trigger,
                last_trigger,
                running,
            )) = entries.get(slot)
            else {
                continue;
            };
            if *got == -2 {
                t.errors.push(holder.clone().unwrap_or_default());
                continue;
            }
            if *got == 1 {
                t.taken.push(m);
            }
            let fence = fence.parse::<u64>().unwrap_or(0);
            if best.is_none_or(|b| i128::from(fence) > b) {
                best = Some(i128::from(fence));
                t.fence = fence;
                t.fence_owner = state_owner.clone();
                (t.top_running, t.top_recorded, t.top_last_trigger) = (0, 0, None);
            } else if best == Some(i128::from(fence)) && t.fence_owner != *state_owner {
                // Two claims with the same fence (one only ever reached a
                // minority): the owner of the last claim is not known.
                t.fence_owner = None;
            }
            if best == Some(i128::from(fence)) {
                if *running == 0 {
                    t.top_recorded += 1;
                } else {
                    t.top_running += 1;
                }
                let taken = last_trigger
                    .as_deref()
                    .and_then(TriggerId::parse_stored)
                    .map(TriggerId::get);
                t.top_last_trigger = t.top_last_trigger.max(taken);
            }
            if *last >= 0 {
                t.last = Some(t.last.map_or(*last, |l| l.max(*last)));
            }
            t.pause = t.pause.merge(PauseMark(*pause_gen, *paused == 1));
            let names = |stored: &Option<String>| {
                req.manual.is_some()
                    && stored.as_deref().and_then(TriggerId::parse_stored) == req.manual
            };
            t.trigger_taken |= names(last_trigger);
            if !self.counts(&self.masters[m], req.lease) {
                continue;
            }
            t.counted += 1;
            if names(trigger) {
                t.trigger_pending += 1;
            }
            match (got, holder) {
                (1, _) => t.ours += 1,
                (2 | 3, _) => {
                    t.ours += 1;
                    t.ours_before += 1;
                    t.ours_pttl.push(*pttl);
                    t.ours_busy += usize::from(*got == 3);
                }
                (_, Some(h)) => {
                    t.others.push((h.clone(), *pttl));
                    if *idle_wait >= 0 {
                        t.idle_waits.push(*idle_wait);
                    }
                }
                _ => {}
            }
        }
        t
    }

    pub(super) fn vote(&self, t: &Tally, req: &ClaimRequest) -> Vote {
        let m = self.majority();
        if t.ours >= m {
            return Vote::Ours;
        }
        let top = top_holder(&t.others);
        if let Some((holder, pttls)) = &top
            && let Some(left) = majority_left(pttls.clone(), m)
        {
            return Vote::Held {
                holder: holder.to_string(),
                remaining: Duration::from_millis(left),
                idle_wait: majority_past(t.idle_waits.clone(), m),
            };
        }
        match (t.counted >= m, req.recheck_only) {
            // A recheck takes nothing: it reads a majority's state.
            (true, true) => Vote::Ours,
            (true, false) => Vote::Split {
                holder: top.map(|(h, _)| h.to_string()),
            },
            (false, _) => Vote::Undecided,
        }
    }

    /// Gives back the leases this call took (`SET NX`) for claims that do
    /// not go on, each only on the masters where it took it: a lease that
    /// was ours before the call may protect a running job and stays.
    pub(super) async fn give_back(&self, taken: &[(&ClaimRequest, &[usize])]) {
        let Some((first, _)) = taken.first() else {
            return;
        };
        let owner = [first.owner.as_str().to_string()];
        let per_master: Vec<Vec<String>> = (0..self.masters.len())
            .map(|m| {
                taken
                    .iter()
                    .filter(|(_, on)| on.contains(&m))
                    .map(|(r, _)| self.key(r.job.as_str(), "lease"))
                    .collect()
            })
            .collect();
        let calls = self
            .masters
            .iter()
            .zip(&per_master)
            .filter(|(_, keys)| !keys.is_empty())
            .map(|(m, keys)| self.eval_on::<i64>(m, &self.release, keys, &owner));
        for r in futures_util::future::join_all(calls).await {
            if let Err(e) = r {
                tracing::debug!(store = %self.url, "giving back the leases of a claim that did not go on failed ({e}); they expire");
            }
        }
    }

    /// Phase 1 with its split votes tried again (within the node's budget
    /// for the whole call: `op_timeout` from `started`): the requests whose
    /// lease is ours on a majority (with what the masters reported), and
    /// the store's clock; the others' answers go into `outcomes`. No split
    /// is tried again once half of that has passed. A split where the owner
    /// of the job's last claim is another node that could still win it is
    /// not tried again: the claim stands back ([`behind`]) and that owner's
    /// next round can win.
    pub(super) async fn lease_rounds(
        &self,
        requests: &[ClaimRequest],
        outcomes: &mut [Option<ClaimOutcome>],
        beat: Option<&[String]>,
        started: Instant,
    ) -> Result<(Vec<(usize, Tally)>, i64, Option<Vec<NodeRecord>>), StoreError> {
        let mut ours: Vec<(usize, Tally)> = Vec::new();
        let mut pending: Vec<usize> = (0..requests.len()).collect();
        let mut store_now = None;
        let mut nodes = None;
        for round in 0..SPLIT_ROUNDS {
            // The heartbeat rides the first round only.
            let (answers, beaten) = self
                .take_leases(requests, &pending, beat.filter(|_| round == 0))
                .await;
            if round == 0 {
                nodes = beaten;
            }
            let clocks = answers
                .iter()
                .filter_map(|a| {
                    a.as_ref()
                        .and_then(|r| r.as_ref().ok())
                        .map(|(now, _)| *now)
                })
                .collect();
            store_now = median(clocks).or(store_now);
            let last_round = round + 1 == SPLIT_ROUNDS || started.elapsed() >= self.op_timeout / 2;
            let mut split = Vec::new();
            let mut undecided = Vec::new();
            let mut give_back: Vec<(&ClaimRequest, Vec<usize>)> = Vec::new();
            for (slot, &i) in pending.iter().enumerate() {
                let req = &requests[i];
                let mut t = self.tally(&answers, slot, req);
                if t.errors.len() >= self.majority() {
                    outcomes[i] = Some(ClaimOutcome::Failed(format!(
                        "the claim of job {} failed in the servers: {}",
                        req.job,
                        one_line(&t.errors[0])
                    )));
                    give_back.push((req, std::mem::take(&mut t.taken)));
                    continue;
                }
                let vote = self.vote(&t, req);
                if !matches!(vote, Vote::Ours) {
                    give_back.push((req, std::mem::take(&mut t.taken)));
                }
                match vote {
                    Vote::Ours => ours.push((i, t)),
                    Vote::Held {
                        holder,
                        remaining,
                        idle_wait,
                    } => {
                        outcomes[i] = Some(ClaimOutcome::Lost(Lost {
                            holder: Some(holder),
                            remaining,
                            last_occurrence: t.last.map(from_ms),
                            fence: t.fence,
                            too_early: false,
                            idle_wait: idle_wait.map(|w| w.min(remaining)),
                            paused: t.pause.1,
                            trigger_gone: req.manual.is_some() && t.trigger_taken,
                            stale: false,
                        }));
                    }
                    // Behind the last owner: claimed again after standing
                    // back. Still split after the last round: a short wait,
                    // so the node claims again soon instead of giving up.
                    // Otherwise: another round.
                    Vote::Split { holder } => {
                        let unheard = self.masters.len().saturating_sub(t.counted);
                        let most = spread(self.unsettled_wait());
                        let (holder, remaining) =
                            match behind(&t, req, self.majority(), unheard, most) {
                                Some((owner, until)) => (Some(owner.to_string()), until),
                                None if last_round => {
                                    (holder.or_else(|| Some("(split vote)".into())), jitter())
                                }
                                None => {
                                    split.push(i);
                                    continue;
                                }
                            };
                        outcomes[i] = Some(ClaimOutcome::Lost(Lost {
                            holder,
                            remaining,
                            last_occurrence: t.last.map(from_ms),
                            fence: t.fence,
                            too_early: false,
                            idle_wait: None,
                            paused: t.pause.1,
                            trigger_gone: req.manual.is_some() && t.trigger_taken,
                            stale: false,
                        }));
                    }
                    Vote::Undecided => undecided.push((i, t.counted)),
                }
            }
            let taken: Vec<(&ClaimRequest, &[usize])> =
                give_back.iter().map(|(r, m)| (*r, m.as_slice())).collect();
            self.give_back(&taken).await;
            let answered = answers.iter().filter(|a| matches!(a, Some(Ok(_)))).count();
            let why = |counted: usize| {
                format!(
                    "{answered} of {} Redis masters answered and {counted} of them count for this lease; a majority ({}) must (a master counts in no quorum until it has been up for one lease length)",
                    self.masters.len(),
                    self.majority()
                )
            };
            if undecided.len() == requests.len() {
                // Nothing could be decided: the store is out of reach.
                return Err(self.unavailable(why(undecided
                    .iter()
                    .map(|u| u.1)
                    .min()
                    .unwrap_or(0))));
            }
            for (i, counted) in undecided {
                outcomes[i] = Some(ClaimOutcome::Failed(format!(
                    "the claim of job {} could not be decided: {}",
                    requests[i].job,
                    why(counted)
                )));
            }
            if split.is_empty() {
                break;
            }
            tokio::time::sleep(jitter()).await;
            pending = split;
        }
        Ok((ours, store_now.unwrap_or_default(), nodes))
    }

    /// A claim of a non-empty batch, with `beat` (`registry.lua`'s
    /// arguments) in each master's first-phase pipeline: the live records
    /// come back when a majority took the heartbeat.
    pub(super) async fn claim_with(
        &self,
        requests: &[ClaimRequest],
        beat: Option<&[String]>,
    ) -> Result<(Claimed, Option<Vec<NodeRecord>>), StoreError> {
        let started = Instant::now();
        let mut outcomes: Vec<Option<ClaimOutcome>> = requests.iter().map(|_| None).collect();
        let (ours, store_now, nodes) = self
            .lease_rounds(requests, &mut outcomes, beat, started)
            .await?;
        self.decide_and_write(requests, ours, store_now, started, &mut outcomes)
            .await?;
        let outcomes = outcomes
            .into_iter()
            .zip(requests)
            .map(|(o, r)| {
                o.unwrap_or_else(|| {
                    ClaimOutcome::Failed(format!("the claim of job {} was not decided", r.job))
                })
            })
            .collect();
        let claimed = Claimed {
            store_now: from_ms(store_now),
            outcomes,
        };
        Ok((claimed, nodes))
    }

    /// Phase 2: the claim rule on what the masters reported, then the wins
    /// written to the masters. A win written short of a majority, or past
    /// its lease's validity, makes the call fail: the node retries it as an
    /// unanswered claim, and a win that did land is answered again.
    pub(super) async fn decide_and_write(
        &self,
        requests: &[ClaimRequest],
        ours: Vec<(usize, Tally)>,
        store_now: i64,
        started: Instant,
        outcomes: &mut [Option<ClaimOutcome>],
    ) -> Result<(), StoreError> {
        let mut to_write: Vec<Decided> = Vec::new();
        let mut refused: Vec<(&ClaimRequest, Vec<usize>)> = Vec::new();
        for (i, t) in ours {
            let req = &requests[i];
            // A manual claim on our own lease whose run is in progress (a
            // majority says so) sees it as such: refused unless it retries
            // an earlier manual win.
            let busy = req.manual.is_some() && t.ours_busy >= self.majority();
            let row = LockRow {
                owner: if busy {
                    Some(req.owner.as_str().to_string())
                } else {
                    t.fence_owner.clone()
                },
                fence: i64::try_from(t.fence).unwrap_or(i64::MAX),
                expires_at: if busy { store_now.saturating_add(1) } else { 0 },
                last_occurrence: t.last,
                // The lease was decided in phase 1 (where an idle holder's
                // head start is judged by each master's running mark and
                // clock): no live lease is left for the claim rule to see,
                // but a manual claim's own busy one (above). The mark
                // matters here only to `at_least_once`.
                running: busy || t.running(),
                // The mark of the highest generation among the answers,
                // a majority: a pause written to a majority is among them.
                paused: t.pause.1,
                // A request is pending when a majority has it and no master
                // saw it taken (a taking claim wrote a majority, which every
                // majority read meets).
                trigger: req
                    .manual
                    .filter(|_| t.trigger_pending >= self.majority() && !t.trigger_taken)
                    .map(TriggerId::get),
                last_trigger: match req.manual {
                    Some(id) => t.trigger_taken.then_some(id.get()),
                    None => t.top_last_trigger,
                },
                now: store_now,
            };
            match decide(&row, req) {
                // A recheck answers an earlier win as it stands.
                Decision::Claim { won, .. } if req.recheck_only => {
                    outcomes[i] = Some(ClaimOutcome::Won(won));
                }
                Decision::Claim {
                    fence,
                    last_occurrence,
                    won,
                    ..
                } => to_write.push((i, fence, last_occurrence, won, t.taken)),
                Decision::Refuse(mut lost) => {
                    if t.ours_before >= self.majority()
                        && t.fence_owner.as_deref() == Some(req.owner.as_str())
                    {
                        // Our own lease and our own last claim: say so.
                        lost.holder = Some(req.owner.as_str().to_string());
                        lost.remaining = Duration::from_millis(
                            majority_left(t.ours_pttl, self.majority()).unwrap_or(0),
                        );
                    }
                    outcomes[i] = Some(ClaimOutcome::Lost(lost));
                    refused.push((req, t.taken));
                }
                Decision::FenceExhausted => {
                    outcomes[i] = Some(ClaimOutcome::Failed(fence_exhausted(req.job.as_str())));
                    refused.push((req, t.taken));
                }
            }
        }
        let taken: Vec<(&ClaimRequest, &[usize])> =
            refused.iter().map(|(r, m)| (*r, m.as_slice())).collect();
        self.give_back(&taken).await;
        if to_write.is_empty() {
            return Ok(());
        }
        let valid_before = to_write
            .iter()
            .all(|(i, ..)| validity(requests[*i].lease, started.elapsed()).is_some());
        let written = if valid_before {
            let claims: Vec<(&ClaimRequest, i64, Option<i64>)> = to_write
                .iter()
                .map(|(i, f, l, ..)| (&requests[*i], *f, *l))
                .collect();
            self.write_claims(&claims).await
        } else {
            vec![0; to_write.len()]
        };
        let elapsed = started.elapsed();
        let mut short: Vec<(&ClaimRequest, usize, Vec<usize>)> = Vec::new();
        for ((i, _, _, won, taken), n) in to_write.into_iter().zip(written) {
            let req = &requests[i];
            if n >= self.majority() && validity(req.lease, elapsed).is_some() {
                outcomes[i] = Some(ClaimOutcome::Won(won));
            } else {
                short.push((req, n, taken));
            }
        }
        let Some((first, n, _)) = short.first() else {
            return Ok(());
        };
        let message = format!(
            "the claim of job {} (and {} more) was written on {n} of {} Redis masters within its lease's validity ({elapsed:?} elapsed); a majority ({}) must: the leases it took were given back",
            first.job,
            short.len() - 1,
            self.masters.len(),
            self.majority()
        );
        let taken: Vec<(&ClaimRequest, &[usize])> =
            short.iter().map(|(r, _, m)| (*r, m.as_slice())).collect();
        self.give_back(&taken).await;
        Err(self.unavailable(message))
    }

    /// Phase 2: writes each decided claim; per claim, how many counted
    /// masters wrote it.
    pub(super) async fn write_claims(
        &self,
        claims: &[(&ClaimRequest, i64, Option<i64>)],
    ) -> Vec<usize> {
        let mut keys = Vec::with_capacity(2 * claims.len() + 1);
        let mut args = Vec::with_capacity(6 * claims.len());
        for (r, fence, last) in claims {
            keys.push(self.key(r.job.as_str(), "lease"));
            keys.push(self.key(r.job.as_str(), "state"));
            args.extend([
                r.owner.as_str().to_string(),
                duration_ms(r.lease).max(1).to_string(),
                fence.to_string(),
                last.map(|l| l.to_string()).unwrap_or_default(),
                r.manual.map(|id| id.get().to_string()).unwrap_or_default(),
                r.job.as_str().to_string(),
            ]);
        }
        keys.push(triggers_key(&self.prefix));
        let leases: Vec<Duration> = claims.iter().map(|(r, ..)| r.lease).collect();
        let (done, _) = self.each_request(&self.write, &keys, &args, &leases).await;
        done
    }

    /// Runs a script that answers 1 or 0 per request (of lease `leases[i]`)
    /// on every master, waiting until each request has a majority of 1s or
    /// the masters answered: per request, how many counted masters answered
    /// 1, and every master's answer.
    pub(super) async fn each_request(
        &self,
        script: &Script,
        keys: &[String],
        args: &[String],
        leases: &[Duration],
    ) -> (Vec<usize>, Vec<Option<Result<Vec<i64>, StoreError>>>) {
        let answers = self
            .each_until(
                |m| self.eval_on::<Vec<i64>>(m, script, keys, args),
                |answers| {
                    self.done_counts(answers, leases)
                        .iter()
                        .all(|n| *n >= self.majority())
                },
            )
            .await;
        (self.done_counts(&answers, leases), answers)
    }

    /// Per request (of lease `leases[i]`), how many counted masters answered
    /// 1 for it.
    pub(super) fn done_counts(
        &self,
        answers: &[Option<Result<Vec<i64>, StoreError>>],
        leases: &[Duration],
    ) -> Vec<usize> {
        leases
            .iter()
            .enumerate()
            .map(|(i, lease)| {
                answers
                    .iter()
                    .zip(&self.masters)
                    .filter(|(a, m)| {
                        matches!(a, Some(Ok(done)) if done.get(i) == Some(&1))
                            && self.counts(m, *lease)
                    })
                    .count()
            })
            .collect()
    }
}
