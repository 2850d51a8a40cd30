//! Keys and transactions: a job's two keys as read ([`JobView`]), one
//! job's conditional write ([`Plan`]), batches sent within etcd's
//! operation limit, and etcd's half of the compare-and-set loop ([`EtcdCas`]).

use super::*;

/// A key as read: its value, the revision it last changed at, its lease.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) value: Vec<u8>,
    pub(super) mod_revision: i64,
    pub(super) lease: i64,
}

impl Entry {
    pub(super) fn of(kv: &KeyValue) -> Self {
        Entry {
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
            lease: kv.lease(),
        }
    }
}

/// A job's two keys as read (`None`: absent, or not read).
#[derive(Debug, Clone, Default)]
pub(super) struct JobKeys {
    pub(super) lock: Option<Entry>,
    pub(super) lease: Option<Entry>,
}

/// A job as a batch sees it.
#[derive(Debug, Clone)]
pub(super) struct JobView {
    pub(super) keys: JobKeys,
    /// This host's clock (ms) once the keys were read.
    pub(super) now: i64,
}

/// What a batch reads of each job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Want {
    /// Both keys: claims.
    LockAndLease,
    /// The lease key only: renewals and releases.
    Lease,
    /// The lock key only: ending a running mark.
    Lock,
}

impl Want {
    fn lock(self) -> bool {
        self != Want::Lease
    }

    fn lease(self) -> bool {
        self != Want::Lock
    }
}

/// One job's conditional write, before the leases it needs are granted.
pub(super) struct Plan {
    pub(super) when: Vec<Compare>,
    pub(super) ops: Vec<PlanOp>,
}

pub(super) enum PlanOp {
    Put(String, Vec<u8>),
    /// A put attached to a fresh lease of this many seconds.
    PutLeased(String, Vec<u8>, i64),
    Delete(String),
}

impl PlanOp {
    pub(super) fn key(&self) -> &str {
        match self {
            PlanOp::Put(key, _) | PlanOp::PutLeased(key, _, _) | PlanOp::Delete(key) => key,
        }
    }
}

impl Plan {
    /// Its longest list, as etcd counts a transaction's operations.
    pub(super) fn width(&self) -> usize {
        self.when.len().max(self.ops.len())
    }

    /// The key that names it: the first it writes.
    pub(super) fn ident(&self) -> &str {
        self.ops.first().map_or("", PlanOp::key)
    }

    /// The TTLs of the leases it puts keys with.
    pub(super) fn ttls(&self) -> impl Iterator<Item = i64> + '_ {
        self.ops.iter().filter_map(|op| match op {
            PlanOp::PutLeased(_, _, ttl) => Some(*ttl),
            _ => None,
        })
    }

    /// The nested transaction, with `leases` (TTL → granted lease id).
    pub(super) fn into_txn(self, leases: &HashMap<i64, i64>) -> Result<Txn, String> {
        let ops = self
            .ops
            .into_iter()
            .map(|op| match op {
                PlanOp::Put(key, value) => Ok(TxnOp::put(key, value, None)),
                PlanOp::PutLeased(key, value, ttl) => match leases.get(&ttl) {
                    Some(id) => Ok(TxnOp::put(
                        key,
                        value,
                        Some(PutOptions::new().with_lease(*id)),
                    )),
                    None => Err(format!("no lease of {ttl} s was granted for {key}")),
                },
                PlanOp::Delete(key) => Ok(TxnOp::delete(key, None)),
            })
            .collect::<Result<Vec<TxnOp>, String>>()?;
        Ok(Txn::new().when(self.when).and_then(ops))
    }
}

/// etcd's half of the compare-and-set loop ([`cas::Cas`]): one batch's
/// jobs, read and written on one client.
pub(super) struct EtcdCas<'a> {
    pub(super) store: &'a EtcdStore,
    pub(super) client: &'a etcd::Client,
    pub(super) want: Want,
}

impl cas::Cas for EtcdCas<'_> {
    type View = JobView;
    type Write = Plan;

    /// Each plan is a nested transaction of its own: the ones whose
    /// compares failed are the ones not applied.
    async fn write(&self, writes: Vec<(usize, Plan)>) -> Result<Vec<usize>, StoreError> {
        self.store.write(self.client, writes).await
    }

    async fn reread(&self, jobs: &[&str]) -> Result<Vec<JobView>, StoreError> {
        self.store.view(self.client, jobs, self.want).await
    }

    fn store(&self) -> String {
        self.store.url.redacted().into()
    }
}

/// The compare that holds while `key` is as it was read: changed last at
/// the same revision, or still absent.
pub(super) fn unchanged(key: &str, read: Option<&Entry>) -> Compare {
    match read {
        Some(e) => Compare::mod_revision(key, CompareOp::Equal, e.mod_revision),
        None => Compare::create_revision(key, CompareOp::Equal, 0),
    }
}

/// `items` in chunks of at most `size` (at least 1), in order.
pub(super) fn chunked<T>(items: Vec<T>, size: usize) -> Vec<Vec<T>> {
    let size = size.max(1);
    let mut chunks = Vec::with_capacity(items.len().div_ceil(size));
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        chunks.push(items.by_ref().take(size).collect());
    }
    chunks
}

/// Nested transactions per transaction when each is `width` operations
/// wide: the parent's own count plus a child's must stay within
/// [`MAX_TXN_OPS`].
pub(super) fn nested_per_txn(width: usize) -> usize {
    MAX_TXN_OPS.saturating_sub(width).max(1)
}

/// The first key after every key that starts with `prefix` (etcd's range
/// end for a prefix).
pub(super) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    for (i, byte) in prefix.iter().enumerate().rev() {
        if *byte < 0xff {
            let mut end = prefix[..=i].to_vec();
            end[i] = byte + 1;
            return end;
        }
    }
    // No key follows them all: to the end of the key space.
    vec![0]
}

impl EtcdStore {
    /// Each chunk as one transaction without compares, all sent together:
    /// every operation's answer, in order.
    pub(super) async fn send(
        &self,
        client: &etcd::Client,
        chunks: Vec<Vec<TxnOp>>,
    ) -> Result<Vec<TxnOpResponse>, StoreError> {
        let expected: usize = chunks.iter().map(Vec::len).sum();
        let sends = chunks.into_iter().map(|ops| {
            let mut kv = client.kv_client();
            async move { self.timed(kv.txn(Txn::new().and_then(ops))).await }
        });
        let answers: Vec<TxnResponse> = try_join_all(sends).await?;
        let responses: Vec<TxnOpResponse> =
            answers.iter().flat_map(TxnResponse::op_responses).collect();
        if responses.len() != expected {
            return Err(self.backend(format!(
                "{} answers to {expected} operations",
                responses.len()
            )));
        }
        Ok(responses)
    }

    /// `ops` as transactions of at most [`MAX_TXN_OPS`], sent together.
    pub(super) async fn batch(
        &self,
        client: &etcd::Client,
        ops: Vec<TxnOp>,
    ) -> Result<Vec<TxnOpResponse>, StoreError> {
        self.send(client, chunked(ops, MAX_TXN_OPS)).await
    }

    /// Every key under `prefix` at `revision` (0: now), with the revision
    /// read, [`RANGE_PAGE`] keys a call: one answer of 20,000 locks is over
    /// gRPC's 4 MiB message limit.
    pub(super) async fn range_all(
        &self,
        client: &etcd::Client,
        prefix: &str,
        revision: i64,
    ) -> Result<(Vec<etcd::KeyValue>, i64), StoreError> {
        let end = prefix_end(prefix.as_bytes());
        let mut kv = client.kv_client();
        let mut from = prefix.as_bytes().to_vec();
        let mut revision = revision;
        let mut all = Vec::new();
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(RANGE_PAGE)
                .with_revision(revision);
            let page = self.timed(kv.get(from.clone(), Some(options))).await?;
            if revision == 0 {
                revision = page.header().map_or(0, |h| h.revision());
            }
            let more = page.more();
            let kvs = page.kvs();
            match kvs.last() {
                Some(last) if more => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => {
                    all.extend_from_slice(kvs);
                    return Ok((all, revision));
                }
            }
            all.extend_from_slice(kvs);
        }
    }

    /// `keys` as they are now, one get each (keys of one job stay in one
    /// transaction when a job has one or two: 128 is even).
    pub(super) async fn read_keys(
        &self,
        client: &etcd::Client,
        keys: &[String],
    ) -> Result<Vec<Option<Entry>>, StoreError> {
        self.read_keys_with(client, keys, Vec::new())
            .await
            .map(|(entries, _)| entries)
    }

    /// [`EtcdStore::read_keys`] with `extra` operations after the reads, in
    /// the last transaction; their answers come back apart.
    pub(super) async fn read_keys_with(
        &self,
        client: &etcd::Client,
        keys: &[String],
        extra: Vec<TxnOp>,
    ) -> Result<(Vec<Option<Entry>>, Vec<TxnOpResponse>), StoreError> {
        let extras = extra.len();
        let ops = keys
            .iter()
            .map(|k| TxnOp::get(k.as_str(), None))
            .chain(extra)
            .collect();
        let mut answers = self.batch(client, ops).await?;
        let extra = answers.split_off(answers.len().saturating_sub(extras));
        let entries = answers
            .iter()
            .map(|answer| match answer {
                TxnOpResponse::Get(got) => Ok(got.kvs().first().map(Entry::of)),
                _ => Err(self.backend("a read answered with something other than its key")),
            })
            .collect::<Result<_, _>>()?;
        Ok((entries, extra))
    }

    /// Every key under `prefix` (keys only, in key order), page by page.
    pub(super) async fn keys_under(
        &self,
        client: &etcd::Client,
        prefix: &str,
    ) -> Result<Vec<String>, StoreError> {
        let end = prefix_end(prefix.as_bytes());
        let mut from = prefix.as_bytes().to_vec();
        let mut keys = Vec::new();
        let mut kv = client.kv_client();
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_keys_only()
                .with_limit(KEYS_PAGE);
            let page = self.timed(kv.get(from.clone(), Some(options))).await?;
            let mut last = None;
            for item in page.kvs() {
                last = Some(item.key().to_vec());
                if let Ok(key) = String::from_utf8(item.key().to_vec()) {
                    keys.push(key);
                }
            }
            match last {
                Some(mut next) if page.more() => {
                    next.push(0);
                    from = next;
                }
                _ => return Ok(keys),
            }
        }
    }

    /// One fresh lease per distinct TTL of `ttls`: TTL → lease id. A lease
    /// left unused (its claim lost) just expires.
    pub(super) async fn grant(
        &self,
        client: &etcd::Client,
        mut ttls: Vec<i64>,
    ) -> Result<HashMap<i64, i64>, StoreError> {
        ttls.sort_unstable();
        ttls.dedup();
        let grants = ttls.into_iter().map(|ttl| {
            let mut leases = client.lease_client();
            async move {
                let granted = self.timed(leases.grant(ttl, None)).await?;
                if !granted.error().is_empty() {
                    return Err(self.backend(format!(
                        "etcd refused a lease of {ttl} s: {}",
                        granted.error()
                    )));
                }
                Ok::<(i64, i64), StoreError>((ttl, granted.id()))
            }
        });
        Ok(try_join_all(grants).await?.into_iter().collect())
    }

    /// Every job's keys (and, for claims, the time left on its lease).
    pub(super) async fn view(
        &self,
        client: &etcd::Client,
        jobs: &[&str],
        want: Want,
    ) -> Result<Vec<JobView>, StoreError> {
        self.view_with(client, jobs, want, Vec::new())
            .await
            .map(|(views, _)| views)
    }

    /// [`EtcdStore::view`] with `extra` operations in its last transaction
    /// ([`EtcdStore::read_keys_with`]).
    pub(super) async fn view_with(
        &self,
        client: &etcd::Client,
        jobs: &[&str],
        want: Want,
        extra: Vec<TxnOp>,
    ) -> Result<(Vec<JobView>, Vec<TxnOpResponse>), StoreError> {
        let mut keys = Vec::with_capacity(jobs.len() * 2);
        for job in jobs {
            if want.lock() {
                keys.push(self.keys.of(Kind::Lock, job));
            }
            if want.lease() {
                keys.push(self.keys.of(Kind::Lease, job));
            }
        }
        let (entries, extra) = self.read_keys_with(client, &keys, extra).await?;
        let mut entries = entries.into_iter();
        let mut read = Vec::with_capacity(jobs.len());
        for _ in jobs {
            let lock = want.lock().then(|| entries.next().flatten()).flatten();
            let lease = want.lease().then(|| entries.next().flatten()).flatten();
            read.push(JobKeys { lock, lease });
        }
        let now = now_ms();
        let views = read.into_iter().map(|keys| JobView { keys, now }).collect();
        Ok((views, extra))
    }

    /// Applies each plan as a nested transaction, after granting the leases
    /// they put keys with. Nested transactions go in transactions with no
    /// compares of their own, as many as [`MAX_TXN_OPS`] allows, sent
    /// together; two plans for the same key go in different ones (etcd
    /// refuses a transaction that writes a key twice). Answers the indexes
    /// of the plans whose compares failed: their keys changed since read.
    pub(super) async fn write(
        &self,
        client: &etcd::Client,
        plans: Vec<(usize, Plan)>,
    ) -> Result<Vec<usize>, StoreError> {
        if plans.is_empty() {
            return Ok(Vec::new());
        }
        let ttls = plans.iter().flat_map(|(_, p)| p.ttls()).collect();
        let leases = self.grant(client, ttls).await?;
        let widest = plans.iter().map(|(_, p)| p.width()).max().unwrap_or(1);
        // Wave k holds the k-th plan of each key.
        let mut waves: Vec<Vec<(usize, TxnOp)>> = Vec::new();
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, plan) in plans {
            let count = seen.entry(plan.ident().to_string()).or_insert(0);
            let wave = *count;
            *count += 1;
            let item = (
                i,
                TxnOp::txn(plan.into_txn(&leases).map_err(|m| self.backend(m))?),
            );
            match waves.get_mut(wave) {
                Some(w) => w.push(item),
                None => waves.push(vec![item]),
            }
        }
        let mut order = Vec::new();
        let mut chunks = Vec::new();
        for wave in waves {
            for chunk in chunked(wave, nested_per_txn(widest)) {
                let (idx, ops): (Vec<usize>, Vec<TxnOp>) = chunk.into_iter().unzip();
                order.extend(idx);
                chunks.push(ops);
            }
        }
        let answers = self.send(client, chunks).await?;
        let mut changed = Vec::new();
        for (i, answer) in order.into_iter().zip(answers) {
            match answer {
                TxnOpResponse::Txn(t) if t.succeeded() => {}
                TxnOpResponse::Txn(_) => changed.push(i),
                _ => {
                    return Err(self.backend(
                        "a nested transaction answered with something other than a transaction",
                    ));
                }
            }
        }
        Ok(changed)
    }

    /// Reads, decides with `decide_one` and writes until every job's write
    /// went through or none is left to write: a job whose keys changed
    /// between read and write is read and decided again, within
    /// `op_timeout`. `decide_one(i, view)` answers the write wanted, if any,
    /// and the answer. Returns this host's clock at the first read.
    pub(super) async fn read_decide_write<A>(
        &self,
        client: &etcd::Client,
        jobs: &[&str],
        want: Want,
        decide_one: impl FnMut(usize, &JobView) -> (Option<Plan>, A),
    ) -> Result<(i64, Vec<A>), StoreError> {
        self.read_decide_write_with(client, jobs, want, Vec::new(), decide_one)
            .await
            .map(|(now, answers, _)| (now, answers))
    }

    /// [`EtcdStore::read_decide_write`] with `extra` operations in the
    /// first read's last transaction; their answers come back too. The loop
    /// is [`cas::decide_and_write`]'s; this store brings its reads and
    /// transactions ([`EtcdCas`]).
    pub(super) async fn read_decide_write_with<A>(
        &self,
        client: &etcd::Client,
        jobs: &[&str],
        want: Want,
        extra: Vec<TxnOp>,
        decide_one: impl FnMut(usize, &JobView) -> (Option<Plan>, A),
    ) -> Result<(i64, Vec<A>, Vec<TxnOpResponse>), StoreError> {
        let deadline = tokio::time::Instant::now() + self.op_timeout;
        let (views, extra) = self.view_with(client, jobs, want, extra).await?;
        let now = views.first().map_or_else(now_ms, |v| v.now);
        let transport = EtcdCas {
            store: self,
            client,
            want,
        };
        let answers = cas::decide_and_write(
            &transport,
            jobs,
            &views,
            deadline,
            self.op_timeout,
            decide_one,
        )
        .await?;
        Ok((now, answers, extra))
    }
}

/// Keys per call of [`EtcdStore::range_all`]: a lock record is a few hundred
/// bytes, so a page stays far below gRPC's 4 MiB answer.
pub(super) const RANGE_PAGE: i64 = 2_000;
